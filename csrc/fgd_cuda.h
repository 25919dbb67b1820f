/* fgd_fast CUDA kernels: the interface shared by the .cu files and the torch binding.
 *
 * Plain C/C++ with no ATen or torch header, so the kernels compile with nvcc alone.
 * fgd_fast/backends/cuda.py builds the tables described here; keep the two in step
 * (the binding exports these numbers in constants(), which cuda.py reads when it loads).
 *
 * Matrix convention: layer l is θ (n × p, n >= p); element θ[r, c] lives at
 * theta + r * sr + c * sc (strides in elements), and the same for Φ and g with their own
 * strides. That covers both layouts: θ = W2ᵀ ("rows", memory (p, n) row-major: sr = 1,
 * sc = n) and θ = W2 (memory (n, p) row-major: sr = p, sc = 1).
 */
#ifndef FGD_CUDA_H
#define FGD_CUDA_H

#include <cuda_runtime_api.h>

/* ---- tile sizes (cuda.py reads them from the binding to size the work) ---- */
#define FGD_GRAM_TILE 64     /* Gram output tile: 64 × 64 elements of one p × p block */
#define FGD_GRAM_BK 32       /* rows of n loaded per step of the Gram K loop */
#define FGD_GRAM_THREADS 256 /* 16 × 16 threads, 4 × 4 outputs each */
#define FGD_UPD_ROWS 32      /* update: rows of θ owned by one work item (a row block) */
#define FGD_UPD_COLS 64      /* update: output columns computed per inner tile */
#define FGD_UPD_BK 32        /* update: K step over the p columns of θ */
#define FGD_UPD_THREADS 256  /* 16 × 16 threads, 2 × 4 outputs of θ₊ and of Φ₊ each */

/* ---- which sources built this: a hash of csrc/ (fgd_fast/_cuda_build.py passes it; -1 when not
 * given), exported by constants() so that a prebuilt fgd_fast._C older than edited sources is not used */
#ifndef FGD_SOURCE_HASH
#define FGD_SOURCE_HASH (-1LL)
#endif

/* ---- parameter dtype codes (the accumulation type follows: double for F64, else float) ---- */
enum { FGD_F32 = 0, FGD_F16 = 1, FGD_BF16 = 2, FGD_F64 = 3 };

/* ---- the per-layer metadata table: int64, row-major (num_layers, FGD_META_FIELDS) ---- */
enum {
    FGD_M_THETA = 0,       /* address of θ's storage (the parameter dtype)                 */
    FGD_M_PHI = 1,         /* address of Φ (float for 16-bit parameters), 0 when absent    */
    FGD_M_GRAD = 2,        /* address of g (the parameter dtype)                           */
    FGD_M_N = 3,           /* rows of θ                                                    */
    FGD_M_P = 4,           /* columns of θ                                                 */
    FGD_M_THETA_SR = 5,    /* θ[r, c] = theta[r * SR + c * SC]                             */
    FGD_M_THETA_SC = 6,
    FGD_M_PHI_SR = 7,
    FGD_M_PHI_SC = 8,
    FGD_M_GRAD_SR = 9,
    FGD_M_GRAD_SC = 10,
    FGD_M_FLAGS = 11,      /* FGD_READS_PHI | FGD_WRITES_PHI                               */
    FGD_M_GRAM_OFF = 12,   /* element offset of the layer's Gram blocks in one split slab  */
    FGD_M_M_OFF = 13,      /* element offset of the layer's [M_θ | M_Φ] (2 p² elements)     */
    FGD_M_FIRST_TILE = 14, /* first Gram work tile of the layer (prefix sum over layers)   */
    FGD_M_FIRST_BLOCK = 15,/* first update row block of the layer (prefix sum)             */
    FGD_M_CHUNK = 16,      /* rows of n per Gram split (a multiple of FGD_GRAM_BK)         */
    FGD_META_FIELDS = 17
};

enum {
    FGD_READS_PHI = 1, /* Φ is read: B, C and βΦ are used (not on a first step)  */
    FGD_WRITES_PHI = 2 /* Φ₊ is stored (momentum > 0)                             */
};

/* Gram blocks of a layer, each p × p row-major in the accumulation type, at GRAM_OFF:
 * slot 0 A = θᵀθ, slot 1 E = θᵀg, and when FGD_READS_PHI: slot 2 B = θᵀΦ, slot 3 C = ΦᵀΦ.
 * The update matrices at M_OFF: [M_θ | M_Φ]. The Triton backend uses the same order (the
 * binding exports both, fgd_fast/backends/cuda.py checks them against fgd_fast/backends/base.py). */
enum { FGD_SLOT_A = 0, FGD_SLOT_E = 1, FGD_SLOT_B = 2, FGD_SLOT_C = 3 };
enum { FGD_SLOT_M_THETA = 0, FGD_SLOT_M_PHI = 1 };

/* the per-layer hyper-parameter table: (num_layers, FGD_HYPER_FIELDS) in the accumulation type */
enum { FGD_H_LR = 0, FGD_H_BETA = 1, FGD_H_ALPHA = 2, FGD_HYPER_FIELDS = 3 };

#ifdef __cplusplus
extern "C" {
#endif

/* Pass 1. One launch for every layer: grid (total_tiles, splits). Split s writes the
 * Gram blocks of rows [s·chunk, (s+1)·chunk) into partial + s·gram_total. */
cudaError_t fgd_gram_launch(int dtype, const long long* meta, int num_layers, void* partial,
                            long long gram_total, long long total_tiles, int splits,
                            cudaStream_t stream);

/* out[i] = Σ_s partial[s·total + i], summed in the fixed order s = 0, 1, …: deterministic. */
cudaError_t fgd_sum_splits_launch(int acc_is_double, const void* partial, void* out,
                                  long long total, int splits, cudaStream_t stream);

/* Pass 2. One launch: θ₊ = θ + U + θ M_θ, Φ₊ = U + θ M_Φ (U = βΦ − ηg) for every row block
 * of every layer. hyper: (num_layers, 3) of η, β, α in the accumulation type; mats: the
 * [M_θ | M_Φ] blocks; scratch: grid · FGD_UPD_ROWS · p_max accumulation-type elements. */
cudaError_t fgd_update_launch(int dtype, const long long* meta, const void* hyper, int num_layers,
                              const void* mats, void* scratch, long long total_blocks, int grid,
                              long long p_max, cudaStream_t stream);

#ifdef __cplusplus
}
#endif

#endif /* FGD_CUDA_H */
