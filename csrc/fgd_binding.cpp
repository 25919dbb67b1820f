// Torch binding of the fgd_fast CUDA kernels: the module fgd_fast._C (setup.py) or its
// just-in-time twin (fgd_fast/_cuda_build.py). It checks its arguments, launches on the
// current stream of the tensors' device and turns any CUDA error into a Python
// RuntimeError; the arithmetic lives in the .cu files.
//
// Binding choice: pybind11 functions, not torch.library ops. The kernels reach every
// parameter, buffer and gradient through raw addresses in the int64 metadata tensor, so an
// op schema could not state what they read and write (alias annotations such as Tensor(a!)
// only describe tensor arguments); registering them with the dispatcher would give
// torch.compile and functionalization a false picture. The optimizer step runs eagerly
// under no_grad, so a plain Python-callable function is the honest interface.
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>

#include <cstdint>

#include "fgd_cuda.h"

static_assert(sizeof(long long) == sizeof(int64_t), "the metadata table is int64");

namespace {

void check_cuda(cudaError_t err, const char* what) {
    TORCH_CHECK(err == cudaSuccess, "fgd_fast CUDA extension: ", what, " failed: ", cudaGetErrorName(err), " (",
                cudaGetErrorString(err), ")");
}

at::ScalarType acc_type(int64_t dtype) {
    TORCH_CHECK(dtype == FGD_F32 || dtype == FGD_F16 || dtype == FGD_BF16 || dtype == FGD_F64,
                "fgd_fast CUDA extension: unknown dtype code ", dtype);
    return dtype == FGD_F64 ? at::kDouble : at::kFloat;
}

void check_meta(const at::Tensor& meta) {
    TORCH_CHECK(meta.is_cuda() && meta.scalar_type() == at::kLong && meta.dim() == 2 &&
                    meta.size(1) == FGD_META_FIELDS && meta.is_contiguous(),
                "fgd_fast CUDA extension: meta must be a contiguous CUDA int64 tensor of shape (layers, ",
                FGD_META_FIELDS, "), got ", meta.sizes(), " ", meta.scalar_type(), " on ", meta.device());
}

// A contiguous CUDA tensor of the accumulation type with at least `numel` elements on meta's device.
void check_acc(const at::Tensor& t, const at::Tensor& meta, int64_t dtype, int64_t numel, const char* name) {
    TORCH_CHECK(t.is_cuda() && t.device() == meta.device() && t.scalar_type() == acc_type(dtype) &&
                    t.is_contiguous() && t.numel() >= numel,
                "fgd_fast CUDA extension: ", name, " must be a contiguous ", acc_type(dtype), " tensor of at least ",
                numel, " elements on ", meta.device(), ", got ", t.numel(), " ", t.scalar_type(), " on ", t.device());
}

const long long* meta_ptr(const at::Tensor& meta) {
    return reinterpret_cast<const long long*>(meta.data_ptr<int64_t>());
}

// Pass 1: Gram blocks of every layer into `partial` (splits slabs of gram_total elements).
void gram(const at::Tensor& meta, at::Tensor& partial, int64_t gram_total, int64_t total_tiles, int64_t splits,
          int64_t dtype) {
    check_meta(meta);
    check_acc(partial, meta, dtype, splits * gram_total, "partial");
    const c10::cuda::CUDAGuard guard(meta.device());
    check_cuda(fgd_gram_launch((int)dtype, meta_ptr(meta), (int)meta.size(0), partial.data_ptr(), gram_total,
                               total_tiles, (int)splits, c10::cuda::getCurrentCUDAStream()),
               "Gram kernel launch");
}

// out = Σ_s partial[s] in the fixed order s = 0, 1, … (deterministic split-n reduction).
void sum_splits(const at::Tensor& partial, at::Tensor& out, int64_t total, int64_t splits) {
    TORCH_CHECK(partial.is_cuda() && out.device() == partial.device() && partial.scalar_type() == out.scalar_type() &&
                    (out.scalar_type() == at::kFloat || out.scalar_type() == at::kDouble) && partial.is_contiguous() &&
                    out.is_contiguous() && out.numel() >= total && partial.numel() >= splits * total,
                "fgd_fast CUDA extension: sum_splits needs contiguous float32/float64 CUDA tensors of ", splits,
                " × ", total, " and ", total, " elements on one device");
    const c10::cuda::CUDAGuard guard(partial.device());
    check_cuda(fgd_sum_splits_launch(out.scalar_type() == at::kDouble, partial.data_ptr(), out.data_ptr(), total,
                                     (int)splits, c10::cuda::getCurrentCUDAStream()),
               "split reduction launch");
}

// Pass 2: θ₊ = θ + U + θ M_θ and Φ₊ = U + θ M_Φ for every row block of every layer.
void update(const at::Tensor& meta, const at::Tensor& hyper, const at::Tensor& mats, at::Tensor& scratch,
            int64_t total_blocks, int64_t grid, int64_t p_max, int64_t dtype) {
    check_meta(meta);
    check_acc(hyper, meta, dtype, 3 * meta.size(0), "hyper");
    check_acc(mats, meta, dtype, 0, "mats");
    check_acc(scratch, meta, dtype, grid * FGD_UPD_ROWS * p_max, "scratch");
    TORCH_CHECK(grid >= 1 && grid <= INT32_MAX, "fgd_fast CUDA extension: bad update grid ", grid);
    const c10::cuda::CUDAGuard guard(meta.device());
    check_cuda(fgd_update_launch((int)dtype, meta_ptr(meta), hyper.data_ptr(), (int)meta.size(0), mats.data_ptr(),
                                 scratch.data_ptr(), total_blocks, (int)grid, p_max, c10::cuda::getCurrentCUDAStream()),
               "update kernel launch");
}

// Debugging aid: wait for the current stream and raise the first asynchronous error.
void synchronize(const at::Tensor& like) {
    const c10::cuda::CUDAGuard guard(like.device());
    check_cuda(cudaStreamSynchronize(c10::cuda::getCurrentCUDAStream()), "stream synchronize");
    check_cuda(cudaGetLastError(), "a kernel");
}

// The numbers of fgd_cuda.h, so Python can check that it sizes work as the kernels expect.
py::dict constants() {
    py::dict d;
    d["META_FIELDS"] = (int)FGD_META_FIELDS;
    py::dict fields;  // column of each per-layer field in the metadata table
    fields["THETA"] = (int)FGD_M_THETA;
    fields["PHI"] = (int)FGD_M_PHI;
    fields["GRAD"] = (int)FGD_M_GRAD;
    fields["N"] = (int)FGD_M_N;
    fields["P"] = (int)FGD_M_P;
    fields["THETA_SR"] = (int)FGD_M_THETA_SR;
    fields["THETA_SC"] = (int)FGD_M_THETA_SC;
    fields["PHI_SR"] = (int)FGD_M_PHI_SR;
    fields["PHI_SC"] = (int)FGD_M_PHI_SC;
    fields["GRAD_SR"] = (int)FGD_M_GRAD_SR;
    fields["GRAD_SC"] = (int)FGD_M_GRAD_SC;
    fields["FLAGS"] = (int)FGD_M_FLAGS;
    fields["GRAM_OFF"] = (int)FGD_M_GRAM_OFF;
    fields["M_OFF"] = (int)FGD_M_M_OFF;
    fields["FIRST_TILE"] = (int)FGD_M_FIRST_TILE;
    fields["FIRST_BLOCK"] = (int)FGD_M_FIRST_BLOCK;
    fields["CHUNK"] = (int)FGD_M_CHUNK;
    d["FIELDS"] = fields;
    py::dict slots;  // the block order shared with the Triton backend: Gram [A|E|B|C], [M_θ|M_Φ]
    slots["A"] = (int)FGD_SLOT_A;
    slots["E"] = (int)FGD_SLOT_E;
    slots["B"] = (int)FGD_SLOT_B;
    slots["C"] = (int)FGD_SLOT_C;
    slots["M_THETA"] = (int)FGD_SLOT_M_THETA;
    slots["M_PHI"] = (int)FGD_SLOT_M_PHI;
    d["SLOTS"] = slots;
    d["GRAM_TILE"] = FGD_GRAM_TILE;
    d["GRAM_BK"] = FGD_GRAM_BK;
    d["UPD_ROWS"] = FGD_UPD_ROWS;
    d["F32"] = (int)FGD_F32;
    d["F16"] = (int)FGD_F16;
    d["BF16"] = (int)FGD_BF16;
    d["F64"] = (int)FGD_F64;
    d["READS_PHI"] = (int)FGD_READS_PHI;
    d["WRITES_PHI"] = (int)FGD_WRITES_PHI;
    d["SOURCE_HASH"] = (long long)FGD_SOURCE_HASH;
    return d;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.doc() = "fgd_fast CUDA kernels (two-pass FGD step); see fgd_fast/backends/cuda.py";
    m.def("gram", &gram, "pass 1: Gram blocks A, E, B, C of every layer (split over n)");
    m.def("sum_splits", &sum_splits, "fixed-order sum of the Gram partials");
    m.def("update", &update, "pass 2: θ₊ and Φ₊ of every layer");
    m.def("synchronize", &synchronize, "synchronize the current stream and raise any CUDA error");
    m.def("constants", &constants, "tile sizes and table layout of fgd_cuda.h");
}
