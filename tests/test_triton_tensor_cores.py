"""The tensor-core Triton step (float32, ``precision="tf32x3"`` / ``"tf32"``) against float64.

Under the CPU interpreter ``tl.dot`` ignores ``input_precision`` (fp32 products), but the
split pass rounds θ to TF32 explicitly and every product reads the rounded operands, so the
interpreter runs the same arithmetic as the GPU except for the TF32 conversion of the operands
that are not pre-split — Φ and g in the Gram pass, M_θ and M_Φ in the update — inside the
tensor cores (which truncate the 13 low mantissa bits rather than round: relative error up to
2⁻¹⁰, biased toward zero, where rounding gives 2⁻¹¹, unbiased). The "lean" emulation below does
exactly the interpreter's arithmetic in float64:

    hi = tf32(θ), lo = tf32(θ − hi);  A = hiᵀhi + hiᵀlo + loᵀhi (tf32: A = hiᵀhi)
    B = hiᵀΦ, C = ΦᵀΦ, E = hiᵀg;      Φ₊ = U + hi M_Φ, θ₊ = θ + U + hi M_θ

so the kernels are checked against it to fp32 accumulation accuracy, and against the exact
float64 oracle (tests/oracle.py) to the accuracy TF32 operands allow.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import fgd_fast
from fgd_fast.backends.tf32 import round_tf32
from helpers import backend_reason, device_for_tests, record_launches
from oracle import fgd_step, from_theta, random_stiefel, stiefel_dist, sym, to_theta

REASON = backend_reason("triton", str(device_for_tests()))
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"triton backend unavailable: {REASON}")
INTERPRETED = device_for_tests().type == "cpu"

# odd sizes, both layouts (θ = W2ᵀ for conv-like shapes, θ = W2 for tall ones), several p (p = 67:
# two Gram tiles of the unaligned 64 × 64, the symmetric blocks from their upper tiles)
SHAPES = [(16, 8, 3, 3), (33, 70), (9, 130), (20, 6), (5, 40), (150, 17), (100, 67)]
# n (θ = W2ᵀ) and p (θ = W2) multiples of 4: the ALIGNED kernels with their larger tiles
ALIGNED_SHAPES = [(16, 8, 3, 3), (12, 100), (200, 24), (40, 36)]


def tf32(x: np.ndarray) -> np.ndarray:
    """float32 values rounded to TF32 (nearest, ties to even) by the torch backend's helper."""
    return round_tf32(torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))).numpy()


def lean_step(w, grad, phi, *, lr, momentum, feedback, split=True):
    """One FGD step with the tensor-core kernels' operands, in float64 (see the module doc)."""
    th32 = to_theta(np.asarray(w, dtype=np.float32))
    th, g = th32.astype(np.float64), to_theta(np.asarray(grad, dtype=np.float32)).astype(np.float64)
    hi = tf32(th32).astype(np.float64)
    lo = tf32((th32 - tf32(th32)).astype(np.float32)).astype(np.float64)
    a = hi.T @ hi + (hi.T @ lo + lo.T @ hi if split else 0.0)
    eye = np.eye(th.shape[1])
    n_inv = 2 * eye - a
    inner = lr * sym(hi.T @ g)
    if phi is not None:
        b, c = hi.T @ phi, phi.T @ phi
        s = sym(b)
        inner = inner - c - (momentum - 1) * s + n_inv @ b @ s - feedback * (b.T @ n_inv + b)
    m_phi = n_inv @ inner
    m_theta = m_phi - feedback * (a - eye)
    u = -lr * g + (momentum * phi if phi is not None else 0.0)
    th_new = th + u + hi @ m_theta
    return from_theta(th_new, np.shape(w)), (u + hi @ m_phi if momentum != 0 else None)


def _run(shapes, precision, momentum, steps, seed, lr=0.1, feedback=0.4):
    """Steps of the Triton backend and of both oracles on the same gradients; returns
    (kernel parameters, lean emulation, float64 oracle, kernel Φ, lean Φ)."""
    rng = np.random.default_rng(seed)
    ws = [random_stiefel(rng, s).astype(np.float32) for s in shapes]
    dev = device_for_tests()
    params = [torch.nn.Parameter(torch.tensor(w, device=dev)) for w in ws]
    opt = fgd_fast.FGD(
        [dict(params=params, orthogonal=True)],
        lr=lr,
        momentum=momentum,
        feedback=feedback,
        backend="triton",
        precision=precision,
    )
    lean, exact = [w.astype(np.float64) for w in ws], [w.astype(np.float64) for w in ws]
    lean_phi, exact_phi = [None] * len(shapes), [None] * len(shapes)
    for _ in range(steps):
        gs = [(rng.standard_normal(s) / np.sqrt(np.prod(s))).astype(np.float32) for s in shapes]
        for p, g in zip(params, gs):
            p.grad = torch.tensor(g, device=dev)
        opt.step()
        for k, g in enumerate(gs):
            kw = dict(lr=lr, momentum=momentum, feedback=feedback)
            # the emulation keeps fp32 state, as the optimizer does
            lean[k], lean_phi[k] = lean_step(lean[k], g, lean_phi[k], split=precision == "tf32x3", **kw)
            lean[k] = lean[k].astype(np.float32)
            lean_phi[k] = None if lean_phi[k] is None else lean_phi[k].astype(np.float32).astype(np.float64)
            exact[k], exact_phi[k] = fgd_step(exact[k], g, exact_phi[k], **kw)
    got = [p.detach().cpu().double().numpy() for p in params]
    phis = [opt.state[p]["momentum_buffer"].cpu().double().numpy() if momentum else None for p in params]
    return got, lean, exact, phis, lean_phi


@pytest.mark.parametrize("rows", [True, False], ids=["theta=W2T", "theta=W2"])
def test_split_pass_writes_exact_tf32_halves(rows):
    """hi = tf32(θ), lo = tf32(θ − hi) bit for bit as the torch backend's split (low 13 bits
    zero), |θ − hi − lo| ≤ 2⁻²² |θ| against float64, zero padding rows past n, θ's layout;
    Inf and NaN stay Inf and NaN, whatever the NaN's payload."""
    from fgd_fast.backends import triton as tb
    from fgd_fast.kernels import meta

    rng = np.random.default_rng(3)
    shapes = [(7, 50), (12, 3, 3, 3)] if rows else [(70, 9), (130, 33)]
    dev = device_for_tests()
    values = [(rng.standard_normal(s) * 10.0 ** rng.uniform(-3, 3, s)).astype(np.float32) for s in shapes]
    values[0].flat[:3] = [np.inf, -np.inf, np.nan]
    # NaNs whose mantissa is all ones (CUDA's canonical NaN, and its negative): a rounding carry
    # out of them would make ±0 or Inf, a NaN θ that the step then no longer sees
    values[0].flat[3:5] = np.array([0x7FFFFFFF, 0xFFFFFFFF], dtype=np.uint32).view(np.float32)
    params = [torch.tensor(v, device=dev) for v in values]
    grads = [torch.zeros_like(p) for p in params]
    cls = tb._TensorCoreClass(
        list(range(len(params))),
        params,
        grads,
        [None] * len(params),
        [0.1] * 2,
        [0.0] * 2,
        [0.4] * 2,
        False,
        rows,
        "tf32x3",
    )
    table = cls.meta.cpu().numpy()
    split = cls.split.cpu().numpy()
    base = cls.split.data_ptr()
    for k, i in enumerate(cls.layers):
        th32 = to_theta(params[i].cpu().numpy())  # n × p float32
        n, p, ld = (int(table[k, f]) for f in (meta.F_N, meta.F_P, meta.F_LD))
        assert ld >= n and ld % 128 == 0
        at = lambda field, k=k: (int(table[k, field]) - base) // 4  # noqa: E731
        hi = split[at(meta.F_HI) : at(meta.F_HI) + p * ld]
        lo = split[at(meta.F_LO) : at(meta.F_LO) + p * ld]
        hi, lo = (x.reshape(p, ld).T if rows else x.reshape(ld, p) for x in (hi, lo))
        np.testing.assert_array_equal(hi[:n], tf32(th32))
        np.testing.assert_array_equal(lo[:n], tf32(th32 - tf32(th32)))
        assert not hi[n:].any() and not lo[n:].any()
        fin = np.isfinite(th32)  # a NaN's payload is the hardware's (CUDA's canonical NaN is 0x7FFFFFFF)
        assert not (hi[:n][fin].view(np.uint32) & 0x1FFF).any() and not (lo[:n][fin].view(np.uint32) & 0x1FFF).any()
        finite = np.isfinite(th32)
        np.testing.assert_array_equal(hi[:n][~finite], th32[~finite])
        err = np.abs(th32.astype(np.float64) - hi[:n].astype(np.float64) - lo[:n].astype(np.float64))
        assert (err[finite] <= 2.0**-22 * np.abs(th32[finite])).all()


@pytest.mark.parametrize(
    "precision,momentum,shapes",
    [("tf32x3", 0.9, SHAPES), ("tf32x3", 0.0, ALIGNED_SHAPES), ("tf32", 0.9, ALIGNED_SHAPES), ("tf32", 0.0, SHAPES)],
    ids=["tf32x3-momentum", "tf32x3-aligned", "tf32-aligned-momentum", "tf32"],
)
def test_tensor_core_step_matches_the_lean_emulation(precision, momentum, shapes):
    """The kernels against the float64 emulation of their arithmetic (fp32 accumulation: 2e-6),
    and against the exact float64 oracle (TF32 products of Φ, g and the update: 2e-5 for
    tf32x3; A in TF32: 3e-4). tf32x3 runs three steps; tf32 one, because from the second step
    on an fp32-level difference of θ can cross a TF32 rounding boundary and move one element
    of hi, hence of A, by 2⁻¹¹ relative (with the split, lo absorbs such a move)."""
    steps = 3 if precision == "tf32x3" else 1
    got, lean, exact, phis, lean_phis = _run(shapes, precision, momentum, steps=steps, seed=11)
    for k, (a, b, c) in enumerate(zip(got, lean, exact)):
        if INTERPRETED:
            np.testing.assert_allclose(a, b, rtol=0, atol=2e-6, err_msg=f"layer {k} vs lean emulation")
        np.testing.assert_allclose(a, c, rtol=0, atol=2e-5 if precision == "tf32x3" else 3e-4, err_msg=f"layer {k}")
        if momentum and INTERPRETED:
            np.testing.assert_allclose(to_theta(phis[k]), lean_phis[k], rtol=0, atol=2e-6)


@pytest.mark.parametrize("splits,programs", [(3, 2), (7, 5), (1, 1)])
def test_split_k_and_persistent_grid_do_not_change_the_result(splits, programs, monkeypatch):
    """Forced n-splits and persistent grid sizes give the same θ bit for bit up to the
    fixed-order sum of the splits (deterministic)."""
    from fgd_fast.backends import triton as tb
    from fgd_fast.backends import triton_launch

    base, *_ = _run(SHAPES[:3], "tf32x3", 0.9, steps=2, seed=4)
    monkeypatch.setattr(tb, "force_splits", splits)
    monkeypatch.setattr(triton_launch, "force_programs", programs)
    again, *_ = _run(SHAPES[:3], "tf32x3", 0.9, steps=2, seed=4)
    for a, b in zip(base, again):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)
    rerun, *_ = _run(SHAPES[:3], "tf32x3", 0.9, steps=2, seed=4)
    for a, b in zip(again, rerun):
        np.testing.assert_array_equal(a, b)


def test_three_launches_per_step_whatever_the_number_of_layers():
    from fgd_fast.backends import triton as tb

    counts = []
    for layers in (2, 6):
        before = dict(tb.launch_counts)
        _run([(16, 8, 3, 3), (20, 6)] * (layers // 2), "tf32x3", 0.9, steps=1, seed=0)
        counts.append({k: v - before.get(k, 0) for k, v in tb.launch_counts.items() if v != before.get(k, 0)})
    # two launch classes (both layouts), each: split, Gram, the blocks' gather, the fused middle
    # (its prologue, five product launches, the guard's three), update
    want = {"tc_split_kernel": 2, "tc_gram_kernel": 2, "gram_gather_kernel": 2, "mid_prep_kernel": 2}
    want |= {"mid_jobs_kernel": 10, "guard_sums_kernel": 2, "guard_choose_kernel": 2, "guard_blend_kernel": 2}
    want["tc_update_kernel"] = 2
    assert counts[0] == counts[1] == want


def test_stays_on_the_manifold():
    """Twenty steps with momentum: tf32x3 keeps ‖θᵀθ − I‖_F at the exact oracle's level."""
    got, _, exact, _, _ = _run(SHAPES[:2], "tf32x3", 0.9, steps=20, seed=8, lr=0.05)
    for a, c in zip(got, exact):
        assert stiefel_dist(a) <= max(3 * stiefel_dist(c), 1e-5)


@pytest.mark.parametrize("precision", ["tf32x3", "ieee"])
def test_the_predicted_distance_is_the_distance_written(precision):
    """The guard's prediction ‖θ₊ᵀθ₊ − I‖_F (``GuardReport.distance``) from the Gram blocks —
    gᵀg (a large corner entry: two equal columns of g) and Φᵀg (H, not symmetric: every tile)
    among them — on steps large enough that it is the step's own second-order terms (~2e-3, far
    above fp32 rounding), p = 67 included (two Gram tiles of either kernel set; without H's lower
    tiles the tensor-core step reset that layer, with G's its corner was lost): the guard keeps
    every step, and the prediction is within ``TOL`` relative of the distance of the θ₊ written,
    in float64. tf32x3 (tensor cores): TF32 operands, 2⁻¹¹ relative each, in E, B, G, H and the
    update's products, up to 2.7e-3 measured on the CPU emulation; ieee (the CUDA-core kernels):
    only θ₊'s float32 rounding, up to 4.5e-5 measured."""
    TOL = {"tf32x3": 2.0**-7, "ieee": 2.0**-12}
    rng = np.random.default_rng(21)
    dev = device_for_tests()
    params = [torch.tensor(random_stiefel(rng, s).astype(np.float32), device=dev) for s in SHAPES]
    bufs = [None] * len(params)
    for _ in range(2):  # the second with Φ
        raw = [to_theta(rng.standard_normal(p.shape)) for p in params]
        for g in raw:  # the last column of g that of the first: gᵀg's corner (in a lower tile) its largest
            g[:, -1] = g[:, 0]
        raw = [from_theta(g / np.linalg.norm(g), p.shape) for g, p in zip(raw, params)]  # ‖g‖ = 1
        grads = [torch.tensor(g.astype(np.float32), device=dev) for g in raw]
        kw = dict(lr=0.1, momentum=0.9, feedback=0.4, backend="triton", precision=precision)
        report = fgd_fast.fgd(params, grads, bufs, **kw)
        assert [int(code) for code in report.guarded] == [0] * len(params)  # (the guard kept every step)
    for k, (p, d) in enumerate(zip(params, report.distance)):
        actual = stiefel_dist(p.cpu().double().numpy())
        assert actual > 1e-3 and abs(float(d) - actual) <= TOL[precision] * actual, (k, float(d), actual)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="tensor-core accumulation needs a CUDA GPU")
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_tf32x3_gram_of_an_orthonormal_matrix_is_unbiased(backend):
    """Tensor cores add into their accumulator with truncation; summed over n = 5,760 rows into
    A ≈ I that biased A's diagonal by ~1e-5 and put θ 74× further from the manifold than IEEE
    fp32 after 1,000 steps (H200). The tf32x3 Gram must be as unbiased as IEEE fp32: after one
    step from an orthonormal θ with a zero gradient, θ moves only by −αθ(A − I), which is
    what a biased A would show (the mean of the diagonal of θ₊ᵀθ₊ − θᵀθ)."""
    gen = torch.Generator().manual_seed(5)
    w0 = fgd_fast.orthogonalize_(torch.randn(640, 5760, generator=gen, dtype=torch.float64)).float().cuda()
    shift = {}
    for precision in ("ieee", "tf32x3"):
        w = torch.nn.Parameter(w0.clone())
        opt = fgd_fast.FGD(
            [dict(params=[w], orthogonal=True)], lr=0.1, feedback=0.5, backend=backend, precision=precision
        )
        w.grad = torch.zeros_like(w)
        opt.step()
        before, after = (x.double() @ x.double().T for x in (w0, w.detach()))
        shift[precision] = float((after - before).diagonal().mean())
    assert abs(shift["tf32x3"]) <= 3 * abs(shift["ieee"]) + 2e-7, shift


def test_steady_steps_reuse_the_split_buffer_and_the_metadata_table(monkeypatch):
    """A captured step replays with the addresses it was captured with: the hi/lo buffer of the
    split pass is kept from step to step, so the metadata table that holds its address is built
    once (new gradient tensors change only the table, never the buffer); so are the fused
    middle's buffer (M_θ, M_Φ in it) and the update's hyper-parameter table."""
    from fgd_fast.backends import triton as tb

    seen, sizes, hogs = [], [], []
    real = tb._TensorCoreClass.__init__

    def recording(self, *args, **kwargs):
        real(self, *args, **kwargs)
        seen.append((self.split.data_ptr(), self.meta.data_ptr(), self.m_theta.data_ptr(), self.hyper_step.data_ptr()))
        sizes.append(self.split.numel())

    monkeypatch.setattr(tb._TensorCoreClass, "__init__", recording)
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(fgd_fast.orthogonalize_(torch.randn(s, generator=gen))) for s in [(16, 8, 3, 3)] * 2]
    opt = fgd_fast.FGD([dict(params=params, orthogonal=True)], lr=0.01, backend="triton", precision="tf32x3")
    grads = [torch.randn(p.shape, generator=gen) * 0.01 for p in params]
    for step in range(4):
        for p, g in zip(params, grads):
            if step < 3:
                p.grad = g  # the same gradient tensors (as a captured step reads)
            else:
                p.grad = g.clone()  # new ones
        opt.step()
        hogs.append(torch.empty(sizes[-1]))  # takes a freed buffer's memory, were it freed
    # step 0 creates Φ (another class: no Φ read); steps 1 and 2 are the steady state
    assert seen[1] == seen[2]
    assert seen[3][0] == seen[2][0] and seen[3][2:] == seen[2][2:]


def test_a_split_buffer_made_again_is_the_one_the_metadata_table_addresses(monkeypatch):
    """The split buffers are few (a sweep of models in one process evicts old ones) and the
    metadata table holds each layer's hi/lo address: a step after its buffer was evicted makes a
    new one and a table with the new addresses, never the freed buffer's (memory reused at once)."""
    from fgd_fast.backends import triton as tb
    from fgd_fast.kernels import meta

    tables = []
    real = tb._TensorCoreClass.__init__

    def recording(self, *args, **kwargs):
        real(self, *args, **kwargs)
        tables.append((self.split.data_ptr(), self.shapes, self.meta.cpu()))

    monkeypatch.setattr(tb._TensorCoreClass, "__init__", recording)
    gen = torch.Generator().manual_seed(2)
    shapes = [(16, 8, 3, 3), (12, 20)]
    params = [torch.nn.Parameter(fgd_fast.orthogonalize_(torch.randn(s, generator=gen))) for s in shapes]
    opt = fgd_fast.FGD([dict(params=params, orthogonal=True)], lr=0.01, backend="triton", precision="tf32x3")
    grads = [torch.randn(p.shape, generator=gen) * 0.01 for p in params]
    hogs = []
    for _ in range(2):
        for p, g in zip(params, grads):
            p.grad = g  # (the same tensors: only the split buffer moves)
        opt.step()
        for key in [k for k in tb._split_buffers if k[0] == "tc-split"]:  # evicted
            hogs.append(torch.full_like(tb._split_buffers.pop(key), float("nan")))  # (its memory, were it freed)
    assert len(tables) == 2
    for base, sh, table in tables:
        for k, at in enumerate(sh.split_off):
            assert int(table[k, meta.F_HI]) == base + 4 * at
            assert int(table[k, meta.F_LO]) == base + 4 * (sh.split_total + at)


def _twins(shapes, seed):
    """Orthonormal parameters of ``shapes`` and reference copies of them."""
    gen = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(fgd_fast.orthogonalize_(torch.randn(s, generator=gen))) for s in shapes]
    return params, [torch.nn.Parameter(p.detach().clone()) for p in params], gen


def _step_both(opt, ref, params, twins, gen, steps: int, scale: float) -> None:
    """``steps`` steps of ``opt`` and of ``ref`` on the same random gradients (× ``scale``)."""
    for _ in range(steps):
        for p, t in zip(params, twins):
            p.grad = torch.randn(p.shape, generator=gen) * scale
            t.grad = p.grad.clone()
        opt.step()
        ref.step()


def test_two_classes_of_the_same_shapes_keep_their_own_tables():
    """Two groups of the same layer shapes, one with momentum and one without, are two launch
    classes in one step (Φ read or not) that look alike but for Φ: each keeps its own work tables
    (B, C, H tiles only where Φ is). Both match the reference."""
    shapes = [(16, 8, 3, 3), (12, 20)] * 2
    params, twins, gen = _twins(shapes, seed=5)

    def groups(ps):
        return [dict(params=ps[:2], orthogonal=True, momentum=0.0), dict(params=ps[2:], orthogonal=True, momentum=0.9)]

    opt = fgd_fast.FGD(groups(params), lr=0.05, backend="triton", precision="tf32x3")
    ref = fgd_fast.FGD(groups(twins), lr=0.05, backend="reference")
    _step_both(opt, ref, params, twins, gen, steps=3, scale=0.1)
    for p, t in zip(params, twins):  # TF32 operands: the tensor-core bound of this file
        assert (p - t).abs().max() < 1e-3


def test_the_same_parameters_stepped_at_another_precision_or_without_a_prediction():
    """The split buffer (hi, and lo for tf32x3: twice the size) and the work tables (G, H tiles
    only with a prediction) are kept per set of parameters: the same parameters stepped with
    neither guard nor checks, then with the guard, in ``"tf32"`` and then ``"tf32x3"``, get
    their own, and each step is the reference's."""
    from fgd_fast import fgd

    shapes = [(16, 8, 3, 3), (12, 20), (40, 36)]
    params, twins, gen = _twins(shapes, seed=6)
    bufs, twin_bufs = [None] * len(shapes), [None] * len(shapes)
    off = dict(guard=False, check_finite=False, check_manifold=False)
    for precision, options in (("tf32", off), ("tf32", {}), ("tf32x3", {})):
        grads = [torch.randn(p.shape, generator=gen) * 0.1 for p in params]
        kw = dict(lr=0.05, momentum=0.9, feedback=0.4, **options)
        with torch.no_grad():
            fgd(params, grads, bufs, backend="triton", precision=precision, **kw)
            fgd(twins, [g.clone() for g in grads], twin_bufs, backend="reference", **kw)
        for p, t in zip(params, twins):  # (tf32: A in TF32, ~1e-3 relative; the file's bound)
            assert (p - t).abs().max() < 1e-3, (precision, options)


def test_a_scheduler_rewrites_the_hyper_parameter_table_in_place(monkeypatch):
    """lr and momentum changed every step (a scheduler): the kernels' [η, β, α] table keeps its
    memory (a captured step reads it; no table built per step), holds each step's values, and
    the steps match the torch backend's under the same schedule."""
    from fgd_fast.backends import triton as tb

    seen = []
    real = tb._Operands.__init__

    def recording(self, *args, **kwargs):
        real(self, *args, **kwargs)
        seen.append((self.hyper.data_ptr(), self.hyper.clone()))

    monkeypatch.setattr(tb._Operands, "__init__", recording)
    gen = torch.Generator().manual_seed(1)
    shapes = [(16, 8, 3, 3)] * 2
    start = [fgd_fast.orthogonalize_(torch.randn(s, generator=gen)) for s in shapes]
    grads = [[torch.randn(s, generator=gen) * 0.01 for s in shapes] for _ in range(4)]
    final = {}
    for backend in ("triton", "torch"):
        params = [torch.nn.Parameter(w.clone()) for w in start]
        opt = fgd_fast.FGD(
            [dict(params=params, orthogonal=True)], lr=0.01, momentum=0.9, backend=backend, precision="ieee"
        )
        for step in range(4):
            opt.param_groups[0]["lr"] = 0.01 * (1 + step)
            opt.param_groups[0]["momentum"] = 0.9 - 0.1 * step
            for p, g in zip(params, grads[step]):
                p.grad = g
            opt.step()
        final[backend] = [p.detach().clone() for p in params]
    # step 0 has no Φ (another launch class); steps 1-3 share one table, rewritten each step
    assert len({ptr for ptr, _ in seen[1:]}) == 1
    for step, (_, table) in enumerate(seen[1:], 1):
        want = torch.tensor([0.01 * (1 + step), 0.9 - 0.1 * step, 0.4])  # (α: the default feedback)
        assert torch.allclose(table, want.expand_as(table)), (step, table)
    for a, b in zip(final["triton"], final["torch"]):
        assert torch.allclose(a, b, atol=1e-6)


def test_an_odd_layer_does_not_take_the_aligned_kernels_from_the_others(monkeypatch):
    """ResNet-50's 147-row stem (θ's contiguous dimension not a multiple of 4) used to drop its
    whole launch class to the unaligned tiles and 4-byte loads: aligned layers now form their
    own class, and both classes compute the step."""
    launches = record_launches(monkeypatch)
    shapes = [(16, 8, 3, 3), (8, 3, 7, 7), (16, 8, 3, 3)]  # the second: n = 147 (a stem's)
    params, twins, gen = _twins(shapes, seed=0)
    opt = fgd_fast.FGD([dict(params=params, orthogonal=True)], lr=0.05, backend="triton", precision="tf32x3")
    ref = fgd_fast.FGD([dict(params=twins, orthogonal=True)], lr=0.05, backend="reference")
    _step_both(opt, ref, params, twins, gen, steps=2, scale=0.01)
    aligned = [kw["ALIGNED"] for name, kw in launches if "ALIGNED" in kw and "gram" in name]
    assert sorted(set(aligned)) == [False, True]
    for p, t in zip(params, twins):  # TF32 operands: the tensor-core bound of this file
        assert (p - t).abs().max() < 1e-3


@pytest.mark.parametrize(
    "shape, offset",
    [((30, 16, 3, 3), 0), ((41, 12), 0), ((16, 8, 3, 3), 1)],
    ids=["rows-n144-p30", "cols-n41-p12", "aligned-shape-4-bytes-in"],
)
def test_a_layer_is_aligned_only_where_n_and_p_both_are(shape, offset, monkeypatch):
    """The ALIGNED kernels assert ``n`` and ``p`` multiples of 4 (the p × p block offsets and the
    M loads depend on p whatever the layout) and 16-byte aligned addresses: a layer whose
    contiguous dimension alone is a multiple of 4 (θ = W2ᵀ with n = 144, p = 30; θ = W2 with
    p = 12, n = 41), or whose memory starts 4 bytes into a buffer (a view), must not get them —
    on a GPU a hint that does not hold is a misaligned 16-byte access. The step is still right."""
    launches = record_launches(monkeypatch)
    gen = torch.Generator().manual_seed(1)
    numel = math.prod(shape)
    memory = torch.empty(numel + offset)[offset:].view(shape)  # (offset 1: 4 bytes past an aligned start)
    param = torch.nn.Parameter(memory.copy_(fgd_fast.orthogonalize_(torch.randn(shape, generator=gen))))
    assert param.data_ptr() % 16 == 4 * offset
    twin = torch.nn.Parameter(param.detach().clone())
    opt = fgd_fast.FGD([dict(params=[param], orthogonal=True)], lr=0.05, backend="triton", precision="tf32x3")
    ref = fgd_fast.FGD([dict(params=[twin], orthogonal=True)], lr=0.05, backend="reference")
    param.grad = torch.randn(shape, generator=gen) * 0.01
    twin.grad = param.grad.clone()
    opt.step()
    ref.step()
    aligned = [kw["ALIGNED"] for _, kw in launches if "ALIGNED" in kw]
    assert aligned and not any(aligned), aligned
    assert (param - twin).abs().max() < 1e-3  # TF32 operands: the tensor-core bound of this file


def test_every_row_tile_divides_the_padding_of_hi_and_lo():
    """hi and lo rows are padded to ``LD_ALIGN``; the Gram pass walks them in ``BK`` steps and
    the update in ``BR`` rows, unmasked inside the padding: every such tile must divide it."""
    from fgd_fast.kernels import tc_step as TC

    configs = [*TC.GRAM_CONFIG.values(), *TC.UPDATE_CONFIG.values()]
    tiles = [cfg[name] for cfg in configs for name in ("BK", "BR") if name in cfg]
    assert tiles and all(TC.LD_ALIGN % t == 0 for t in tiles), (TC.LD_ALIGN, tiles)


@pytest.mark.parametrize("splits", [1, 2, 3, 7])
def test_every_split_of_n_is_whole_bk_steps(splits):
    """The Gram kernel asserts a split's rows start at a multiple of ``BK``
    (``tl.multiple_of(chunk, BK)``): every layer's rows per split, whatever n and the number of
    splits, are whole ``BK`` steps (a last split may be shorter or empty)."""
    from fgd_fast.backends import triton_tables as tables
    from fgd_fast.kernels import tc_step as TC

    np_list = [(147, 64), (33, 5), (1000, 17), (4, 4), (130, 129)]
    for (precision, aligned), cfg in TC.GRAM_CONFIG.items():
        ucfg = TC.UPDATE_CONFIG[precision, aligned]
        sh = tables.tc_shapes(
            np_list, torch.device("cpu"), 1, True, True, cfg, ucfg, TC.SPLIT_CONFIG, True, forced_splits=splits
        )
        assert sh.splits == splits
        for (n, _), chunk in zip(np_list, sh.chunk):
            assert chunk % cfg["BK"] == 0 and chunk * splits >= n, (n, chunk, cfg)


def test_m_blocks_that_break_the_aligned_hints_are_refused_before_any_write(monkeypatch):
    """A kernel review: the aligned update kernel claims M_θ and M_Φ 16-byte aligned
    (``tl.multiple_of``), which nothing checked (true today by the middle's offsets, sums of p²
    with p a multiple of 4). A middle that broke it would make wrong 16-byte loads on a GPU: the
    step refuses it now, changing nothing."""
    from fgd_fast.backends import fused_middle

    run = fused_middle.run

    def shifted(*args, **kwargs):  # the middle's M_θ one float off its 16-byte boundary
        mid = run(*args, **kwargs)
        off = torch.empty(mid.m_theta.numel() + 1, dtype=mid.m_theta.dtype, device=mid.m_theta.device)[1:]
        mid.m_theta = off.copy_(mid.m_theta.reshape(-1)).view_as(mid.m_theta)
        return mid

    monkeypatch.setattr(fused_middle, "run", shifted)
    gen = torch.Generator().manual_seed(2)
    dev = device_for_tests()
    param = torch.nn.Parameter(fgd_fast.orthogonalize_(torch.randn(16, 8, 3, 3, generator=gen)).to(dev))
    opt = fgd_fast.FGD([dict(params=[param], orthogonal=True)], lr=0.05, backend="triton", precision="tf32x3")
    param.grad = torch.randn(param.shape, generator=gen).to(dev) * 0.01
    before = param.detach().clone()
    with pytest.raises(RuntimeError, match="not 16-byte aligned"):
        opt.step()
    assert torch.equal(param.detach(), before) and not opt.state[param]


@pytest.mark.parametrize("precision", ["tf32x3", "tf32", "ieee"])
@pytest.mark.parametrize("variant", ["official", "paper"], ids=["fused-middle", "torch-middle"])
def test_the_middles_products_run_at_the_steps_precision(precision, variant, monkeypatch):
    """Every product kernel of the middle — the fused middle's jobs (the official update) and the
    torch-ops middle's one launch per product (the paper's) — runs on tensor cores (TF32, its
    ``X ∓ D·X`` forms keep fp32 accuracy) where the step does and in IEEE fp32 at ``"ieee"``: the
    CPU interpreter computes both alike, so only the launches tell."""
    launches = record_launches(monkeypatch)
    params, twins, gen = _twins([(16, 8, 3, 3), (12, 20)], seed=7)
    opt = fgd_fast.FGD(
        [dict(params=params, orthogonal=True)],
        lr=0.05,
        momentum=0.9,
        backend="triton",
        precision=precision,
        variant=variant,
    )
    ref = fgd_fast.FGD(
        [dict(params=twins, orthogonal=True)], lr=0.05, momentum=0.9, backend="reference", variant=variant
    )
    _step_both(opt, ref, params, twins, gen, steps=2, scale=0.1)
    products = [kw["PRECISION"] for name, kw in launches if name in ("mid_jobs_kernel", "mid_mm_kernel")]
    assert products and set(products) == {"ieee" if precision == "ieee" else "tf32"}, products
    for p, t in zip(params, twins):
        assert (p - t).abs().max() < 1e-3


def test_a_split_buffer_made_anew_is_the_one_the_kernels_address(monkeypatch):
    """The split buffer (hi, lo) of a set of parameters is evicted where more models step than the
    cache keeps, and made anew at another address: the metadata table the kernels read is keyed
    by that address too, so the next step addresses the new buffer, never the old one's memory
    (which another model's buffer may hold by then), and steps as the reference."""
    from fgd_fast.backends import base
    from fgd_fast.backends import triton as tb
    from fgd_fast.kernels import meta

    monkeypatch.setattr(tb, "_split_buffers", base.TableCache(capacity=16))
    params, twins, gen = _twins([(16, 8, 3, 3), (12, 20)], seed=9)
    kw = dict(lr=0.05, momentum=0.9)
    opt = fgd_fast.FGD([dict(params=params, orthogonal=True)], backend="triton", precision="tf32x3", **kw)
    ref = fgd_fast.FGD([dict(params=twins, orthogonal=True)], backend="reference", **kw)
    for p, t in zip(params, twins):  # gradients written in place: the same addresses every step
        p.grad, t.grad = torch.zeros_like(p), torch.zeros_like(t)

    def step():
        for p, t in zip(params, twins):
            p.grad.copy_(torch.randn(p.shape, generator=gen) * 0.1)
            t.grad.copy_(p.grad)
        opt.step()
        ref.step()

    step()
    evicted = list(tb._split_buffers.values())  # (kept alive: the new buffers get other addresses)
    tb._split_buffers.clear()
    step()
    live = [(b.data_ptr(), b.data_ptr() + 4 * b.numel()) for k, b in tb._split_buffers.items() if k[0] == "tc-split"]
    assert live and not {b.data_ptr() for b in evicted} & {lo for lo, _ in live}
    tables = [t for k, t in tb._tables.items() if k[0] == "tc-meta"][-len(live) :]  # this step's (LRU order)
    for table in tables:
        for hi in table[:, meta.F_HI].tolist():
            assert any(lo <= hi < end for lo, end in live), hi
    for p, t in zip(params, twins):
        assert (p - t).abs().max() < 1e-3
