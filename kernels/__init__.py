"""Triton kernels of fgd_fast (installed as ``fgd_fast.kernels``). Imported only by the
Triton backend, so the package works without Triton."""
