"""The first-order analysis of docs/algorithm.md ("How close to the manifold"), checked.

A steady step adds C = ΦᵀΦ to the drift D = θᵀθ − I; to first order the authors' form settles
at D* = −C/(2α) (inside the manifold) and Algorithm 1 as printed (``variant="paper"``) at
D* = +C/(2α) (outside). float64, so rounding plays no part.
"""

from __future__ import annotations

import pytest
import torch

import fgd_fast


def _settle(variant: str, alpha: float, steps: int = 300):
    """Mean over the last third of the steps: (‖D‖_F, tr D / p, ‖ΦᵀΦ‖_F)."""
    gen = torch.Generator().manual_seed(0)
    w = torch.nn.Parameter(fgd_fast.orthogonalize_(torch.randn(16, 72, dtype=torch.float64, generator=gen)))
    opt = fgd_fast.FGD([dict(params=[w], orthogonal=True)], lr=0.01, feedback=alpha, backend="torch", variant=variant)
    dist = trace = drift = 0.0
    kept = steps // 3
    for k in range(steps):
        g = torch.randn(w.shape, dtype=w.dtype, generator=gen)
        w.grad = g / g.norm()
        opt.step()
        if k >= steps - kept:
            d = w.detach() @ w.detach().T - torch.eye(16, dtype=w.dtype)  # θᵀθ − I (θ = Wᵀ)
            phi = opt.state[w]["momentum_buffer"]
            dist += float(torch.linalg.matrix_norm(d)) / kept
            trace += float(d.trace()) / 16 / kept
            drift += float(torch.linalg.matrix_norm(phi @ phi.T)) / kept
    return dist, trace, drift


@pytest.mark.parametrize("alpha", [0.2, 0.4])
def test_both_variants_settle_at_the_first_order_fixed_point_on_opposite_sides(alpha):
    official, paper = _settle("official", alpha), _settle("paper", alpha)
    for dist, _, drift in (official, paper):
        assert dist == pytest.approx(drift / (2 * alpha), rel=0.12)  # ‖D*‖ = ‖C‖/(2α)
    assert official[1] < 0 < paper[1]  # D* = −C/(2α) inside, +C/(2α) outside
    assert official[1] == pytest.approx(-paper[1], rel=0.1)


def test_near_one_the_coupling_puts_the_official_form_further_off():
    """α = 0.9: the Jordan coupling 2(1 − 2α)S carries the step's fluctuations into D; the
    paper's form, which has no such term, stays near the fixed point (measured 5.5× closer)."""
    official, paper = _settle("official", 0.9), _settle("paper", 0.9)
    assert official[0] > 3 * paper[0]
    assert paper[0] == pytest.approx(paper[2] / 1.8, rel=0.25)
