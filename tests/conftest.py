"""Test set-up. Without a GPU, Triton kernels run under the interpreter: the variable must be
set before any kernel module is imported, so it is set here, at collection time."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Under pytest-xdist (CI runs two workers on two cores) each worker takes one core's share of
# threads, so that the workers' BLAS threads do not oversubscribe the machine.
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
if _workers > 1:
    torch.set_num_threads(max(1, torch.get_num_threads() // _workers))
