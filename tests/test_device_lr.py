"""``lr`` as a tensor (``FGD(lr=torch.tensor(0.01))``): a scheduler changes it in place, the
Triton and CUDA backends read it on the device (so a captured step sees each new value), the
others read it on the host; every backend steps exactly as with the same float."""

from __future__ import annotations

import traceback

import pytest
import torch

import fgd_fast
from fgd_fast.backends import guard_rule
from fgd_fast.backends.base import hyper_table
from helpers import backend_params, backend_reason, captured, device_for_tests, stiefel_problem

SHAPES = [(8, 4, 3, 3), (12, 5), (6, 6)]


def _run(backend: str, lr, steps: int = 4):
    """θ after ``steps`` steps with StepLR(γ = 0.7) changing ``lr`` (a float or a tensor)."""
    params, grads = stiefel_problem(SHAPES)
    opt = fgd_fast.FGD([dict(params=params, orthogonal=True)], lr=lr, backend=backend)
    schedule = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.7)
    gen = torch.Generator().manual_seed(3)
    for _ in range(steps):
        for p, g in zip(params, grads):
            p.grad = g * torch.rand((), generator=gen)
        opt.step()
        schedule.step()
    return params, opt


@pytest.mark.parametrize("backend", backend_params(("reference", "torch", "triton")))
def test_a_tensor_lr_steps_as_the_float_does(backend):
    floats, _ = _run(backend, 0.05)
    lr = torch.tensor(0.05)
    tensors, opt = _run(backend, lr)
    assert opt.param_groups[0]["lr"] is lr  # the scheduler changed it in place
    for a, b in zip(floats, tensors):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=0, atol=1e-7)


def test_the_fused_backends_read_a_tensor_lr_on_the_device(monkeypatch):
    """The Triton step (as a GPU runs it) never reads the lr tensor on the host: η reaches its
    table by device ops (the optimizer's own checks read a CPU tensor's value, where that is
    free; not counted)."""
    reason = backend_reason("triton", device_for_tests())
    if reason:
        pytest.skip(reason)
    monkeypatch.setattr(guard_rule, "HOST_READ_DEVICES", ())
    lr = torch.tensor(0.05, device=device_for_tests())
    reads = []
    for name in ("__float__", "item", "tolist"):
        real = getattr(torch.Tensor, name)

        def watched(self, *args, _real=real, _name=name, **kwargs):
            caller = traceback.extract_stack()[-2].filename
            if self is lr and ("backends" in caller or caller.endswith("functional.py")):
                reads.append((_name, caller))
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, watched)
    params, grads = stiefel_problem(SHAPES)
    opt = fgd_fast.FGD([dict(params=params, orthogonal=True)], lr=lr, backend="triton")
    reads.clear()  # (construction reads a CPU tensor once, to check its value)
    for _ in range(2):
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()
        lr.mul_(0.5)
    assert reads == []


def test_the_hyper_table_follows_the_tensor():
    lr = torch.tensor(0.1)
    owners = (id(lr), "test")
    first = hyper_table(((lr, 0.9, 0.4), (0.2, 0.8, 0.3)), torch.float32, torch.device("cpu"), owners)
    lr.fill_(0.05)
    second = hyper_table(((lr, 0.9, 0.4), (0.2, 0.8, 0.3)), torch.float32, torch.device("cpu"), owners)
    assert first[:, 0].tolist() == pytest.approx([0.1, 0.2]) and second[:, 0].tolist() == pytest.approx([0.05, 0.2])
    assert second[:, 1:].flatten().tolist() == pytest.approx([0.9, 0.4, 0.8, 0.3])


@pytest.mark.parametrize(
    "bad, error",
    [(torch.tensor([0.1, 0.2]), TypeError), (torch.tensor(1), TypeError), (torch.tensor(-0.1), ValueError)],
    ids=["two-values", "integer", "negative"],
)
def test_a_bad_tensor_lr_is_refused(bad, error):
    with pytest.raises(error, match="lr"):
        fgd_fast.FGD(stiefel_problem(SHAPES)[0], lr=bad)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graph capture needs a CUDA GPU")
@pytest.mark.parametrize("backend", backend_params(("triton", "cuda")))
def test_a_captured_step_replays_each_new_tensor_lr(backend):
    """Captured once with lr a CUDA tensor; a scheduler-like in-place change before each replay
    reaches the step (eager steps with the same floats as the twin)."""
    params, grads = stiefel_problem([(8, 4, 3, 3), (20, 6), (40, 40)])
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    lr = torch.tensor(0.1, device="cuda")
    kw = dict(backend=backend, check_finite=False, check_manifold=False)
    opt = fgd_fast.FGD([dict(params=params, orthogonal=True)], lr=lr, **kw)
    eager = fgd_fast.FGD([dict(params=twins, orthogonal=True)], lr=0.1, **kw)
    for p, t, g in zip(params, twins, grads):
        p.grad, t.grad = g.clone(), g.clone()
    graph = captured(opt.step)  # (two warm-up steps: the first creates Φ)
    for _ in range(2):
        eager.step()
    for value in (0.05, 0.02, 0.08):
        lr.fill_(value)
        eager.param_groups[0]["lr"] = value
        graph.replay()
        eager.step()
    torch.cuda.synchronize()
    for p, t in zip(params, twins):
        torch.testing.assert_close(p.detach(), t.detach(), rtol=1e-6, atol=1e-6)
