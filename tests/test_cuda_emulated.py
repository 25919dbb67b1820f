"""The CUDA kernels of csrc/ on the CPU: the real ``.cu`` sources, built with g++ against a
small emulator (tests/cuda_emulation, whose docstring says what this can and cannot show),
driven by the real backend code of fgd_fast/backends/cuda.py with only the extension module
swapped. Checked against the float64 NumPy oracle (float64 tightly, float32 within a small
multiple of what plain float32 arithmetic loses), the reference backend (float16/bfloat16
within one ulp; the guard's decisions, scaled steps and float16 range check), and for
determinism, schedule independence, that ``prepare`` writes nothing and that writes stay inside
their tensors. Needs g++ only (no GPU, no nvcc)."""

from __future__ import annotations

import functools
import inspect
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import fgd_fast
from cuda_emulation import (
    compiler,
    guards_intact,
    poison_shared_arrays,
    rewrite_launches,
)
from cuda_emulation.build import CSRC
from fgd_fast.backends import compute_dtype
from fgd_fast.backends.reference import prepare_reference
from oracle import fgd_paper_step, fgd_step, random_stiefel, stiefel_dist


@pytest.fixture
def cuda(emulated_cuda_backend, emu_ext, monkeypatch):
    """The backend module (fgd_fast/backends/cuda.py) on the emulated kernels, with the test
    knobs at their defaults: splits chosen by the backend for a 1-SM GPU (one split; update
    grid of 4 blocks, so blocks stride over several row blocks), blocks and threads in order."""
    _backend = emulated_cuda_backend  # (conftest.py: built once per session, shared with backend_params' case)
    monkeypatch.setattr(_backend, "force_splits", None)
    monkeypatch.setattr(_backend, "_sm_count", lambda device: 1)
    emu_ext.set_reverse_schedule(False)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the matrices are tiny: more threads only contend (many times slower)
    try:
        yield _backend
    finally:
        torch.set_num_threads(threads)
        emu_ext.set_reverse_schedule(False)


# ------------------------------------------------------------------ problems

# (shape, momentum) per layer. θ = W2ᵀ (unit row stride) when c_o <= prod(rest), else θ = W2.
CASES = {
    # p = 130: 3 tiles of 64 (the last 2 wide), n = 150 not a multiple of 32
    "rows-p130": dict(layers=[((130, 150), 0.9)]),
    # θ = W2 (unit column stride), p = 65: an edge tile 1 wide; 3 splits of n
    "cols-p65": dict(layers=[((150, 65), 0.9)], splits=3),
    # θ = W2 with p = 130; 4 splits of 96 rows: 3 K steps each, the last split 12 rows
    "cols-p130": dict(layers=[((300, 130), 0.9)], splits=4),
    # every kind of layer in one launch (reads Φ or not, both layouts, p = 1, square, conv);
    # 7 splits: the small layers' later splits are empty
    "ragged": dict(
        layers=[
            ((130, 150), 0.9),
            ((8, 4, 3, 3), 0.5),
            ((150, 65), 0.0),
            ((1, 9), 0.9),
            ((9, 1), 0.8),
            ((65, 65), 0.9),
            ((20, 3, 3, 3), 0.0),
        ],
        splits=7,
    ),
    # the backend's own split choice for a 16-SM GPU (3 splits here)
    "auto-splits": dict(layers=[((65, 2, 5, 9), 0.9)], sm_count=16),
    # channels_last parameters and gradients (staged through contiguous copies), contiguous Φ
    "channels-last": dict(
        layers=[((70, 8, 3, 3), 0.9), ((20, 3, 3, 3), 0.6), ((40, 2, 2, 3), 0.9)], splits=2, layouts=("cl", "cl", "c")
    ),
    # channels_last Φ too (the optimizer's zeros_like(θ) keeps θ's memory format): every
    # operand staged, and Φ₊ written back from its copy
    "channels-last-phi": dict(layers=[((70, 8, 3, 3), 0.9), ((40, 2, 2, 3), 0.9)], splits=2, layouts=("cl",) * 3),
    # θ stored transposed, g and Φ row-major (a momentum buffer loaded from a checkpoint is
    # contiguous): each operand read in place through its own strides, none staged
    "transposed-theta": dict(
        layers=[((130, 150), 0.9), ((150, 65), 0.9), ((40, 2, 2, 3), 0.9)], layouts=("t", "c", "c")
    ),
    # θ row-major, g and Φ stored transposed (a gradient assigned by hand)
    "transposed-grad-phi": dict(layers=[((130, 150), 0.9), ((150, 65), 0.9)], splits=2, layouts=("c", "t", "t")),
    # momentum 0: no Φ at all
    "stateless": dict(layers=[((130, 150), 0.0), ((150, 65), 0.0), ((5, 11), 0.0)], splits=2),
}


def _setup(cuda, monkeypatch, case):
    spec = CASES[case]
    monkeypatch.setattr(cuda, "force_splits", spec.get("splits"))
    monkeypatch.setattr(cuda, "_sm_count", lambda device: spec.get("sm_count", 1))
    return spec["layers"], spec.get("layouts", ("c",) * 3)


@functools.cache
def _cached_data(layers, steps, seed):
    rng = np.random.default_rng(seed)
    shapes = [s for s, _ in layers]
    w0 = [random_stiefel(rng, s) for s in shapes]
    grads = [[rng.standard_normal(s) / np.sqrt(np.prod(s)) for s in shapes] for _ in range(steps)]
    hyper = dict(
        lr=[0.05 + 0.01 * i for i in range(len(layers))],
        momentum=[m for _, m in layers],
        feedback=[0.45 - 0.03 * i for i in range(len(layers))],
    )
    return w0, grads, hyper


def _data(layers, steps, seed):
    """Initial θ (on the manifold), gradients per step and per-layer hyper-parameters (all
    different, so a layer reading another's row of the hyper table is caught). Cached: the
    same problem serves several tests."""
    w0, grads, hyper = _cached_data(tuple(layers), steps, seed)
    return [w.copy() for w in w0], grads, {k: list(v) for k, v in hyper.items()}


def _tensor(cuda, a, dtype, layout="c"):
    """`a` as a fenced tensor: a read or write past its end fails the launch, one before it
    reads NaN or breaks the guard band (guards_intact). ``layout``: "c" contiguous, "cl"
    channels_last (4-d only), "t" its ``(c_o, m)`` matrix stored column-major."""
    t = torch.tensor(a, dtype=dtype)
    if layout == "cl" and t.dim() == 4:
        t = t.to(memory_format=torch.channels_last)
        assert not t.is_contiguous()
    elif layout == "t":
        t = t.reshape(t.shape[0], -1).t().contiguous().t().view(t.shape)
        assert t.stride(0) == 1 and not t.is_contiguous()
    return cuda._ext.fenced(t)


def _run(cuda, layers, dtype, steps, *, seed=0, layouts=("c", "c", "c"), oracle=True):
    """`steps` steps with the emulated backend beside the float64 oracle (unless not
    `oracle`); ``layouts``: those of θ, g and Φ (see :func:`_tensor`). Returns the
    parameters, Φ buffers, the oracle's θ and Φ, and (backend, oracle) distances per step."""
    w0, grads, hyper = _data(layers, steps, seed)
    count = len(layers)
    theta_layout, grad_layout, phi_layout = layouts
    params = [_tensor(cuda, w, dtype, theta_layout) for w in w0]
    strides = [p.stride() for p in params]
    bufs = [None if m == 0 else _tensor(cuda, np.zeros(s), compute_dtype(dtype), phi_layout) for s, m in layers]
    phi_strides = [None if b is None else b.stride() for b in bufs]
    ow, ophi, dists = [w.copy() for w in w0], [None] * count, []
    for step in range(steps):
        g = [_tensor(cuda, x, dtype, grad_layout) for x in grads[step]]
        fresh = [step == 0 or m == 0 for _, m in layers]
        plan = cuda.prepare_cuda(params, g, bufs, fresh, **hyper, check_finite=True)
        assert plan.finite.tolist() == [True] * count
        dists.append((plan.dist.tolist(), [stiefel_dist(w) for w in ow] if oracle else None))
        plan.apply()
        assert all(guards_intact(t) for t in [*params, *g, *(b for b in bufs if b is not None)])
        for i in range(count if oracle else 0):
            h = {k: v[i] for k, v in hyper.items()}
            ow[i], ophi[i] = fgd_step(ow[i], grads[step][i], ophi[i], **h)
    assert [p.stride() for p in params] == strides  # written through the parameters' own layout
    assert [None if b is None else b.stride() for b in bufs] == phi_strides  # and Φ's
    return params, bufs, ow, ophi, dists


def _rel_err(actual: torch.Tensor, expected: np.ndarray) -> float:
    return float(np.abs(actual.double().numpy() - expected).max() / max(np.abs(expected).max(), 1e-300))


def _plain_fp32_error(layers, steps, seed=0):
    """What plain float32 arithmetic (the oracle run in float32) loses on the same data."""
    w0, grads, hyper = _data(layers, steps, seed)
    err = 0.0
    for i, w in enumerate(w0):
        h = {k: v[i] for k, v in hyper.items()}
        w64, w32, phi64, phi32 = w.copy(), w.astype(np.float32), None, None
        for step in range(steps):
            w64, phi64 = fgd_step(w64, grads[step][i], phi64, **h)
            w32, phi32 = fgd_step(w32, grads[step][i].astype(np.float32), phi32, **h, dtype=np.float32)
        err = max(err, float(np.abs(w32 - w64).max()))
    return err


# ------------------------------------------------------------------ numerics


@pytest.mark.parametrize("case", sorted(CASES))
def test_float64_matches_oracle(cuda, monkeypatch, case):
    layers, layouts = _setup(cuda, monkeypatch, case)
    splits_before = cuda.launch_counts["sum_splits"]
    steps = 3
    params, bufs, ow, ophi, dists = _run(cuda, layers, torch.float64, steps, layouts=layouts)
    for p, b, w, phi in zip(params, bufs, ow, ophi):
        assert _rel_err(p, w) < 1e-12
        assert (b is None) == (phi is None)
        if b is not None:
            assert _rel_err(fgd_fast.as_stiefel(b), phi) < 1e-11
    for got, want in dists:  # ‖A − I‖_F from the Gram kernel's A
        assert np.allclose(got, want, rtol=1e-9, atol=1e-13), (got, want)
    split_launches = cuda.launch_counts["sum_splits"] - splits_before
    split = "splits" in CASES[case] or "sm_count" in CASES[case]  # (else one split: a 1-SM GPU)
    assert split_launches == (steps if split else 0)  # the split-n path ran where meant


@pytest.mark.parametrize("case", ["ragged", "rows-p130", "channels-last"])
def test_float32_error_bounded_by_plain_float32(cuda, monkeypatch, case):
    """float32 error vs the float64 oracle <= 4× what plain float32 arithmetic makes, plus 2
    ulps of 1 (as tests/test_fgd_oracle.py asks of every backend)."""
    layers, layouts = _setup(cuda, monkeypatch, case)
    steps = 3
    params, _, ow, _, dists = _run(cuda, layers, torch.float32, steps, layouts=layouts)
    err = max(float(np.abs(p.double().numpy() - w).max()) for p, w in zip(params, ow))
    baseline = _plain_fp32_error(layers, steps)
    assert err <= 4 * baseline + 2 * 2.0**-23, (err, baseline)
    for got, want in dists:
        assert np.allclose(got, want, rtol=0, atol=1e-5), (got, want)


def _ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One unit in the last place of each value of x in `dtype` (subnormals included)."""
    fi = torch.finfo(dtype)
    emin = round(math.log2(fi.tiny))
    x = x.double().abs()
    _, e = torch.frexp(x)  # x = m · 2^e, m in [0.5, 1)
    e = torch.where(x > 0, e - 1, torch.full_like(e, emin)).clamp(min=emin)
    return fi.eps * torch.pow(2.0, e.double())


def _within_one_ulp(p: torch.Tensor, r: torch.Tensor, dtype: torch.dtype) -> bool:
    """Every entry of p within one ``dtype`` ulp (of either value) of r's."""
    return bool(((p.double() - r.double()).abs() <= torch.maximum(_ulp(p, dtype), _ulp(r, dtype))).all())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_parameters_within_one_ulp_of_reference(cuda, monkeypatch, dtype):
    """16-bit θ computes in float32 with a float32 Φ and is rounded once: per step, from the
    same state, within one 16-bit ulp of the reference backend (another summation order may
    round to the neighbour), Φ to float32 rounding."""
    monkeypatch.setattr(cuda, "force_splits", 3)
    layers = [((130, 150), 0.9), ((150, 65), 0.9), ((8, 4, 3, 3), 0.0)]
    w0, grads, hyper = _data(layers, 3, seed=1)
    params = [_tensor(cuda, w, dtype) for w in w0]
    bufs = [None if m == 0 else _tensor(cuda, np.zeros(s), torch.float32) for s, m in layers]
    for step, step_grads in enumerate(grads):
        g = [cuda._ext.fenced(torch.tensor(x, dtype=torch.float32).to(dtype)) for x in step_grads]
        ref_params = [p.clone() for p in params]
        ref_bufs = [None if b is None else b.clone() for b in bufs]
        fresh = [step == 0 or m == 0 for _, m in layers]
        plan = cuda.prepare_cuda(params, g, bufs, fresh, **hyper, check_finite=True)
        ref = prepare_reference(ref_params, g, ref_bufs, fresh, **hyper, check_finite=True)
        torch.testing.assert_close(plan.dist, ref.dist.double(), rtol=0, atol=1e-5)
        plan.apply()
        ref.apply()
        for p, r in zip(params, ref_params):
            assert p.dtype == dtype
            assert _within_one_ulp(p, r, dtype), float((p.double() - r.double()).abs().max())
            # and mostly the same value: a store that truncated instead of rounding to
            # nearest would still be within one ulp, but would differ about half the time
            assert (p != r).float().mean() < 0.05
        for b, r in zip(bufs, ref_bufs):
            if b is not None:
                assert b.dtype == torch.float32
                torch.testing.assert_close(b, r, rtol=1e-5, atol=1e-6)
        assert all(guards_intact(t) for t in [*params, *g, *(b for b in bufs if b is not None)])


def _step_beside_reference(cuda, params, g, bufs, fresh, **kw):
    """One step of the backend and, from copies of the same θ and Φ, of the reference backend,
    whose guard decisions must be the same; returns both plans and the reference's θ₊ and Φ₊."""
    ref_params, ref_bufs = _bits(params), _bits(bufs)
    plan = cuda.prepare_cuda(params, g, bufs, fresh, **kw)
    ref = prepare_reference(ref_params, g, ref_bufs, fresh, **kw)
    assert plan.guarded.tolist() == ref.guarded.tolist()
    plan.apply()
    ref.apply()
    return plan, ref, ref_params, ref_bufs


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_guard_decides_and_steps_as_the_reference(cuda, monkeypatch, dtype):
    """With the guard (trust radius 1, a tight ``max_distance`` of 0.05, where float16's rounding
    margin is a sixth of it) and gradients spiked up to 1000×: the backend's decisions (kept,
    scaled, reset) and predicted distances are the reference backend's, and so is every
    θ₊ and Φ₊ (float32: to float32 rounding; float16: one ulp)."""
    monkeypatch.setattr(cuda, "force_splits", 2)
    layers = [((130, 150), 0.9), ((150, 65), 0.9), ((8, 4, 3, 3), 0.0), ((40, 9), 0.9)]
    w0, grads, hyper = _data(layers, 3, seed=3)
    params = [_tensor(cuda, w, dtype) for w in w0]
    bufs = [None if m == 0 else _tensor(cuda, np.zeros(s), torch.float32) for s, m in layers]
    guard = dict(check_finite=True, trust_radius=1.0, max_distance=0.05)
    seen = set()
    for step, step_grads in enumerate(grads):
        spikes = [3.0 ** (step + 1), 10.0 ** (step + 1), 30.0, 1.0]
        g = [cuda._ext.fenced(torch.tensor(x * k, dtype=dtype)) for x, k in zip(step_grads, spikes)]
        fresh = [step == 0 or m == 0 for _, m in layers]
        plan, ref, ref_params, ref_bufs = _step_beside_reference(cuda, params, g, bufs, fresh, **hyper, **guard)
        torch.testing.assert_close(plan.dist_next, ref.dist_next.double(), rtol=1e-4, atol=1e-6)
        seen.update(ref.guarded.tolist())
        for p, r in zip(params, ref_params):
            if dtype == torch.float16:
                assert _within_one_ulp(p, r, dtype)
            else:
                torch.testing.assert_close(p, r, rtol=0, atol=1e-5)
        for b, r in zip(bufs, ref_bufs):
            if b is not None:
                torch.testing.assert_close(b, r, rtol=1e-4, atol=1e-5)
    assert {0, 1} <= seen, seen  # kept and scaled steps both compared


def test_a_step_that_would_overflow_float16_is_flagged_as_in_the_reference(cuda):
    """A float16 θ far off the manifold (300 × orthonormal; the checks of the manifold off, as
    ``check_manifold=False`` leaves it) is reset by the guard to a pull-back whose entries
    overflow float16: the plan says θ₊ does not fit (the step is then refused), as the
    reference's; at 30 × orthonormal it fits."""
    rng = np.random.default_rng(4)
    for scale, fits in ((30.0, True), (300.0, False)):
        params = [_tensor(cuda, scale * random_stiefel(rng, (8, 4)), torch.float16)]
        g = [_tensor(cuda, rng.standard_normal((8, 4)), torch.float16)]
        kw = dict(lr=[0.01], momentum=[0.0], feedback=[0.4], check_finite=True, trust_radius=1.0, max_distance=0.5)
        plan = cuda.prepare_cuda(params, g, [None], [True], **kw)
        ref = prepare_reference(_bits(params), g, [None], [True], **kw)
        assert plan.guarded.tolist() == ref.guarded.tolist() == [2]  # reset
        assert plan.finite_next.tolist() == ref.finite_next.tolist() == [fits], scale


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("where", ["gradient", "momentum"])
def test_a_nan_input_with_the_checks_off_is_reset_writing_nothing_non_finite(cuda, monkeypatch, dtype, where):
    """``check_finite=False`` and a NaN in one layer's gradient (first step) or momentum buffer
    (second step): the guard resets that layer as the reference does (s = 0: θ₊ the pull-back,
    Φ₊ = 0) and the update kernel reads neither ηg nor βΦ of it (coefficients of exactly 0, not
    0·NaN), so nothing non-finite is written; the other layers step as the reference's."""
    monkeypatch.setattr(cuda, "force_splits", 2)
    layers = [((130, 150), 0.9), ((150, 65), 0.9), ((40, 9), 0.9)]
    w0, grads, hyper = _data(layers, 2, seed=5)
    params = [_tensor(cuda, w, dtype) for w in w0]
    bufs = [_tensor(cuda, np.zeros(s), dtype) for s, _ in layers]
    guard = dict(check_finite=False, trust_radius=1.0, max_distance=0.5)
    tol = dict(rtol=0, atol=1e-12 if dtype == torch.float64 else 1e-5)
    hit, hit_step = (0, 0) if where == "gradient" else (1, 1)
    for step, step_grads in enumerate(grads):
        g = [_tensor(cuda, x, dtype) for x in step_grads]
        if step == hit_step:
            (g[hit] if where == "gradient" else bufs[hit])[7, 64] = float("nan")
        fresh = [step == 0] * len(layers)
        plan, _, ref_params, ref_bufs = _step_beside_reference(cuda, params, g, bufs, fresh, **hyper, **guard)
        for p, r in zip(params, ref_params):
            assert torch.isfinite(p).all()
            torch.testing.assert_close(p, r, **tol)
        for b, r in zip(bufs, ref_bufs):
            assert torch.isfinite(b).all()
            torch.testing.assert_close(b, r, **tol)
        if step == hit_step:  # the layer hit: reset, Φ₊ = 0
            assert plan.guarded.tolist()[hit] == 2 and not bufs[hit].any()


# ------------------------------------------------------------------ determinism and writes


def _bits(ts):
    return [None if t is None else t.detach().clone() for t in ts]


def test_deterministic_and_independent_of_block_and_thread_order(cuda, emu_ext, monkeypatch):
    """Bitwise equal results from two runs, and from a run with every launch's blocks and
    every block's threads in reverse order (the barriers and the one-writer-per-element
    design make the order irrelevant; a missing __syncthreads would not)."""
    monkeypatch.setattr(cuda, "force_splits", 5)
    layers = CASES["ragged"]["layers"]
    runs = []
    for reverse in (False, False, True):
        emu_ext.set_reverse_schedule(reverse)
        params, bufs, _, _, dists = _run(cuda, layers, torch.float32, 2, oracle=False)
        runs.append((params, bufs, [d for d, _ in dists]))
    for params, bufs, dists in runs[1:]:
        for a, b in zip(params + bufs, runs[0][0] + runs[0][1]):
            assert (a is None and b is None) or torch.equal(a, b)
        assert dists == runs[0][2]


def _storage(t: torch.Tensor) -> torch.Tensor:
    """Every byte of t's storage (guard bands included)."""
    return torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage()).clone()


def test_prepare_writes_nothing_and_apply_writes_only_its_tensors(cuda, monkeypatch):
    monkeypatch.setattr(cuda, "force_splits", 2)
    layers = [((130, 150), 0.9), ((150, 65), 0.9), ((9, 1), 0.0)]
    w0, grads, hyper = _data(layers, 2, seed=2)
    params = [_tensor(cuda, w, torch.float32) for w in w0]
    bufs = [None if m == 0 else _tensor(cuda, np.zeros(s), torch.float32) for s, m in layers]
    for step in range(2):  # the second step reads a non-zero Φ
        g = [_tensor(cuda, x, torch.float32) for x in grads[step]]
        fresh = [step == 0 or m == 0 for _, m in layers]
        tensors = [*params, *g, *(b for b in bufs if b is not None)]
        before = [_storage(t) for t in tensors]
        versions = [t._version for t in tensors]
        plan = cuda.prepare_cuda(params, g, bufs, fresh, **hyper, check_finite=True)
        for t, b in zip(tensors, before):
            assert torch.equal(_storage(t), b)  # prepare wrote nothing, anywhere
        plan.apply()
        for p, b in zip(params, before):
            assert not torch.equal(_storage(p), b)  # apply wrote θ₊ …
        # … and torch sees it: the version counters of θ and Φ moved (the kernels write through
        # raw pointers; a backward that saved the old θ must be refused), the gradients' did not
        moved = [t._version > v for t, v in zip(tensors, versions)]
        assert moved == [True] * len(params) + [False] * len(g) + [True] * (len(tensors) - len(params) - len(g))
        for t in tensors:
            assert guards_intact(t)  # … and nothing next to any tensor
        for t, b in zip(g, before[len(params) :]):
            assert torch.equal(_storage(t), b)  # nor into the gradients


def test_non_finite_gradient_is_flagged_and_nothing_written(cuda, monkeypatch):
    monkeypatch.setattr(cuda, "_DEBUG_SYNC", True)  # FGD_FAST_CUDA_DEBUG=1: synchronize after each launch
    layers = [((40, 90), 0.0), ((30, 5), 0.0), ((65, 65), 0.0)]
    w0, grads, hyper = _data(layers, 1, seed=3)
    params = [torch.tensor(w, dtype=torch.float32) for w in w0]
    g = [torch.tensor(x, dtype=torch.float32) for x in grads[0]]
    g[1][3, 2] = float("nan")
    g[2][0, 64] = float("inf")
    before = _bits(params)
    plan = cuda.prepare_cuda(params, g, [None] * 3, [True] * 3, **hyper, check_finite=True)
    assert plan.finite.tolist() == [True, False, False]
    for a, b in zip(params, before):
        assert torch.equal(a, b)


@pytest.mark.parametrize("case", ["ragged", "rows-p130"])  # the last layer without Φ / reading Φ
def test_a_gram_grid_larger_than_the_tiles_writes_nothing_more(cuda, monkeypatch, case):
    """A review: with more Gram blocks than the layers' tiles (an inconsistent count from the
    host), the extra blocks, all mapped to the last layer, looped for ever in ``upper_tile``
    (a layer reading Φ) or read the absent Φ (one without). Each block now checks its tile
    against its layer's count and returns: the step is bit-identical."""
    layers, _ = _setup(cuda, monkeypatch, case)
    want = _run(cuda, layers, torch.float64, 2, oracle=False)
    real = cuda._launch

    def launch(name, fn, *args):
        if name == "gram":  # (meta, partial, gram_total, total_tiles, …): 37 blocks too many
            args = (*args[:3], args[3] + 37, *args[4:])
        real(name, fn, *args)

    monkeypatch.setattr(cuda, "_launch", launch)
    got = _run(cuda, layers, torch.float64, 2, oracle=False)
    for a, b in zip(want[0] + [x for x in want[1] if x is not None], got[0] + [x for x in got[1] if x is not None]):
        assert torch.equal(a, b)


def test_launch_count_does_not_grow_with_layers(cuda, monkeypatch):
    monkeypatch.setattr(cuda, "force_splits", 2)  # gram + sum_splits + update

    def launches(shapes):
        layers = [(s, 0.9) for s in shapes]
        before, emulated = sum(cuda.launch_counts.values()), cuda._ext.stats()["launches"]
        _run(cuda, layers, torch.float32, 1, oracle=False)
        count = sum(cuda.launch_counts.values()) - before
        assert cuda._ext.stats()["launches"] - emulated == count  # each one ran the emulated kernel
        return count

    few = launches([(16, 144), (32, 288)])
    many = launches([(16, 144), (32, 288)] * 6 + [(24, 50)] * 5)
    assert few == many == 3


@pytest.mark.parametrize("variant", ["official", "paper"])
def test_optimizer_with_backend_cuda_matches_oracle(cuda, monkeypatch, variant):
    """fgd_fast.FGD(backend="cuda") end to end (first-step and later Φ flags, per-group
    hyper-parameters, a momentum-0 group in the same launch), float64, vs the oracle of the
    variant (the authors' sequence, or Algorithm 1 as printed)."""
    oracle = fgd_paper_step if variant == "paper" else fgd_step
    from fgd_fast import functional

    real = functional._cached_backend
    monkeypatch.setattr(
        functional,
        "_cached_backend",
        lambda name, device_type, precision="ieee": (
            ("cuda", cuda.prepare_cuda) if name == "cuda" else real(name, device_type, precision)
        ),
    )
    groups = [
        ([(130, 150), (8, 4, 3, 3)], dict(lr=0.1, momentum=0.9, feedback=0.4)),
        ([(150, 65)], dict(lr=0.05, momentum=0.0, feedback=0.3)),
        ([(9, 1), (20, 3, 3, 3)], dict(lr=0.08, momentum=0.5, feedback=0.2)),
    ]
    rng = np.random.default_rng(4)
    layers = [(s, h) for shapes, h in groups for s in shapes]
    w0 = [random_stiefel(rng, s) for s, _ in layers]
    params = [_tensor(cuda, w, torch.float64).requires_grad_() for w in w0]
    it = iter(params)
    opt = fgd_fast.FGD(
        [dict(params=[next(it) for _ in shapes], orthogonal=True, **h) for shapes, h in groups],
        lr=0.1,
        backend="cuda",
        variant=variant,
    )
    ow, ophi = [w.copy() for w in w0], [None] * len(layers)
    for _ in range(3):
        grads = [rng.standard_normal(s) / np.sqrt(np.prod(s)) for s, _ in layers]
        for p, g in zip(params, grads):
            p.grad = _tensor(cuda, g, torch.float64)
        opt.step()
        for i, (_, h) in enumerate(layers):
            ow[i], ophi[i] = oracle(ow[i], grads[i], ophi[i], **h)
    for p, w, phi in zip(params, ow, ophi):
        assert _rel_err(p.detach(), w) < 1e-12
        buf = opt.state[p].get("momentum_buffer")
        assert (buf is None) == (phi is None)
        if buf is not None:
            assert _rel_err(fgd_fast.as_stiefel(buf), phi) < 1e-11


# ------------------------------------------------------------------ the emulator itself


@pytest.mark.parametrize("switch", ["assembly", "ucontext"])
def test_emulator_catches_barrier_and_memory_errors(emu_ext, switch):
    """The emulator itself: a missing barrier gives a wrong result in either order; a
    divergent one, a bad configuration, a read or write past the end of a buffer and an
    endless loop fail the launch, and it runs on normally afterwards; with either way of
    switching threads."""
    threads, blocks = 64, 3
    want = torch.tensor(
        [(t + 1) % threads + 1000 * b for b in range(blocks) for t in range(threads)], dtype=torch.float32
    )
    was = emu_ext.use_ucontext(switch == "ucontext")
    try:
        for reverse in (False, True):
            emu_ext.set_reverse_schedule(reverse)
            rc, _, out = emu_ext.selftest("exchange", blocks, threads)
            assert rc == 0 and torch.equal(out, want)
            rc, _, out = emu_ext.selftest("exchange-without-barrier", blocks, threads)
            assert rc == 0 and not torch.equal(out, want)  # a race the sequential threads expose
        emu_ext.set_reverse_schedule(False)
        rc, message, _ = emu_ext.selftest("divergent-barrier", 1, threads)
        assert rc != 0 and "divergent __syncthreads()" in message
        rc, message, _ = emu_ext.selftest("exchange", 1, 2048)  # more threads than a block may have
        assert rc != 0 and "invalid launch configuration" in message
        for which in ("read-past-end", "write-past-end"):
            rc, message, out = emu_ext.selftest(which, blocks, threads)
            assert rc == 700 and "illegal address" in message, (which, rc, message)  # cudaErrorIllegalAddress
            assert f"block ({blocks - 1}, 0, 0), thread {threads - 1}" in message, message
            assert guards_intact(out)
        timeout = emu_ext.set_launch_timeout(0.3)
        try:
            rc, message, _ = emu_ext.selftest("endless-loop", 1, threads)
        finally:
            emu_ext.set_launch_timeout(timeout)
        assert rc == 702 and "timed out" in message and "thread 0" in message, (rc, message)  # cudaErrorLaunchTimeout
        rc, _, out = emu_ext.selftest("exchange", blocks, threads)
        assert rc == 0 and torch.equal(out, want)  # errors do not stick, abandoned threads do no harm
    finally:
        emu_ext.use_ucontext(was)
        emu_ext.set_reverse_schedule(False)


def test_emulator_poisons_shared_memory_in_every_block(emu_ext):
    """Shared memory a block has not written reads as NaN (a GPU's holds garbage), in every
    block: not a static's zeros, nor the last block's values."""
    for reverse in (False, True):
        emu_ext.set_reverse_schedule(reverse)
        rc, _, out = emu_ext.selftest("stale-shared", 3, 64)
        assert rc == 0 and bool(torch.isnan(out).all()), out
    emu_ext.set_reverse_schedule(False)


#: planted mutants of csrc/ the emulated tests must catch: kernel file, line, its replacement, the test
#: that fails on the kernels built with it (float32: a NaN read with a zero coefficient)
CSRC_MUTANTS = {
    # the θ tile's zero fill past p dropped for that one operand: in the emulator the elements past
    # p were a static's zeros or stale finite values that met only zeros of M's tile, and every
    # test passed, where a GPU's leftover NaN gives NaN · 0 = NaN in θ₊ (shared memory is now
    # poisoned per block)
    "zero-fill-dropped": (
        "fgd_update.cu",
        "Ts[rr][kk] = k < p ? snap[snap_index(rows_fast, rr, k, p)] : Acc(0);",
        "if (k < p) Ts[rr][kk] = snap[snap_index(rows_fast, rr, k, p)];",
        "test_float64_matches_oracle[ragged]",
    ),
    # the guard's reset (s = 0) reading the gradient anyway: 0 · NaN written into θ₊ and Φ₊
    "eta-read-at-zero": (
        "fgd_update.cu",
        "Acc uu = eta == Acc(0) ? Acc(0) : -eta * to_acc(grad[r * gsr + c * gsc]);",
        "Acc uu = -eta * to_acc(grad[r * gsr + c * gsc]);",
        "test_a_nan_input_with_the_checks_off_is_reset_writing_nothing_non_finite[gradient-dtype1]",
    ),
    # … or the momentum buffer
    "beta-read-at-zero": (
        "fgd_update.cu",
        "if (reads_phi && beta != Acc(0)) uu",
        "if (reads_phi) uu",
        "test_a_nan_input_with_the_checks_off_is_reset_writing_nothing_non_finite[momentum-dtype1]",
    ),
}


@pytest.mark.parametrize("name", sorted(CSRC_MUTANTS))
def test_the_emulated_tests_catch_a_planted_kernel_mutant(tmp_path, name):
    """Built from a copy of csrc/ with one planted mutant (:data:`CSRC_MUTANTS`), the test named
    for it fails (and only it runs: one build of the kernels, in a child process)."""
    if not sys.platform.startswith("linux") or compiler() is None:
        pytest.skip("the CUDA emulator needs Linux and g++")
    kernel, line, replacement, test = CSRC_MUTANTS[name]
    mutant = tmp_path / "csrc"
    shutil.copytree(CSRC, mutant)
    source = mutant / kernel
    assert source.read_text().count(line) == 1, f"{kernel} changed: update the mutant {name!r}"
    source.write_text(source.read_text().replace(line, replacement))
    env = {**os.environ, "FGD_EMU_CSRC": str(mutant)}
    node = f"{Path(__file__).resolve()}::{test}"
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", node],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert run.returncode == 1 and "1 failed" in run.stdout, run.stdout[-3000:]


def test_emulated_16_bit_conversions_match_torch(emu_ext):
    """__half2float, __float2half_rn, __bfloat162float and __float2bfloat16_rn of the
    emulator against torch: every 16-bit value, and float32 values at and around every
    rounding tie, plus random bit patterns."""
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float16, torch.bfloat16):
        every = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
        up = emu_ext.convert(every, dtype)
        want = every.float()
        assert torch.equal(up.isnan(), want.isnan())
        assert torch.equal(up[~want.isnan()].view(torch.int32), want[~want.isnan()].view(torch.int32))

        finite = want[want.isfinite()].double().unique()  # sorted
        mid = ((finite[1:] + finite[:-1]) / 2).float()  # exact in float32: the ties
        mid = mid[(mid.double() == (finite[1:] + finite[:-1]) / 2)]
        bits = mid.view(torch.int32)
        near = torch.cat([bits - 1, bits, bits + 1]).view(torch.float32)
        rand = torch.randint(-(2**31), 2**31 - 1, (1 << 20,), generator=gen, dtype=torch.int64).to(torch.int32)
        special = torch.tensor(
            [
                0.0,
                -0.0,
                float("inf"),
                -float("inf"),
                65504.0,
                65519.99,
                65520.0,
                1e-8,
                2.0**-25,
                2.0**-24,
                3 * 2.0**-26,
                2.0**-14,
                3.4e38,
                1e-45,
            ],
            dtype=torch.float32,
        )
        x = torch.cat([near, rand.view(torch.float32), special, -special])
        down = emu_ext.convert(x, dtype)
        want = x.to(dtype)
        assert torch.equal(down.isnan(), want.isnan())
        ok = ~want.isnan()
        assert torch.equal(down[ok].view(torch.int16), want[ok].view(torch.int16)), dtype


def test_shared_arrays_are_poisoned_on_their_own_line():
    src = (
        "// __shared__ float x[4]; (a comment)\n"
        "    __shared__ Acc Ts[ROWS][UK + 1];  // tile\n"
        "    __shared__ float s[1024];\n"
    )
    out, count = poison_shared_arrays(src)
    assert count == 2 and out.count("\n") == src.count("\n")
    assert "Ts[ROWS][UK + 1]; emu::poison_shared(&Ts, sizeof Ts);  // tile" in out
    assert "s[1024]; emu::poison_shared(&s, sizeof s);" in out
    with pytest.raises(ValueError, match="cannot poison"):
        poison_shared_arrays("__shared__ float scalar;")


def test_launch_rewrite_keeps_lines_and_skips_comments():
    src = (
        "// not a launch: k<<<1, 2>>>(x);\n"
        "void f() {\n"
        "    fgd::kern<__nv_bfloat16>\n"
        "        <<<grid, fgd::NT, 0, stream>>>(a, (float*)b,\n"
        "                                       f(c, d));\n"
        "    other<<<dim3(1, 2), 32>>>();\n"
        "}\n"
    )
    out, count = rewrite_launches(src)
    assert count == 2
    assert out.count("\n") == src.count("\n")
    assert 'emu_launch("fgd::kern<__nv_bfloat16>", [&] { fgd::kern<__nv_bfloat16>(a, (float*)b,\n' in out
    assert "f(c, d)); }, grid, fgd::NT, 0, stream)" in out
    assert 'emu_launch("other", [&] { other(); }, dim3(1, 2), 32);' in out
    assert out.startswith("// not a launch: k<<<1, 2>>>(x);")
    for cu in CSRC.glob("*.cu"):  # every launch of the real sources is found
        text = cu.read_text()
        code = re.sub(r"//[^\n]*|/\*.*?\*/", "", text, flags=re.S)
        assert rewrite_launches(text)[1] == code.count("<<<") > 0, cu.name


def test_stand_in_has_the_bindings_functions_arguments_and_constants(emu_ext):
    """The stand-in must not drift from csrc/fgd_binding.cpp: same functions with the same
    number of arguments, and the same keys in constants()."""
    src = (CSRC / "fgd_binding.cpp").read_text()
    defs = re.findall(r'm\.def\("(\w+)",\s*&(\w+)', src)
    assert {name for name, _ in defs} == {"gram", "sum_splits", "update", "synchronize", "constants"}
    for name, fn in defs:
        params = re.search(rf"\b{fn}\(([^)]*)\)\s*{{", src).group(1)
        want = len([p for p in params.split(",") if p.strip()])
        assert len(inspect.signature(getattr(emu_ext, name)).parameters) == want, name
    consts = emu_ext.constants()
    assert set(re.findall(r'\bd\["(\w+)"\]', src)) == set(consts)
    assert set(re.findall(r'\bfields\["(\w+)"\]', src)) == set(consts["FIELDS"])
