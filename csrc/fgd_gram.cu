// Pass 1 of the FGD step: the Gram blocks A = θᵀθ, E = θᵀg, B = θᵀΦ, C = ΦᵀΦ of every
// layer in one launch, split over n with a deterministic two-stage reduction.
//
// Grid (total_tiles, splits), FGD_GRAM_THREADS threads. blockIdx.x is a global tile id:
// the layer is found by binary search over FGD_M_FIRST_TILE, and the layer-local id is
// decoded as [A upper-triangle tiles | E tiles | B tiles | C upper-triangle tiles] (B, C
// only when the layer reads Φ). A block computes one 64 × 64 output tile XᵀY over rows
// [s·chunk, (s+1)·chunk) of n (s = blockIdx.y) and writes it to split s's slab of the
// partials buffer: no atomics, every element of a slab is written exactly once. A and C
// are symmetric: tiles with ti < tj also store their transpose, so each is computed once.
// fgd_sum_splits_kernel then adds the slabs in the fixed order s = 0, 1, … .
#include <climits>

#include "fgd_device.cuh"

namespace fgd {

constexpr int TILE = FGD_GRAM_TILE, BK = FGD_GRAM_BK, NT = FGD_GRAM_THREADS;
static_assert(TILE == 64 && NT == 256, "the 16 × 16 thread grid computes 4 × 4 outputs each");

// (ti, tj) with ti <= tj of the t-th tile of an nt × nt upper triangle, row by row
// (t < nt(nt + 1)/2, checked by the caller; the loop is bounded by nt all the same).
__device__ __forceinline__ void upper_tile(long long t, long long nt, long long& ti, long long& tj) {
    long long i = 0;
    while (i < nt && t >= nt - i) {
        t -= nt - i;
        ++i;
    }
    ti = i;
    tj = i + t;
}

template <typename T>
__global__ void __launch_bounds__(NT) fgd_gram_kernel(const long long* meta, int num_layers,
                                                      typename AccOf<T>::type* partial, long long gram_total) {
    using Acc = typename AccOf<T>::type;
    __shared__ Acc Xs[BK][TILE + 1];
    __shared__ Acc Ys[BK][TILE + 1];

    const long long tile = blockIdx.x;
    const int layer = find_layer(meta, num_layers, FGD_M_FIRST_TILE, tile);
    const long long* m = meta + (long long)layer * FGD_META_FIELDS;
    const long long n = m[FGD_M_N], p = m[FGD_M_P], chunk = m[FGD_M_CHUNK];
    const T* theta = reinterpret_cast<const T*>(m[FGD_M_THETA]);
    const Acc* phi = reinterpret_cast<const Acc*>(m[FGD_M_PHI]);
    const T* grad = reinterpret_cast<const T*>(m[FGD_M_GRAD]);

    // which block (slot) and which tile of it
    const long long nt = (p + TILE - 1) / TILE, nsym = nt * (nt + 1) / 2, nfull = nt * nt;
    long long local = tile - m[FGD_M_FIRST_TILE], ti, tj;
    // a grid larger than the layers' tiles (an inconsistent count from the host): the extra blocks
    // write nothing (whole blocks return, before any barrier), where they looped or read a missing Φ
    const bool reads_phi = (m[FGD_M_FLAGS] & FGD_READS_PHI) != 0;
    if (local < 0 || local >= (nsym + nfull) * (reads_phi ? 2 : 1)) return;
    int slot;
    if (local < nsym) {
        slot = FGD_SLOT_A;
        upper_tile(local, nt, ti, tj);
    } else if ((local -= nsym) < nfull) {
        slot = FGD_SLOT_E;
        ti = local / nt;
        tj = local % nt;
    } else if ((local -= nfull) < nfull) {
        slot = FGD_SLOT_B;
        ti = local / nt;
        tj = local % nt;
    } else {  // B and C tiles exist only for layers that read Φ (cuda.py counts them so)
        local -= nfull;
        slot = FGD_SLOT_C;
        upper_tile(local, nt, ti, tj);
    }
    const bool symmetric = (slot == FGD_SLOT_A || slot == FGD_SLOT_C);

    // the operands of this product XᵀY (A = θᵀθ, E = θᵀg, B = θᵀΦ, C = ΦᵀΦ), strided n × p
    const bool x_is_phi = (slot == FGD_SLOT_C);
    const long long xsr = x_is_phi ? m[FGD_M_PHI_SR] : m[FGD_M_THETA_SR];
    const long long xsc = x_is_phi ? m[FGD_M_PHI_SC] : m[FGD_M_THETA_SC];
    long long ysr, ysc;
    if (slot == FGD_SLOT_A) {
        ysr = m[FGD_M_THETA_SR];
        ysc = m[FGD_M_THETA_SC];
    } else if (slot == FGD_SLOT_E) {
        ysr = m[FGD_M_GRAD_SR];
        ysc = m[FGD_M_GRAD_SC];
    } else {
        ysr = m[FGD_M_PHI_SR];
        ysc = m[FGD_M_PHI_SC];
    }

    const long long k_begin = (long long)blockIdx.y * chunk;
    const long long k_end = (k_begin + chunk < n) ? k_begin + chunk : n;
    const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;

    Acc acc[4][4];
    for (int u = 0; u < 4; ++u)
        for (int v = 0; v < 4; ++v) acc[u][v] = Acc(0);

    for (long long k0 = k_begin; k0 < k_end; k0 += BK) {
        // stage rows [k0, k0 + BK) of X[:, ti-tile] and Y[:, tj-tile]
        if (x_is_phi) load_tile<BK, TILE, NT>(Xs, phi, xsr, xsc, k0, k_end, ti * TILE, p);
        else load_tile<BK, TILE, NT>(Xs, theta, xsr, xsc, k0, k_end, ti * TILE, p);
        if (slot == FGD_SLOT_E) load_tile<BK, TILE, NT>(Ys, grad, ysr, ysc, k0, k_end, tj * TILE, p);
        else if (slot == FGD_SLOT_A) load_tile<BK, TILE, NT>(Ys, theta, ysr, ysc, k0, k_end, tj * TILE, p);
        else load_tile<BK, TILE, NT>(Ys, phi, ysr, ysc, k0, k_end, tj * TILE, p);
        __syncthreads();
        for (int kk = 0; kk < BK; ++kk) {
            Acc a[4], b[4];
            for (int u = 0; u < 4; ++u) a[u] = Xs[kk][ty + 16 * u];
            for (int v = 0; v < 4; ++v) b[v] = Ys[kk][tx + 16 * v];
            for (int u = 0; u < 4; ++u)
                for (int v = 0; v < 4; ++v) acc[u][v] += a[u] * b[v];  // (XᵀY)[r, c] += X[k, r] Y[k, c]
        }
        __syncthreads();
    }

    // store this split's tile (and its mirror for A, C); rows/columns past p are dropped
    Acc* out = partial + (long long)blockIdx.y * gram_total + m[FGD_M_GRAM_OFF] + (long long)slot * p * p;
    for (int u = 0; u < 4; ++u) {
        const long long r = ti * TILE + ty + 16 * u;
        for (int v = 0; v < 4; ++v) {
            const long long c = tj * TILE + tx + 16 * v;
            if (r < p && c < p) {
                out[r * p + c] = acc[u][v];
                if (symmetric && ti != tj) out[c * p + r] = acc[u][v];  // A, C symmetric: mirror
            }
        }
    }
}

// out[i] = Σ_s partial[s · total + i] in the fixed order s = 0, 1, …, splits − 1.
template <typename Acc>
__global__ void fgd_sum_splits_kernel(const Acc* partial, Acc* out, long long total, int splits) {
    const long long step = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += step) {
        Acc s = partial[i];
        for (int k = 1; k < splits; ++k) s += partial[(long long)k * total + i];
        out[i] = s;
    }
}

}  // namespace fgd

extern "C" cudaError_t fgd_gram_launch(int dtype, const long long* meta, int num_layers, void* partial,
                                       long long gram_total, long long total_tiles, int splits,
                                       cudaStream_t stream) {
    if (num_layers <= 0 || total_tiles <= 0) return cudaSuccess;
    if (total_tiles > INT_MAX || splits < 1 || splits > 65535) return cudaErrorInvalidValue;
    const dim3 grid((unsigned)total_tiles, (unsigned)splits);
    switch (dtype) {
        case FGD_F32:
            fgd::fgd_gram_kernel<float><<<grid, fgd::NT, 0, stream>>>(meta, num_layers, (float*)partial, gram_total);
            break;
        case FGD_F64:
            fgd::fgd_gram_kernel<double><<<grid, fgd::NT, 0, stream>>>(meta, num_layers, (double*)partial, gram_total);
            break;
        case FGD_F16:
            fgd::fgd_gram_kernel<__half><<<grid, fgd::NT, 0, stream>>>(meta, num_layers, (float*)partial, gram_total);
            break;
        case FGD_BF16:
            fgd::fgd_gram_kernel<__nv_bfloat16>
                <<<grid, fgd::NT, 0, stream>>>(meta, num_layers, (float*)partial, gram_total);
            break;
        default:
            return cudaErrorInvalidValue;
    }
    return cudaGetLastError();
}

extern "C" cudaError_t fgd_sum_splits_launch(int acc_is_double, const void* partial, void* out, long long total,
                                             int splits, cudaStream_t stream) {
    if (total <= 0) return cudaSuccess;
    if (splits < 1) return cudaErrorInvalidValue;
    const long long want = (total + 255) / 256;
    const unsigned blocks = (unsigned)(want < 4096 ? want : 4096);  // grid-stride loop covers the rest
    if (acc_is_double)
        fgd::fgd_sum_splits_kernel<double><<<blocks, 256, 0, stream>>>((const double*)partial, (double*)out, total, splits);
    else
        fgd::fgd_sum_splits_kernel<float><<<blocks, 256, 0, stream>>>((const float*)partial, (float*)out, total, splits);
    return cudaGetLastError();
}
