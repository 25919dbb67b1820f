"""``maximize=True``: the gradient negated for every parameter, as in ``torch.optim.SGD``."""

from __future__ import annotations

import pytest
import torch

import fgd_fast
from fgd_fast.baselines import CayleyADAM, CayleySGD, LandingSGD


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.Flatten(), torch.nn.Linear(8 * 4 * 4, 5))


def _steps(make, maximize: bool, sign: float):
    net = _net()
    opt = make(fgd_fast.stiefel_param_groups(net, "all"), maximize)
    gen = torch.Generator().manual_seed(1)
    for _ in range(4):
        for p in net.parameters():
            p.grad = sign * torch.randn(p.shape, generator=gen)
        opt.step()
    return [p.detach().clone() for p in net.parameters()]


MAKERS = {
    "FGD": lambda groups, m: fgd_fast.FGD(groups, lr=0.05, momentum=0.9, weight_decay=1e-3, maximize=m),
    "LandingSGD": lambda groups, m: LandingSGD(groups, lr=0.05, momentum=0.9, weight_decay=1e-3, maximize=m),
    "CayleySGD": lambda groups, m: CayleySGD(groups, lr=0.05, momentum=0.9, weight_decay=1e-3, maximize=m),
    "CayleyADAM": lambda groups, m: CayleyADAM(groups, lr=0.05, weight_decay=1e-3, maximize=m),
}


@pytest.mark.parametrize("name", list(MAKERS))
def test_maximize_is_minimising_the_negated_objective(name):
    ascend = _steps(MAKERS[name], True, 1.0)
    descend = _steps(MAKERS[name], False, -1.0)
    for a, b in zip(ascend, descend):
        assert torch.equal(a, b)
    assert not all(torch.equal(a, b) for a, b in zip(ascend, _steps(MAKERS[name], False, 1.0)))


def test_euclidean_groups_match_torch_sgd_with_maximize():
    net, ref = _net(), _net()
    opt = fgd_fast.FGD(net.parameters(), lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-2, maximize=True)
    sgd = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-2, maximize=True)
    gen = torch.Generator().manual_seed(2)
    for _ in range(3):
        for p, q in zip(net.parameters(), ref.parameters()):
            p.grad = torch.randn(p.shape, generator=gen)
            q.grad = p.grad.clone()
        opt.step()
        sgd.step()
    for p, q in zip(net.parameters(), ref.parameters()):
        assert torch.equal(p, q)


def test_maximize_must_be_a_bool_and_is_kept():
    with pytest.raises(TypeError, match="maximize"):
        fgd_fast.FGD(_net().parameters(), lr=0.1, maximize=1)
    opt = fgd_fast.FGD(_net().parameters(), lr=0.1, maximize=True)
    other = fgd_fast.FGD(_net().parameters(), lr=0.1)
    other.load_state_dict(opt.state_dict())
    assert other.maximize is True
