"""Shared test helpers: which backends can run here, and parametrisation over them."""

from __future__ import annotations

import copy
import os
import sys

import numpy as np
import pytest
import torch

import fgd_fast
from fgd_fast.backends import BackendUnavailable, resolve_backend
from oracle import random_stiefel


def required_backends() -> set[str]:
    """The backends ``FGD_REQUIRE_BACKENDS`` (comma-separated) names: on a GPU session's machine
    their tests must run, so a backend that fails to load fails them (with the loader's reason)
    instead of turning them into skips."""
    return {name.strip() for name in os.environ.get("FGD_REQUIRE_BACKENDS", "").split(",") if name.strip()}


def backend_reason(name: str, device: str = "cpu") -> str | None:
    """None if ``name`` runs on ``device`` here, else why not (None too for a backend required on
    CUDA devices: its tests then run and fail with the reason)."""
    try:
        resolve_backend(name, torch.device(device))
    except BackendUnavailable as exc:
        if name in required_backends() and torch.device(device).type == "cuda":
            return None
        return str(exc)
    return None


def cuda_emulation_reason() -> str | None:
    """None if the CUDA kernels can run on this machine's CPU emulator (tests/cuda_emulation)."""
    from cuda_emulation import compiler

    if not sys.platform.startswith("linux"):
        return "the CUDA emulator (fibers, signals, mmap) is Linux-only"
    return None if compiler() is not None else "g++ not found: no CPU emulator for the CUDA kernels"


def backend_params(names=("reference", "torch", "triton", "cuda"), device: str | None = None):
    """pytest params for each backend on ``device`` (default: the one tests use, CUDA when present).
    Where the CUDA backend cannot run on a CPU ``device``, its case is ``cuda-emulated``: the real
    backend code and ``.cu`` kernels on the CPU emulator (``conftest._cuda_backend_on_the_emulator``)."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    out = []
    for name in names:
        reason = backend_reason(name, device)
        if name == "cuda" and reason and torch.device(device).type == "cpu":
            emulation = cuda_emulation_reason()
            if emulation is None:
                out.append(pytest.param(name, marks=[pytest.mark.cuda_emulated], id="cuda-emulated"))
                continue
            reason = f"{reason}; {emulation}"
        marks = [pytest.mark.skip(reason=reason)] if reason else []
        out.append(pytest.param(name, marks=marks, id=name))
    return out


def device_for_tests() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def stiefel_problem(shapes, seed=0, dtype=torch.float32):
    """Orthonormal parameters of ``shapes`` and fixed gradients of norm ~1, on the tests' device."""
    rng = np.random.default_rng(seed)
    dev = device_for_tests()
    params = [torch.nn.Parameter(torch.tensor(random_stiefel(rng, s), dtype=dtype, device=dev)) for s in shapes]
    grads = [torch.tensor(rng.standard_normal(s) / np.sqrt(np.prod(s)), dtype=dtype, device=dev) for s in shapes]
    return params, grads


def fgd_steps(params, grads, backend, steps=2, **kw):
    """``steps`` FGD steps (lr 0.1) of ``backend`` with the same gradients; returns the optimizer."""
    opt = fgd_fast.FGD([dict(params=params, orthogonal=True)], lr=0.1, backend=backend, **kw)
    for _ in range(steps):
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()
    return opt


def step_then_fresh_grad(net, opt, loss, steps=2):
    """Take ``steps`` optimizer steps on ``loss(net)`` (so momentum state exists), then leave a
    fresh gradient in place for the step under test; returns ``(net, opt)``."""
    for _ in range(steps):
        opt.zero_grad()
        loss(net).backward()
        opt.step()
    opt.zero_grad()
    loss(net).backward()
    return net, opt


def snapshot(net, opt):
    """Parameters and optimizer state, to check later that a failed step changed nothing."""
    return [p.detach().clone() for p in net.parameters()], copy.deepcopy(opt.state_dict())


def assert_unchanged(net, opt, snap):
    params, state = snap
    for p, q in zip(net.parameters(), params):
        assert torch.equal(p, q)
    now = opt.state_dict()
    assert now["state"].keys() == state["state"].keys()
    assert now["param_groups"] == state["param_groups"]
    for k, entry in state["state"].items():
        assert now["state"][k].keys() == entry.keys()  # no key added or dropped
        for key, value in entry.items():
            now_value = now["state"][k][key]
            if isinstance(value, torch.Tensor):  # (a meta tensor, standing in for another device, has no values)
                assert (now_value.device, now_value.dtype) == (value.device, value.dtype)
                assert now_value.shape == value.shape if value.is_meta else torch.equal(now_value, value)
            else:
                assert now_value == value


def captured(step, warmup: int = 2):
    """A CUDA graph of ``step()``, captured after ``warmup`` eager calls on a side stream (as any
    capture needs); ``graph.replay()`` runs it."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()  # recorded, not run
    return graph


def gram_blocks(lay, dtype, gen, *, scale: float, off: float):
    """``([A, E, B, C, G, H], ‖g‖²)`` of random layers in layout ``lay`` (blocks in its shape,
    ``dtype``, on ``lay.device``): θ orthonormal plus ``off`` of noise, Φ and g of ``scale``,
    every product in float64 (``H = Φᵀg``, ``G = gᵀg``: the guard's)."""
    per_group, g_sq = [], []
    for n, p in lay.groups:
        theta = torch.linalg.qr(torch.randn(n, 3 * p, p, dtype=torch.float64, generator=gen))[0]
        theta = theta + off * torch.randn(theta.shape, dtype=torch.float64, generator=gen)
        phi, g = (scale * torch.randn(theta.shape, dtype=torch.float64, generator=gen) for _ in range(2))
        per_group.append([theta.mT @ theta, theta.mT @ g, theta.mT @ phi, phi.mT @ phi, g.mT @ g, phi.mT @ g])
        g_sq.append((g * g).sum((1, 2)))
    blocks = [
        (per_group[0][k] if lay.single else torch.cat([pg[k].reshape(-1) for pg in per_group])).to(lay.device, dtype)
        for k in range(6)
    ]
    return blocks, torch.cat(g_sq).to(lay.device)


def record_launches(monkeypatch) -> list[tuple[str, dict]]:
    """Every Triton launch the backend makes from now on (for the test's duration), as ``(kernel
    name, keyword arguments)``: its constexprs and tile sizes."""
    from fgd_fast.backends import triton_launch

    launched = []
    real = triton_launch.launch

    def launch(kernel, grid, *args, **kwargs):
        launched.append((kernel.fn.__name__, kwargs))
        return real(kernel, grid, *args, **kwargs)

    monkeypatch.setattr(triton_launch, "launch", launch)
    return launched
