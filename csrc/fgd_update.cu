// Pass 2 of the FGD step, for every layer in one launch:
//     U  = βΦ − ηg            (Φ not read on a first step: U = −ηg)
//     θ₊ = θ + U + θ M_θ
//     Φ₊ = U + θ M_Φ          (not stored when momentum == 0)
// with M_θ, M_Φ the p × p matrices of the O(p³) middle (row-major in `mats`).
//
// Work item = one row block of FGD_UPD_ROWS rows of one layer (found by binary search over
// FGD_M_FIRST_BLOCK); a persistent grid of `grid` blocks strides over the items. Every
// output column of θ₊ needs the whole row of θ, so the block owning a row block owns it for
// all p columns: it first copies θ[r0 : r0 + ROWS, :] into its own slice of `scratch`
// (ROWS · p_max elements per block), then computes each 32 × 64 output tile from that
// snapshot and writes θ₊, Φ₊ straight into the tensors. No other block reads these rows,
// so writing θ in place is race-free. Scratch bound: grid · ROWS · p_max · sizeof(Acc).
#include <climits>

#include "fgd_device.cuh"

namespace fgd {

constexpr int ROWS = FGD_UPD_ROWS, COLS = FGD_UPD_COLS, UK = FGD_UPD_BK, UT = FGD_UPD_THREADS;
static_assert(ROWS == 32 && COLS == 64 && UT == 256, "16 × 16 threads compute 2 × 4 outputs each");

// Position of θ[r0 + rr, c] in a block's snapshot: column-major (c · ROWS + rr) when θ's rows
// are the unit-stride dimension, else row-major (rr · p + c); copies coalesce either way.
__device__ __forceinline__ long long snap_index(bool rows_fast, int rr, long long c, long long p) {
    return rows_fast ? c * ROWS + rr : (long long)rr * p + c;
}

template <typename T>
__global__ void __launch_bounds__(UT) fgd_update_kernel(const long long* meta, const typename AccOf<T>::type* hyper,
                                                        int num_layers, const typename AccOf<T>::type* mats,
                                                        typename AccOf<T>::type* scratch, long long total_blocks,
                                                        long long p_max) {
    using Acc = typename AccOf<T>::type;
    __shared__ Acc Ts[ROWS][UK + 1];  // snapshot tile θ[rows, k0 : k0 + UK]
    __shared__ Acc Mt[UK][COLS];      // M_θ[k0 : k0 + UK, c0 : c0 + COLS]
    __shared__ Acc Mp[UK][COLS];      // M_Φ[k0 : k0 + UK, c0 : c0 + COLS]
    Acc* snap = scratch + (long long)blockIdx.x * ROWS * p_max;

    for (long long w = blockIdx.x; w < total_blocks; w += gridDim.x) {
        const int layer = find_layer(meta, num_layers, FGD_M_FIRST_BLOCK, w);
        const long long* m = meta + (long long)layer * FGD_META_FIELDS;
        const long long n = m[FGD_M_N], p = m[FGD_M_P];
        const long long r0 = (w - m[FGD_M_FIRST_BLOCK]) * ROWS;
        const int rows = (int)((n - r0 < ROWS) ? n - r0 : ROWS);
        const bool reads_phi = (m[FGD_M_FLAGS] & FGD_READS_PHI) != 0;
        const bool writes_phi = (m[FGD_M_FLAGS] & FGD_WRITES_PHI) != 0;
        T* theta = reinterpret_cast<T*>(m[FGD_M_THETA]);
        Acc* phi = reinterpret_cast<Acc*>(m[FGD_M_PHI]);
        const T* grad = reinterpret_cast<const T*>(m[FGD_M_GRAD]);
        const long long tsr = m[FGD_M_THETA_SR], tsc = m[FGD_M_THETA_SC];
        const long long psr = m[FGD_M_PHI_SR], psc = m[FGD_M_PHI_SC];
        const long long gsr = m[FGD_M_GRAD_SR], gsc = m[FGD_M_GRAD_SC];
        const Acc* h = hyper + (long long)layer * FGD_HYPER_FIELDS;
        const Acc eta = h[FGD_H_LR], beta = h[FGD_H_BETA];
        const Acc* m_theta = mats + m[FGD_M_M_OFF] + FGD_SLOT_M_THETA * p * p;  // [M_θ | M_Φ]
        const Acc* m_phi = mats + m[FGD_M_M_OFF] + FGD_SLOT_M_PHI * p * p;
        const bool rows_fast = (tsr == 1);

        // 1. snapshot the old rows θ[r0 : r0 + ROWS, :] (zeros past n)
        for (long long i = threadIdx.x; i < ROWS * p; i += UT) {
            const int rr = (int)(rows_fast ? i % ROWS : i / p);
            const long long c = rows_fast ? i / ROWS : i % p;
            snap[snap_index(rows_fast, rr, c, p)] = rr < rows ? to_acc(theta[(r0 + rr) * tsr + c * tsc]) : Acc(0);
        }
        __syncthreads();  // the snapshot (global memory) is visible to the whole block

        // thread → outputs (rr = lr + 16u, c = c0 + lc + 16v); the unit-stride dimension of θ
        // varies fastest across a warp so the epilogue's loads and stores coalesce
        const int lr = rows_fast ? threadIdx.x % 16 : threadIdx.x / 16;
        const int lc = rows_fast ? threadIdx.x / 16 : threadIdx.x % 16;

        for (long long c0 = 0; c0 < p; c0 += COLS) {
            Acc at[2][4], ap[2][4];
            for (int u = 0; u < 2; ++u)
                for (int v = 0; v < 4; ++v) at[u][v] = ap[u][v] = Acc(0);

            for (long long k0 = 0; k0 < p; k0 += UK) {
                for (int i = threadIdx.x; i < ROWS * UK; i += UT) {
                    const int rr = rows_fast ? i % ROWS : i / UK;
                    const int kk = rows_fast ? i / ROWS : i % UK;
                    const long long k = k0 + kk;
                    Ts[rr][kk] = k < p ? snap[snap_index(rows_fast, rr, k, p)] : Acc(0);
                }
                for (int i = threadIdx.x; i < UK * COLS; i += UT) {
                    const int kk = i / COLS, cc = i % COLS;
                    const long long k = k0 + kk, c = c0 + cc;
                    const bool in = k < p && c < p;
                    Mt[kk][cc] = in ? m_theta[k * p + c] : Acc(0);
                    Mp[kk][cc] = in ? m_phi[k * p + c] : Acc(0);
                }
                __syncthreads();
                for (int kk = 0; kk < UK; ++kk) {
                    Acc t[2], mt[4], mp[4];
                    for (int u = 0; u < 2; ++u) t[u] = Ts[lr + 16 * u][kk];
                    for (int v = 0; v < 4; ++v) {
                        mt[v] = Mt[kk][lc + 16 * v];
                        mp[v] = Mp[kk][lc + 16 * v];
                    }
                    for (int u = 0; u < 2; ++u)
                        for (int v = 0; v < 4; ++v) {
                            at[u][v] += t[u] * mt[v];  // (θ M_θ)[r, c] += θ[r, k] M_θ[k, c]
                            ap[u][v] += t[u] * mp[v];  // (θ M_Φ)[r, c] += θ[r, k] M_Φ[k, c]
                        }
                }
                __syncthreads();
            }

            for (int u = 0; u < 2; ++u) {
                const int rr = lr + 16 * u;
                if (rr >= rows) continue;
                const long long r = r0 + rr;
                for (int v = 0; v < 4; ++v) {
                    const long long c = c0 + lc + 16 * v;
                    if (c >= p) continue;
                    // U = βΦ − ηg; a term whose (guard-scaled) coefficient is 0 is not read, so a
                    // reset step (s = 0) over a non-finite g or Φ writes the pull-back, not 0·Inf
                    Acc uu = eta == Acc(0) ? Acc(0) : -eta * to_acc(grad[r * gsr + c * gsc]);
                    if (reads_phi && beta != Acc(0)) uu += beta * phi[r * psr + c * psc];
                    const Acc old = snap[snap_index(rows_fast, rr, c, p)];
                    theta[r * tsr + c * tsc] = from_acc<T>(old + uu + at[u][v]);  // θ₊ = θ + U + θ M_θ
                    if (writes_phi) phi[r * psr + c * psc] = uu + ap[u][v];      // Φ₊ = U + θ M_Φ
                }
            }
        }
        __syncthreads();  // the next work item overwrites the snapshot
    }
}

}  // namespace fgd

extern "C" cudaError_t fgd_update_launch(int dtype, const long long* meta, const void* hyper, int num_layers,
                                         const void* mats, void* scratch, long long total_blocks, int grid,
                                         long long p_max, cudaStream_t stream) {
    if (num_layers <= 0 || total_blocks <= 0) return cudaSuccess;
    if (grid < 1 || p_max < 1) return cudaErrorInvalidValue;
    switch (dtype) {
        case FGD_F32:
            fgd::fgd_update_kernel<float><<<grid, fgd::UT, 0, stream>>>(
                meta, (const float*)hyper, num_layers, (const float*)mats, (float*)scratch, total_blocks, p_max);
            break;
        case FGD_F64:
            fgd::fgd_update_kernel<double><<<grid, fgd::UT, 0, stream>>>(
                meta, (const double*)hyper, num_layers, (const double*)mats, (double*)scratch, total_blocks, p_max);
            break;
        case FGD_F16:
            fgd::fgd_update_kernel<__half><<<grid, fgd::UT, 0, stream>>>(
                meta, (const float*)hyper, num_layers, (const float*)mats, (float*)scratch, total_blocks, p_max);
            break;
        case FGD_BF16:
            fgd::fgd_update_kernel<__nv_bfloat16><<<grid, fgd::UT, 0, stream>>>(
                meta, (const float*)hyper, num_layers, (const float*)mats, (float*)scratch, total_blocks, p_max);
            break;
        default:
            return cudaErrorInvalidValue;
    }
    return cudaGetLastError();
}
