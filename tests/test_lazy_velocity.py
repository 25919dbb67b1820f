"""The guard's velocity Gram on demand (the torch backend where a host read is free): the full
step's distance is first bounded with ``‖s²UᵀU‖_F ≤ (s(β‖Φ‖ + η‖g‖))²``
(:func:`fgd_fast.backends.guard_rule.velocity_bound`), the rest from norms alone
(:func:`fgd_fast.backends.guard_rule.step_bound`) or, where that leaves the target, exactly; ``UᵀU`` is
formed only where the bound still leaves the target. The bounds are upper bounds (equality
included), the decisions and the step are those of the exact rule, and the Gram is skipped
where the bound fits."""

from __future__ import annotations

import warnings

import pytest
import torch

import fgd_fast
from fgd_fast.backends import guard_rule, torch_bucket
from fgd_fast.backends.layout import Layout
from fgd_fast.backends.torch_batched import prepare_torch
from fgd_fast.guards import MAX_DISTANCE, TRUST_RADIUS

SHAPES = [(12, 5, 3, 3), (12, 5, 3, 3), (6, 20), (9, 9)]  # three p, one square


def test_velocity_bound_is_an_upper_bound_and_attained():
    """Random U, and the equality case: a rank-one g with Φ = −kg (then ‖U‖ = β‖Φ‖ + η‖g‖ and
    ‖UᵀU‖_F = ‖U‖²_F); per-layer β, η and a trust scale s < 1 on some layers."""
    gen = torch.Generator().manual_seed(0)
    cases = []
    for n, p in [(20, 5), (7, 7), (50, 3)]:
        g = torch.randn(n, p, generator=gen, dtype=torch.float64)
        cases.append((torch.randn(n, p, generator=gen, dtype=torch.float64), g))  # random
        one = torch.outer(torch.randn(n, generator=gen, dtype=torch.float64), torch.randn(p, generator=gen))
        cases.append((-3.0 * one, one.clone()))  # Φ = −3g, g rank one: the bound is attained
    for phi, g in cases:
        beta, lr = torch.tensor([0.9, 0.5]), torch.tensor([0.1, 2.0])
        scale = torch.tensor([1.0, 0.3], dtype=torch.float64)
        bound = guard_rule.velocity_bound(
            phi.norm().expand(2), g.norm().expand(2), beta.view(2, 1, 1), lr.view(2, 1, 1), scale
        )
        for k in range(2):
            u = scale[k] * (beta[k].double() * phi - lr[k].double() * g)
            exact = (u.T @ u).norm()
            assert exact <= bound[k] * (1 + 1e-12)
            if torch.linalg.matrix_rank(g) == 1:
                assert exact == pytest.approx(float(bound[k]), rel=1e-12)


def _stiefel_step(theta, m, u):
    """The exact ``θ₊ᵀθ₊ − I − UᵀU`` of ``θ₊ = θ(I + M) + U`` (float64), and ``T = θᵀU``."""
    plus = theta @ (torch.eye(m.shape[0], dtype=m.dtype) + m) + u
    return plus.T @ plus - torch.eye(m.shape[0], dtype=m.dtype) - u.T @ u, theta.T @ u


@pytest.mark.parametrize("scale", [1e-6, 1e-2, 0.3, 3.0])
def test_step_bound_is_an_upper_bound_and_attained(scale):
    """``step_bound`` against the exact distance without s²UᵀU, on θ off the manifold by ~scale/10,
    random M and U of norm ~scale (one layer per shape, in one multi-p layout), and its equality
    case: θ orthonormal, M = 0 and a symmetric T (then the distance is 2‖T‖_F, all first order)."""
    gen = torch.Generator().manual_seed(int(scale * 1e6) % 1000)
    shapes = [(30, 5), (7, 7), (40, 12)]
    exact, m_blocks, t_blocks, dists = [], [], [], []
    for n, p in shapes:
        q = torch.linalg.qr(torch.randn(n, p, generator=gen, dtype=torch.float64))[0]
        theta = q + 0.1 * scale * torch.randn(n, p, generator=gen, dtype=torch.float64) / n
        m = scale * torch.randn(p, p, generator=gen, dtype=torch.float64) / p
        u = scale * torch.randn(n, p, generator=gen, dtype=torch.float64) / n**0.5
        d, t = _stiefel_step(theta, m, u)
        exact.append(d.norm())
        m_blocks.append(m.reshape(-1))
        t_blocks.append(t.reshape(-1))
        dists.append((theta.T @ theta - torch.eye(p, dtype=torch.float64)).norm())
    lay = Layout([(1, p) for _, p in shapes])
    bound = guard_rule.step_bound(torch.stack(dists), torch.cat(m_blocks), torch.cat(t_blocks), lay)
    assert (torch.stack(exact) <= bound * (1 + 1e-12)).all()
    q = torch.linalg.qr(torch.randn(20, 6, generator=gen, dtype=torch.float64))[0]
    sym_t = torch.randn(6, 6, generator=gen, dtype=torch.float64)
    sym_t = scale * (sym_t + sym_t.T)
    d, t = _stiefel_step(q, torch.zeros(6, 6, dtype=torch.float64), q @ sym_t)
    dist = (q.T @ q - torch.eye(6, dtype=torch.float64)).norm().reshape(1)
    bound = guard_rule.step_bound(dist, torch.zeros(1, 6, 6, dtype=torch.float64), t.unsqueeze(0))
    assert float(bound[0]) == pytest.approx(float(d.norm()), rel=1e-9, abs=1e-12)


@pytest.mark.parametrize("d, c, t", [(0.0, 0.5, 0.0), (0.0, 0.3, 0.4), (0.2, 0.3, 0.4), (1e-3, 2.0, 1.5)])
def test_step_bound_is_attained_with_every_second_order_term(d, c, t):
    """The equality case of every term (p = 1, all of one sign): θ a column of norm √(1 + d), M = c
    and U along θ with T = θᵀU = t give ``d + 2(c + t) + 2dc + (1 + d)c² + 2ct`` exactly, the
    bound's ``‖D‖ + 2‖M + T‖ + ‖M‖(2‖D‖ + (1 + ‖D‖)‖M‖ + 2‖T‖)``; a bound without its ‖M‖² or
    ‖M‖‖T‖ term (kept by the random cases above) would be below the distance here."""
    gen = torch.Generator().manual_seed(1)
    unit = torch.randn(9, 1, generator=gen, dtype=torch.float64)
    unit /= unit.norm()
    theta = (1.0 + d) ** 0.5 * unit
    m = torch.full((1, 1), c, dtype=torch.float64)
    exact, tt = _stiefel_step(theta, m, t / (1.0 + d) ** 0.5 * unit)
    assert float(tt) == pytest.approx(t, rel=1e-12, abs=1e-15)
    bound = guard_rule.step_bound(torch.tensor([d], dtype=torch.float64), m.unsqueeze(0), tt.unsqueeze(0))
    assert float(bound[0]) == pytest.approx(float(exact.abs().max()), rel=1e-12)
    assert float(bound[0]) == pytest.approx(d + 2 * (c + t) + 2 * d * c + (1 + d) * c * c + 2 * c * t, rel=1e-12)


def _problem(seed: int, spike: float):
    gen = torch.Generator().manual_seed(seed)
    params = [fgd_fast.orthogonalize_(torch.randn(s, generator=gen, dtype=torch.float64)) for s in SHAPES]
    grads = [torch.randn(s, generator=gen, dtype=torch.float64) * spike for s in SHAPES]
    bufs = [torch.randn(s, generator=gen, dtype=torch.float64) * 0.1 * spike for s in SHAPES]
    return params, grads, bufs


def _prepare(params, grads, bufs, *, exact_next: bool, guard: bool):
    count = len(params)
    return prepare_torch(
        params,
        grads,
        bufs,
        [False] * count,
        lr=[0.1] * count,
        momentum=[0.9] * count,
        feedback=[0.4] * count,
        check_finite=True,
        trust_radius=TRUST_RADIUS if guard else None,
        max_distance=MAX_DISTANCE,
        exact_next=exact_next,
    )


@pytest.fixture
def formed(monkeypatch):
    """Counts the passes that form the velocity Grams on demand."""
    calls = []
    real = torch_bucket.Bucket.velocity_grams

    def counting(self, *args, **kwargs):
        calls.append(len(self.layers))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(torch_bucket.Bucket, "velocity_grams", counting)
    return calls


@pytest.mark.parametrize("guard", [True, False], ids=["guard", "prediction"])
@pytest.mark.parametrize("spike", [1e-2, 0.05, 0.3, 30.0])
def test_bounded_prediction_decides_and_steps_as_the_exact_one(spike, guard, formed):
    """``exact_next=False`` against the default: the same update and decisions; ``dist_next``
    between the exact distance and the exact distance plus the bound; the Gram formed exactly
    when some layer's bound leaves the target (spikes 1e-2 and 0.05 fit, 0.3 and 30 do not)."""
    plans, written = {}, {}
    for exact in (True, False):
        params, grads, bufs = _problem(1, spike)
        with torch.no_grad():
            plans[exact] = _prepare(params, grads, bufs, exact_next=exact, guard=guard)
            plans[exact].apply()
        written[exact] = params + bufs
    for a, b in zip(written[True], written[False]):
        assert torch.equal(a, b)
    exact, bounded = plans[True], plans[False]
    assert torch.equal(exact.finite_next, bounded.finite_next)
    if guard:
        assert torch.equal(exact.guarded, bounded.guarded)
    lazy = spike < 0.1
    assert sorted(formed) == ([] if lazy else [1, 1, 2])  # the buckets' layers, when formed at all
    if lazy:
        assert (bounded.dist_next >= exact.dist_next * (1 - 1e-12)).all()
        assert (bounded.dist_next <= MAX_DISTANCE).all()
    else:
        assert torch.equal(bounded.dist_next, exact.dist_next)


def test_optimizer_takes_the_bound_and_reports_no_distance(formed):
    """``FGD`` on CPU tensors skips the Gram in ordinary steps (a spike forms it, and the guard
    decides as the reference backend does); ``GuardReport.distance`` is None where only bounded."""
    runs = {}
    for backend in ("reference", "torch"):
        params, _, _ = _problem(2, 1.0)
        params = [torch.nn.Parameter(p) for p in params]
        opt = fgd_fast.FGD([dict(params=params, orthogonal=True)], lr=0.1, backend=backend)
        gen = torch.Generator().manual_seed(3)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for k in range(6):
                for p in params:
                    p.grad = torch.randn(p.shape, generator=gen, dtype=p.dtype) * (1e3 if k == 5 else 1e-2)
                before = len(formed)
                opt.step()
        runs[backend] = [p.detach() for p in params], opt.guard_stats()
    assert runs["torch"][1] == runs["reference"][1]
    assert sum(s["scaled"] + s["reset"] for s in runs["torch"][1].values()) >= 1  # the spike bound the guard
    for a, b in zip(runs["torch"][0], runs["reference"][0]):
        assert (a - b).abs().max() <= 1e-9
    assert before == 0 and sorted(formed) == [1, 1, 2]  # only the spike's step formed the Grams
    params, grads, _ = _problem(4, 1e-2)
    report = fgd_fast.fgd(params, grads, [None] * len(params), lr=0.1, momentum=0.9, feedback=0.4, backend="torch")
    assert report.distance == [None] * len(params)


@pytest.mark.parametrize("momentum", [0.0, 0.9], ids=["no-phi", "phi"])
def test_a_step_off_the_tangent_space_is_scaled_as_the_exact_rule_says(momentum, formed):
    """g normal to θ's columns (θᵀg = 0): the first-order terms vanish and the distance after the
    full step is ‖η²gᵀg‖_F ≈ 0.7 > 0.5, all of it from UᵀU. The bound must see it: the guard
    scales as the reference backend does and θ stays within ``max_distance``."""
    results = {}
    for backend in ("reference", "torch"):
        w = torch.nn.Parameter(fgd_fast.orthogonalize_(torch.randn(6, 20, generator=torch.Generator().manual_seed(5))))
        theta = w.detach().double().T  # (20, 6)
        normal = torch.linalg.qr(torch.randn(20, 20, generator=torch.Generator().manual_seed(6)).double())[0]
        normal = normal - theta @ (theta.T @ normal)  # in the orthogonal complement of θ's columns
        q = torch.linalg.qr(normal)[0][:, :6]
        q = q - theta @ (theta.T @ q)
        c = (0.7 / 6**0.5) ** 0.5 / 0.1  # η²c²√6 = 0.7 at η = 0.1
        w.grad = (c * q / q.norm(dim=0)).T.float()
        opt = fgd_fast.FGD([dict(params=[w], orthogonal=True)], lr=0.1, momentum=momentum, backend=backend)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            opt.step()
        results[backend] = w.detach().clone(), opt.guard_stats()[0]
        assert fgd_fast.stiefel_distance(w) <= MAX_DISTANCE
    assert results["torch"][1] == results["reference"][1] == {"scaled": 1, "reset": 0}
    assert (results["torch"][0] - results["reference"][0]).abs().max() <= 1e-5
    assert formed == [1]  # the bound (~0.7) left the target: the Gram was formed
