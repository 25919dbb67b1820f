"""A Triton kernel that applies the tensor-core kernels' own TF32 rounding (``tc_step._tf32``) to
a vector and splits it as ``tc_split_kernel`` does, for ``tests/test_tf32_split.py`` to compare
with ``fgd_fast.backends.tf32`` bit for bit (imported only where Triton runs)."""

import triton
import triton.language as tl

from fgd_fast.kernels.tc_step import _tf32


@triton.jit
def split_kernel(x_ptr, hi_ptr, lo_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    x = tl.load(x_ptr + offs, mask=m, other=0.0)
    hi = _tf32(x)  # hi = tf32(x)
    tl.store(hi_ptr + offs, hi, mask=m)
    tl.store(lo_ptr + offs, _tf32(x - hi), mask=m)  # lo = tf32(x − hi)
