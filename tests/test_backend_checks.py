"""Backend resolution and the fused step's environment, each case found missing by a mutation
review (a check turned off in a copy of the source, and no test failed): an unknown precision
refused by each layer on its own, a Triton that fails to import, the caller's matmul precision
(IEEE products inside, the caller's setting restored after), device tables made inside
``torch.inference_mode`` and rewritten outside it, and the fused backends' device checks."""

from __future__ import annotations

import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import fgd_fast
from fgd_fast.backends import BackendUnavailable, checked_precision, resolve_backend
from fgd_fast.functional import fgd
from helpers import backend_params, device_for_tests, stiefel_problem


@pytest.mark.parametrize("backend", ["auto", "torch", "triton", "reference", "cuda"])
def test_checked_precision_refuses_an_unknown_precision_with_the_choices(backend):
    with pytest.raises(ValueError, match="unknown precision='fp16'.*'ieee'"):
        checked_precision("fp16", backend)
    with pytest.raises(ValueError, match="unknown precision"):
        checked_precision(3, backend)


@pytest.mark.parametrize("backend", backend_params(("torch", "triton")))
def test_each_backend_refuses_an_unknown_precision_itself(backend):
    """The backends are called with one signature by more than the optimizer (the functional
    step, the owner path): each refuses an unknown precision before it reads a tensor."""
    params, grads = stiefel_problem([(8, 4, 3, 3)])
    before = params[0].detach().clone()
    _, prepare = resolve_backend(backend, device_for_tests())
    bufs, fresh = [torch.zeros_like(g) for g in grads], [False] * len(grads)
    with pytest.raises(ValueError, match="unknown precision='fp16'"):
        prepare(params, grads, bufs, fresh, lr=0.1, momentum=0.9, feedback=0.4, check_finite=True, precision="fp16")
    assert torch.equal(params[0], before)


def test_a_triton_that_fails_to_import_is_unavailable_with_the_fix(monkeypatch):
    """A Triton that is missing or fails at import (a driver, a version) is ``BackendUnavailable``
    with the reason and the fix for an explicit name, and a quiet fallback for ``"auto"``."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # (past the device check, to the import)
    monkeypatch.setitem(sys.modules, "fgd_fast.backends.triton", None)  # (import raises ImportError)
    with pytest.raises(BackendUnavailable, match="backend='triton' is unavailable: .*pip install triton"):
        resolve_backend("triton", torch.device("cpu"))
    import fgd_fast.backends as registry

    monkeypatch.setattr(registry, "_tf32_tensor_cores", lambda device: True)  # ("auto" tries Triton first)
    assert resolve_backend("auto", torch.device("cuda"), "tf32x3")[0] == "torch"


class _MatmulPrecisions(TorchDispatchMode):
    """Records the global fp32 matmul precision at every matrix product dispatched."""

    PRODUCTS = {"mm", "bmm", "baddbmm", "addmm", "matmul"}

    def __init__(self):
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in self.PRODUCTS:
            self.seen.append(torch.get_float32_matmul_precision())
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("backend", ["reference", "torch"])
def test_an_ieee_step_computes_at_full_precision_and_restores_the_callers_setting(backend):
    """Under a caller's ``set_float32_matmul_precision("medium")`` an IEEE step's products run
    at ``"highest"`` (on a GPU "medium" is TF32 or bf16), and the caller's setting is back after."""
    params, grads = stiefel_problem([(8, 4, 3, 3), (20, 6)])
    opt = fgd_fast.FGD([dict(params=params, orthogonal=True)], lr=0.1, backend=backend, precision="ieee")
    for p, g in zip(params, grads):
        p.grad = g
    saved = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("medium")
    try:
        with _MatmulPrecisions() as mode:
            opt.step()
        after = torch.get_float32_matmul_precision()
    finally:
        torch.set_float32_matmul_precision(saved)
    assert mode.seen and set(mode.seen) == {"highest"}, sorted(set(mode.seen))
    assert after == "medium"


@pytest.mark.parametrize("backend", backend_params(("torch", "triton")))
def test_tables_made_inside_inference_mode_are_rewritten_outside_it(backend):
    """The functional step inside ``torch.inference_mode`` builds the device tables it keeps from
    step to step; the next step outside the mode, with a new lr, rewrites them in place (an
    inference tensor refuses that outside the mode)."""
    params, grads = stiefel_problem([(8, 4, 3, 3), (20, 6)])
    twins = [p.detach().clone() for p in params]
    bufs, twin_bufs = [None, None], [None, None]
    with torch.inference_mode():
        fgd(params, grads, bufs, lr=0.1, momentum=0.9, feedback=0.4, backend=backend)
    fgd(twins, grads, twin_bufs, lr=0.1, momentum=0.9, feedback=0.4, backend=backend)
    for thetas, buffers in ((params, bufs), (twins, twin_bufs)):
        fgd(thetas, grads, buffers, lr=0.05, momentum=0.9, feedback=0.4, backend=backend)
    assert all(torch.equal(p, t) for p, t in zip(params, twins))


def test_the_fused_backends_refuse_tensors_they_cannot_read():
    """``needs_cuda``, the fused backends' device check: CPU tensors are refused with the
    backend to use (Triton's interpreter excepted), and one call never mixes devices."""
    from fgd_fast.backends.base import needs_cuda

    cpu, meta = torch.zeros(2, 2), torch.zeros(2, 2, device="meta")
    with pytest.raises(BackendUnavailable, match="backend='cuda' needs CUDA tensors, got tensors on cpu"):
        needs_cuda("cuda", [cpu])
    with pytest.raises(BackendUnavailable, match="TRITON_INTERPRET=1"):
        needs_cuda("triton", [cpu])
    needs_cuda("triton", [cpu], allow=True)
    with pytest.raises(ValueError, match="one device's tensors per call, got cpu, meta"):
        needs_cuda("triton", [cpu, meta], allow=True)


def test_each_set_of_layers_keeps_its_own_hyper_parameter_table():
    """Two groups of as many layers (at other addresses) with other lr share no table: a CUDA
    graph captured for one reads its table at every replay, which the other's eager steps would
    rewrite; the same set of layers gets its own table back, rewritten in place."""
    from fgd_fast.backends.base import hyper_table

    first = hyper_table(((0.1, 0.9, 0.4),), torch.float32, torch.device("cpu"), owners=(1001,))
    second = hyper_table(((0.2, 0.9, 0.4),), torch.float32, torch.device("cpu"), owners=(2002,))
    assert first is not second
    assert first[0, 0].item() == pytest.approx(0.1) and second[0, 0].item() == pytest.approx(0.2)
    again = hyper_table(((0.3, 0.9, 0.4),), torch.float32, torch.device("cpu"), owners=(1001,))
    assert again is first and first[0, 0].item() == pytest.approx(0.3)


def test_a_reset_zeroes_the_update_kernels_step_even_for_a_non_finite_lr():
    """``scaled_hyper``: ``[η, β, α] → [sη, sβ, α]``; a reset (s = 0) writes exact zeros even
    where η is not finite (an lr tensor on the device, which no host read checks: 0·NaN = NaN
    would write NaN into θ₊)."""
    from fgd_fast.backends.algebra import scaled_hyper

    nan, inf = float("nan"), float("inf")
    hyper = torch.tensor([[nan, 0.9, 0.4], [inf, 0.9, 0.4], [0.1, 0.9, 0.4], [0.2, 0.5, 0.3]], dtype=torch.float64)
    scale = torch.tensor([0.0, 0.0, 0.5, 1.0], dtype=torch.float64)
    want = torch.tensor([[0.0, 0.0, 0.4], [0.0, 0.0, 0.4], [0.05, 0.45, 0.4], [0.2, 0.5, 0.3]], dtype=torch.float64)
    assert torch.equal(scaled_hyper(hyper, scale), want)
    assert scaled_hyper(hyper, None) is hyper  # no guard: the table itself


@pytest.mark.parametrize("shapes", [[(7, 3)] * 2, [(7, 3), (5, 3)]], ids=["one-shape", "two-shapes"])
def test_velocity_blocks_are_gtg_and_phitg(shapes):
    """The guard's ``G = gᵀg`` and ``H = Φᵀg`` (not ``gᵀΦ``) where the Gram kernel does not form
    them: by batched products for one shape, by one product per layer otherwise."""
    from fgd_fast.backends.algebra import velocity_blocks

    gen = torch.Generator().manual_seed(5)
    grads = [torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes]
    phis = [torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes]
    gg, h = velocity_blocks(grads, phis, torch.float64)
    assert torch.allclose(gg, torch.stack([g.T @ g for g in grads]), rtol=1e-14, atol=1e-14)
    assert torch.allclose(h, torch.stack([f.T @ g for f, g in zip(phis, grads)]), rtol=1e-14, atol=1e-14)
    assert velocity_blocks(grads, None, torch.float32)[1] is None
