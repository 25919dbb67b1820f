"""Test set-up. Without a GPU, Triton kernels run under the interpreter: the variable must be
set before any kernel module is imported, so it is set here, at collection time."""

import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Under pytest-xdist (CI runs two workers on two cores) each worker takes one core's share of
# threads, so that the workers' BLAS threads do not oversubscribe the machine.
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
if _workers > 1:
    torch.set_num_threads(max(1, torch.get_num_threads() // _workers))


@pytest.fixture(scope="session")
def emu_ext(tmp_path_factory):
    """The CUDA kernels of csrc/ built for the CPU emulator (tests/cuda_emulation), once per
    session (per xdist worker)."""
    from cuda_emulation import EmulatedExtension, build_library
    from cuda_emulation.build import CSRC
    from helpers import cuda_emulation_reason

    reason = cuda_emulation_reason()
    if reason:
        pytest.skip(reason)
    csrc = Path(os.environ.get("FGD_EMU_CSRC", CSRC))  # (another tree: CSRC_MUTANTS)
    return EmulatedExtension(build_library(tmp_path_factory.mktemp("cuda_emulation"), csrc))


@pytest.fixture(scope="session")
def emulated_cuda_backend(emu_ext):
    """fgd_fast/backends/cuda.py on the emulated kernels (a private module instance)."""
    from cuda_emulation import load_backend

    return load_backend(emu_ext)


@pytest.fixture(autouse=True)
def _cuda_backend_on_the_emulator(request, monkeypatch):
    """A test parametrised with ``helpers.backend_params``' ``cuda-emulated`` case: on a machine
    without the CUDA backend, ``backend="cuda"`` steps run the real backend code and the real
    ``.cu`` kernels on the CPU emulator (steps only: whatever resolves the backend for a step)."""
    if request.node.get_closest_marker("cuda_emulated") is None:
        return
    backend = request.getfixturevalue("emulated_cuda_backend")
    from fgd_fast import functional

    real = functional._cached_backend

    def cached_backend(name, device, precision="ieee"):
        return ("cuda", backend.prepare_cuda) if name == "cuda" else real(name, device, precision)

    monkeypatch.setattr(functional, "_cached_backend", cached_backend)
