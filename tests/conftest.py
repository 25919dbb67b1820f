"""Test set-up. Without a GPU, Triton kernels run under the interpreter: the variable must be
set before any kernel module is imported, so it is set here, at collection time."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
