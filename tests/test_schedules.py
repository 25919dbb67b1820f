"""Learning-rate (and momentum) schedules against the oracle.

Φ is kept in step units, as in the authors' code: after an lr change the carried velocity
keeps its old step size and fades as βᵏ, while the new lr scales only the new gradient. The
oracle steps with each step's lr and momentum as the scheduler left them, so a backend that
cached a hyper-parameter (or rescaled Φ) fails here.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import fgd_fast
from helpers import backend_params, device_for_tests
from oracle import fgd_step, random_stiefel

SHAPES = [(8, 4, 3, 3), (30, 7), (6, 6)]


def _schedule(name: str, opt):
    if name == "multistep":
        return torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[3, 6, 9], gamma=0.3)
    return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.2, total_steps=12)  # cycles momentum too


@pytest.mark.parametrize("schedule", ["multistep", "onecycle"])
@pytest.mark.parametrize("backend", backend_params(("reference", "torch", "triton", "cuda")))
def test_a_scheduled_run_matches_the_oracle_step_by_step(backend, schedule):
    rng = np.random.default_rng(7)
    w0 = [random_stiefel(rng, s) for s in SHAPES]
    params = [torch.nn.Parameter(torch.tensor(w, device=device_for_tests())) for w in w0]
    opt = fgd_fast.FGD([dict(params=params, orthogonal=True)], lr=0.1, momentum=0.9, backend=backend)
    sched = _schedule(schedule, opt)
    ow, ophi = [w.copy() for w in w0], [None] * len(SHAPES)
    seen = set()
    for _ in range(12):
        grads = [rng.standard_normal(s) / np.sqrt(np.prod(s)) for s in SHAPES]
        lr, beta = opt.param_groups[0]["lr"], opt.param_groups[0]["momentum"]
        seen.add((round(lr, 12), round(beta, 12)))
        for p, g in zip(params, grads):
            p.grad = torch.tensor(g, device=p.device)
        opt.step()
        sched.step()
        for i in range(len(SHAPES)):
            ow[i], ophi[i] = fgd_step(ow[i], grads[i], ophi[i], lr=lr, momentum=beta, feedback=0.4)
    assert len(seen) >= 4  # the schedule really changed the hyper-parameters
    for p, w, phi in zip(params, ow, ophi):
        np.testing.assert_allclose(p.detach().cpu().numpy(), w, rtol=0, atol=1e-12)
        buf = fgd_fast.as_stiefel(opt.state[p]["momentum_buffer"]).cpu().numpy()
        np.testing.assert_allclose(buf, phi, rtol=0, atol=1e-12)


@pytest.mark.parametrize("make", ["fgd", "cayley_sgd", "landing"])
def test_nesterov_with_momentum_scheduled_to_zero_steps_as_torch_sgd(make):
    """A review: ``OneCycleLR(base_momentum=0)`` (or ``CyclicLR``) with ``nesterov=True`` made the
    step refuse momentum 0 at the second step, where ``torch.optim.SGD`` (which checks Nesterov at
    construction only) steps without momentum. The plain group steps as torch's SGD, bit for bit;
    the constructor still refuses momentum 0 with Nesterov."""
    from fgd_fast.baselines import CayleySGD, LandingSGD

    cls = {"fgd": fgd_fast.FGD, "cayley_sgd": CayleySGD, "landing": LandingSGD}[make]
    torch.manual_seed(0)
    ortho = torch.nn.Parameter(fgd_fast.orthogonalize_(torch.randn(9, 4)))
    plain = torch.nn.Parameter(torch.randn(5, 3))
    twin = torch.nn.Parameter(plain.detach().clone())
    groups = [dict(params=[ortho], orthogonal=True), dict(params=[plain])]
    opt = cls(groups, lr=0.1, momentum=0.9, nesterov=True)
    ref = torch.optim.SGD([twin], lr=0.1, momentum=0.9, nesterov=True)
    kw = dict(max_lr=0.1, total_steps=10, base_momentum=0.0, max_momentum=0.9)
    scheds = [torch.optim.lr_scheduler.OneCycleLR(o, **kw) for o in (opt, ref)]
    zero_momentum_steps = 0
    for _ in range(10):
        ortho.grad = torch.randn_like(ortho) * 0.1
        plain.grad = torch.randn_like(plain)
        twin.grad = plain.grad.clone()
        zero_momentum_steps += opt.param_groups[1]["momentum"] == 0
        opt.step()
        ref.step()
        for s in scheds:
            s.step()
        assert torch.equal(plain, twin)
    assert zero_momentum_steps > 0  # (the schedule did reach momentum 0)
    opt.param_groups[1]["momentum"] = 0.0  # (saved mid-schedule: a review found this checkpoint refused at load)
    cls(groups, lr=0.1, momentum=0.9, nesterov=True).load_state_dict(opt.state_dict())
    assert fgd_fast.stiefel_distance(ortho) < 1e-2  # (Landing is near the manifold, not on it)
    with pytest.raises(ValueError, match="nesterov=True requires momentum > 0"):
        cls(groups, lr=0.1, momentum=0.0, nesterov=True)
