// Device helpers shared by the fgd_fast kernels: dtype conversion, the metadata lookup and
// a bounds-checked tile loader. CUDA headers only (no ATen), included by the .cu files.
#ifndef FGD_DEVICE_CUH
#define FGD_DEVICE_CUH

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "fgd_cuda.h"

namespace fgd {

// Accumulation type: double for double parameters, float for float/half/bfloat16.
template <typename T> struct AccOf { using type = float; };
template <> struct AccOf<double> { using type = double; };

__device__ __forceinline__ float to_acc(float x) { return x; }
__device__ __forceinline__ double to_acc(double x) { return x; }
__device__ __forceinline__ float to_acc(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_acc(__nv_bfloat16 x) { return __bfloat162float(x); }

// Round an accumulator once to the storage type (round to nearest even).
template <typename T> __device__ __forceinline__ T from_acc(typename AccOf<T>::type x);
template <> __device__ __forceinline__ float from_acc<float>(float x) { return x; }
template <> __device__ __forceinline__ double from_acc<double>(double x) { return x; }
template <> __device__ __forceinline__ __half from_acc<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_acc<__nv_bfloat16>(float x) {
    return __float2bfloat16_rn(x);
}

// The layer that owns work item `id`: the last l with meta[l][field] <= id. The first ids
// are strictly increasing (every layer has at least one tile and one row block).
__device__ __forceinline__ int find_layer(const long long* meta, int num_layers, int field, long long id) {
    int lo = 0, hi = num_layers - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (meta[(long long)mid * FGD_META_FIELDS + field] <= id) lo = mid;
        else hi = mid - 1;
    }
    return lo;
}

// S[kk][cc] = X[k0 + kk, c0 + cc] for a BK × TW tile of a strided n × p matrix, as Acc,
// with zeros outside rows [.., k_end) and columns [.., p). Consecutive threads walk the
// dimension with unit stride (rows when sr == 1, else columns) so global reads coalesce;
// the +1 padding of S keeps the row-wise stores free of bank conflicts.
template <int BK, int TW, int NT, typename Acc, typename T>
__device__ __forceinline__ void load_tile(Acc (*S)[TW + 1], const T* X, long long sr, long long sc,
                                          long long k0, long long k_end, long long c0, long long p) {
    const bool rows_fast = (sr == 1);
    for (int i = threadIdx.x; i < BK * TW; i += NT) {
        const int kk = rows_fast ? i % BK : i / TW;
        const int cc = rows_fast ? i / BK : i % TW;
        const long long k = k0 + kk, c = c0 + cc;
        Acc v = Acc(0);
        if (k < k_end && c < p) v = to_acc(X[k * sr + c * sc]);
        S[kk][cc] = v;
    }
}

}  // namespace fgd

#endif  // FGD_DEVICE_CUH
