"""Cases where a backend's own code path decides what the reference decides, found by a
mutation review (a planted mutant in that path changed the result and no test failed): the
Triton backend's float32 paper variant (its middle outside the fused kernels), a non-finite
gradient or momentum buffer with the checks off (the fused backends' updates read no 0·NaN of
the reset layer's terms, in float64 and in float32, the tensor-core update), the functional
step at lr = 0 with momentum, and ``orthogonalize_`` of a matrix with a zero column."""

from __future__ import annotations

import pytest
import torch

import fgd_fast
from helpers import backend_params, device_for_tests

FUSED = backend_params(("torch", "triton"))


@pytest.mark.parametrize("backend", FUSED)
def test_the_paper_variant_in_float32_matches_the_reference(backend):
    """The Triton backend runs the fused middle for the official variant only; a float32 paper
    step there goes through the torch-ops middle, which no test compared (a mutant that sent it
    to the fused kernels moved θ by 0.2 in three steps)."""
    dev = device_for_tests()
    shapes = [(16, 4), (8, 4, 3, 3)]
    gen = torch.Generator().manual_seed(0)
    start = [fgd_fast.orthogonalize_(torch.randn(s, generator=gen)) for s in shapes]
    grads = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(3)]
    results = {}
    for name in ("reference", backend):
        params = [torch.nn.Parameter(w.clone().to(dev)) for w in start]
        opt = fgd_fast.FGD([dict(params=params, orthogonal=True)], lr=0.1, variant="paper", backend=name)
        for step in grads:
            for p, g in zip(params, step):
                p.grad = g.to(dev)
            opt.step()
        results[name] = [p.detach().cpu() for p in params]
    for a, b in zip(results["reference"], results[backend]):
        assert (a - b).abs().max() < 1e-3  # (TF32 operands on a GPU's Triton step: this file's bound)


# (float32: the Triton backend's tensor-core step, its own update kernel; TF32 operands: 1e-3)
DTYPES = pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-10), (torch.float32, 1e-3)], ids=["f64", "f32"])


def _compare(results: dict, backend: str, tol: float) -> None:
    """θ and Φ of ``backend`` finite and within ``tol`` of the reference's."""
    for a, b in zip(*(results[n][0] for n in ("reference", backend))):
        assert torch.isfinite(b).all() and (a - b).abs().max() < tol
    for a, b in zip(*(results[n][1] for n in ("reference", backend))):
        assert (a is None) == (b is None) and (a is None or (torch.isfinite(b).all() and (a - b).abs().max() < tol))


@pytest.mark.filterwarnings("ignore:the FGD step guard bound")
@DTYPES
@pytest.mark.parametrize("momentum", [0.0, 0.9])
@pytest.mark.parametrize("layers", [1, 2], ids=["one-layer", "stacked"])
@pytest.mark.parametrize("backend", FUSED)
def test_a_nan_gradient_with_the_checks_off_is_reset_and_writes_nothing_non_finite(
    backend, layers, momentum, dtype, tol
):
    """``check_finite=False`` and a NaN gradient at the first step: the guard resets that layer
    (s = 0: the pull-back, Φ₊ = 0), and the reset's terms must be exact zeros, not 0·NaN (a
    mutant that dropped them wrote NaN into θ and Φ); the other layer steps as the reference's."""
    dev = device_for_tests()
    gen = torch.Generator().manual_seed(0)
    start = [fgd_fast.orthogonalize_(torch.randn(20, 5, generator=gen, dtype=torch.float64)) for _ in range(layers)]
    good = torch.randn(20, 5, generator=gen, dtype=torch.float64)
    results = {}
    for name in ("reference", backend):
        params = [torch.nn.Parameter(w.clone().to(dev, dtype)) for w in start]
        kw = dict(lr=0.1, momentum=momentum, check_finite=False, backend=name)
        opt = fgd_fast.FGD([dict(params=params, orthogonal=True)], **kw)
        params[0].grad = torch.full((20, 5), float("nan"), dtype=dtype, device=dev)
        for p in params[1:]:
            p.grad = good.to(dev, dtype)
        opt.step()
        bufs = [opt.state[p].get("momentum_buffer") for p in params]
        results[name] = [p.detach().cpu() for p in params], [b.cpu() if b is not None else None for b in bufs]
        assert opt.guard_stats()[0]["reset"] == 1, name
    _compare(results, backend, tol)


@pytest.mark.filterwarnings("ignore:the FGD step guard bound")
@DTYPES
@pytest.mark.parametrize("backend", FUSED)
def test_a_nan_momentum_buffer_with_the_checks_off_is_reset_and_writes_nothing_non_finite(backend, dtype, tol):
    """A NaN in a momentum buffer (a loaded or edited state) with ``check_finite=False``: the
    guard resets that layer (s = 0) and the update reads no 0·NaN from Φ (βΦ's coefficient is an
    exact zero: Φ₊ = 0, θ₊ the pull-back); the other layer steps as the reference's."""
    dev = device_for_tests()
    gen = torch.Generator().manual_seed(1)
    start = [fgd_fast.orthogonalize_(torch.randn(20, 5, generator=gen, dtype=torch.float64)) for _ in range(2)]
    grads = [[torch.randn(20, 5, generator=gen, dtype=torch.float64) for _ in start] for _ in range(2)]
    results = {}
    for name in ("reference", backend):
        params = [torch.nn.Parameter(w.clone().to(dev, dtype)) for w in start]
        opt = fgd_fast.FGD(
            [dict(params=params, orthogonal=True)], lr=0.1, momentum=0.9, check_finite=False, backend=name
        )
        for step, gs in enumerate(grads):
            for p, g in zip(params, gs):
                p.grad = g.to(dev, dtype)
            if step == 1:
                opt.state[params[0]]["momentum_buffer"][3, 2] = float("nan")
            opt.step()
        bufs = [opt.state[p]["momentum_buffer"] for p in params]
        results[name] = [p.detach().cpu() for p in params], [b.cpu() for b in bufs]
        assert opt.guard_stats()[0]["reset"] == 1 and not results[name][1][0].any(), name  # Φ₊ = 0
    _compare(results, backend, tol)


@pytest.mark.parametrize("backend", backend_params(("torch",)))
def test_the_functional_step_at_lr_zero_keeps_the_momentum_term(backend):
    """``fgd_fast.fgd(..., lr=0)`` (``FGD`` skips an lr = 0 group; the functional step does not):
    U = βΦ is not zero, so Φ₊ = U + θM_Φ is the reference's (a mutant that treated a zero
    gradient term as a zero velocity wrote Φ₊ = 0)."""
    gen = torch.Generator().manual_seed(0)
    ws = [fgd_fast.orthogonalize_(torch.randn(20, 5, generator=gen, dtype=torch.float64)) for _ in range(2)]
    bufs = [torch.randn(20, 5, generator=gen, dtype=torch.float64) * 0.1 for _ in range(2)]
    gs = [torch.randn(20, 5, generator=gen, dtype=torch.float64) for _ in range(2)]
    out = {}
    for name in ("reference", backend):
        theta, phi = [w.clone() for w in ws], [b.clone() for b in bufs]
        fgd_fast.fgd(theta, [g.clone() for g in gs], phi, lr=0.0, momentum=0.9, feedback=0.4, backend=name)
        out[name] = theta, phi
    for x, y in zip(out["reference"], out[backend]):
        for a, b in zip(x, y):
            assert (a - b).abs().max() < 1e-12
    assert all(float(b.norm()) > 0.01 for b in out[backend][1])


def test_orthogonalize_a_matrix_with_a_zero_column():
    """A dead unit (an all-zero column): its QR diagonal is 0, whose sign is 0; the column must
    still come out a unit vector orthogonal to the others (a mutant that kept the zero sign left
    it zero: distance 1)."""
    w = torch.randn(8, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    w[:, 1] = 0.0
    fgd_fast.orthogonalize_(w)
    assert torch.allclose(w.norm(dim=0), torch.ones(3, dtype=torch.float64)) and fgd_fast.stiefel_distance(w) < 1e-12


def _near_the_limit(shape, seed, excess, dtype):
    """A ``dtype`` layer whose ‖θᵀθ − I‖_F is about ``excess`` (θ scaled uniformly)."""
    gen = torch.Generator().manual_seed(seed)
    w = fgd_fast.orthogonalize_(torch.randn(shape, generator=gen, dtype=torch.float64))
    return (w * (1 + excess / shape[1] ** 0.5) ** 0.5).to(dtype)


@pytest.mark.filterwarnings("ignore:the FGD step guard bound")
@pytest.mark.parametrize("backend", FUSED)
def test_a_16_bit_layer_beside_another_p_keeps_its_rounding_margin(backend):
    """The guard's target is ``max_distance`` less the stored dtype's rounding margin, which
    grows with p; a layout of several p takes it per layer (a mutant that dropped it there kept
    bfloat16 steps that land beyond the target, where the same layer stepped alone is reset).
    Layers near the limit, stepped together and each alone: the same decisions, some resets."""
    dev = device_for_tests()
    shapes = [(64, 8), (64, 4)]
    kw = dict(lr=1e-3, momentum=0.0, feedback=0.0, max_distance=0.5, backend=backend)
    together, alone = [], []
    for excess in (0.472, 0.478, 0.484, 0.49):
        start = [_near_the_limit(s, k, excess, torch.bfloat16).to(dev) for k, s in enumerate(shapes)]
        for sets, out in ((([0, 1],), together), (([0], [1]), alone)):
            for layers in sets:
                ws = [torch.nn.Parameter(start[k].clone()) for k in layers]
                opt = fgd_fast.FGD([dict(params=ws, orthogonal=True)], **kw)
                for w in ws:
                    w.grad = torch.zeros_like(w)
                opt.step()
                out += [opt.guard_stats()[k]["reset"] for k in range(len(ws))]
    assert together == alone and 0 < sum(alone) < len(alone), (together, alone)
