"""Triton-specific behaviour: launch counts, split-K, precision modes, capture-friendliness.
(Numerics against the oracle live in the shared, backend-parametrised tests.)"""
from __future__ import annotations

import numpy as np
import pytest
import torch

import fgd_fast
from helpers import backend_params, backend_reason, device_for_tests
from oracle import random_stiefel

pytestmark = pytest.mark.skipif(
    backend_reason("triton", str(device_for_tests())) is not None,
    reason=f"triton backend unavailable: {backend_reason('triton', str(device_for_tests()))}",
)


def _problem(shapes, seed=0, dtype=torch.float32):
    rng = np.random.default_rng(seed)
    dev = device_for_tests()
    params = [torch.nn.Parameter(torch.tensor(random_stiefel(rng, s), dtype=dtype, device=dev)) for s in shapes]
    grads = [torch.tensor(rng.standard_normal(s) / np.sqrt(np.prod(s)), dtype=dtype, device=dev) for s in shapes]
    return params, grads


def _steps(params, grads, backend, steps=2, **kw):
    opt = fgd_fast.FGD([dict(params=params, orthogonal=True)], lr=0.1, backend=backend, **kw)
    for _ in range(steps):
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()
    return opt


@pytest.mark.parametrize("layers", [3, 12])
def test_kernel_launches_per_step_do_not_grow_with_layers(layers):
    from fgd_fast.backends import triton as tb

    shapes = [(8, 4, 3, 3), (20, 6), (5, 40)] * (layers // 3)  # rows and columns layouts
    params, grads = _problem(shapes)
    opt = _steps(params, grads, "triton", steps=1)  # first step: creates Φ
    before = dict(tb.launch_counts)
    for p, g in zip(params, grads):
        p.grad = g.clone()
    opt.step()
    launched = {k: v - before.get(k, 0) for k, v in tb.launch_counts.items()}
    # two launch classes (rows / columns layout), each four Gram launches (A, B, C, E) and
    # two update launches (Φ₊, then θ₊), whatever the number of layers
    assert launched == {"gram_kernel": 8, "update_kernel": 4}


@pytest.mark.parametrize("splits", [2, 3, 7])
def test_split_k_gram_matches_unsplit(splits, monkeypatch):
    from fgd_fast.backends import triton as tb

    shapes = [(16, 8, 3, 3), (33, 70), (9, 130)]
    p1, g1 = _problem(shapes, dtype=torch.float64)
    p2 = [torch.nn.Parameter(p.detach().clone()) for p in p1]
    _steps(p1, g1, "triton", steps=3)
    monkeypatch.setattr(tb, "force_splits", splits)
    _steps(p2, g1, "triton", steps=3)
    for a, b in zip(p1, p2):
        torch.testing.assert_close(a, b, rtol=1e-13, atol=1e-14)


def test_deterministic_run_to_run():
    shapes = [(16, 8, 3, 3), (33, 70)]
    runs = []
    for _ in range(2):
        params, grads = _problem(shapes, seed=5)
        _steps(params, grads, "triton", steps=3)
        runs.append([p.detach().clone() for p in params])
    for a, b in zip(*runs):
        assert torch.equal(a, b)


@pytest.mark.parametrize("precision", ["ieee", "tf32x3", "tf32"])
def test_precision_modes_run_and_stay_close(precision):
    """On the CPU interpreter every mode computes in fp32 (input_precision is ignored there);
    on a GPU tf32 is allowed a ~1e-3 relative error in θᵀθ (its 10-bit mantissa)."""
    shapes = [(16, 8, 3, 3), (24, 40)]
    params, grads = _problem(shapes, seed=2)
    ref = [torch.nn.Parameter(p.detach().clone()) for p in params]
    _steps(params, grads, "triton", steps=3, precision=precision)
    _steps(ref, grads, "reference", steps=3)
    interpreted = device_for_tests().type == "cpu"
    tol = {"ieee": 1e-5, "tf32x3": 1e-5, "tf32": 1e-5 if interpreted else 5e-3}[precision]
    for a, b in zip(params, ref):
        torch.testing.assert_close(a, b, rtol=0, atol=tol)


def test_unknown_precision_is_refused():
    with pytest.raises(ValueError, match="precision"):
        fgd_fast.FGD([torch.nn.Parameter(torch.eye(3))], lr=0.1, precision="fp8")


@pytest.mark.parametrize("backend", backend_params(("torch", "triton", "cuda")))
def test_step_without_checks_never_reads_device_values(monkeypatch, backend):
    """With both checks off, step() makes no host synchronisation (capturable): no
    .item()/.tolist()/.cpu()/bool() on a tensor happens inside it. ``"torch"`` too: it is
    what ``"auto"`` runs."""
    shapes = [(8, 4, 3, 3), (20, 6)]
    params, grads = _problem(shapes)
    opt = _steps(params, grads, backend, steps=2, check_finite=False, check_manifold=False)

    def forbidden(*args, **kwargs):
        raise AssertionError("host synchronisation inside step()")

    for p, g in zip(params, grads):
        p.grad = g.clone()
    for name in ("item", "tolist", "__bool__"):
        monkeypatch.setattr(torch.Tensor, name, forbidden)
    if device_for_tests().type == "cuda":
        monkeypatch.setattr(torch.Tensor, "cpu", forbidden)
        torch.cuda.set_sync_debug_mode("error")  # any synchronising CUDA call raises
        try:
            opt.step()
            for p, g in zip(params, grads):  # a new gradient (new addresses) and a new lr
                p.grad = g.clone()
            opt.param_groups[0]["lr"] = 0.05
            opt.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        return
    opt.step()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graph capture needs a CUDA GPU")
@pytest.mark.parametrize("backend", backend_params(("torch", "triton", "cuda")))
def test_step_captured_in_a_cuda_graph_replays_like_eager_steps(backend):
    """With both checks off, step() can be captured in a CUDA graph (after warm-up steps on a
    side stream, as any capture needs); replays continue exactly like eager steps."""
    params, grads = _problem([(8, 4, 3, 3), (20, 6), (40, 40)])
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    kw = dict(lr=0.1, backend=backend, check_finite=False, check_manifold=False)
    opt = fgd_fast.FGD([dict(params=params, orthogonal=True)], **kw)
    eager = fgd_fast.FGD([dict(params=twins, orthogonal=True)], **kw)
    for p, t, g in zip(params, twins, grads):
        p.grad, t.grad = g.clone(), g.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # the first step creates Φ; the second is the captured form
            opt.step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        opt.step()  # recorded, not run
    for _ in range(2):
        eager.step()
    for _ in range(3):
        graph.replay()
        eager.step()
    torch.cuda.synchronize()
    for p, t in zip(params, twins):
        torch.testing.assert_close(p.detach(), t.detach(), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(opt.state[p]["momentum_buffer"], eager.state[t]["momentum_buffer"], rtol=1e-6, atol=1e-6)
