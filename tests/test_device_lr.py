"""``lr`` as a tensor (``FGD(lr=torch.tensor(0.01))``): a scheduler changes it in place, the
torch, Triton and CUDA backends read it on the device (so a captured or compiled step sees each
new value: the compiled one in tests/test_citizen.py), the reference on the host; every backend
steps exactly as with the same float."""

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


@pytest.mark.parametrize("backend", backend_params(("reference", "torch", "triton", "cuda")))
def test_a_tensor_lr_steps_as_the_float_does(backend):
    floats, _ = _run(backend, 0.05)
    lr = torch.tensor(0.05)
    tensors, opt = _run(backend, lr)
    assert opt.param_groups[0]["lr"] is lr  # the scheduler changed it in place
    for a, b in zip(floats, tensors):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=0, atol=1e-7)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_the_device_backends_read_a_tensor_lr_on_the_device(monkeypatch, backend):
    """The torch and Triton steps (as a GPU runs them) never read the lr tensor on the host: η
    reaches the middle and the update by device ops. Through the functional API, which hands the
    backends the tensor as it is (FGD, the optimizer, hands them a CPU tensor's value, read where
    that is free, and a GPU tensor as it is)."""
    reason = backend_reason(backend, device_for_tests())
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
    bufs = [None] * len(params)
    for _ in range(2):
        with torch.no_grad():  # (as an optimizer's step)
            fgd_fast.fgd(params, [g.clone() for g in grads], bufs, lr=lr, momentum=0.9, feedback=0.4, backend=backend)
        lr.mul_(0.5)
    assert reads == []


def test_fgd_hands_the_backends_a_cpu_tensor_lr_as_its_value(monkeypatch):
    """A review of the GPU-only paths: FGD read a CPU tensor lr's value (for its checks) and still
    handed the tensor on, which each fused backend copied to the GPU with a blocking copy every step."""
    import fgd_fast.optimizer

    seen = []
    real = fgd_fast.optimizer._fgd
    monkeypatch.setattr(fgd_fast.optimizer, "_fgd", lambda *a, **kw: (seen.append(kw["lr"]), real(*a, **kw))[1])
    params, grads = stiefel_problem(SHAPES)
    opt = fgd_fast.FGD([dict(params=params, orthogonal=True)], lr=torch.tensor(0.05), backend="torch")
    for p, g in zip(params, grads):
        p.grad = g.clone()
    opt.step()
    assert seen and all(type(v) is float for v in seen[0]) and seen[0][0] == pytest.approx(0.05)


@pytest.mark.parametrize("backend", backend_params(("reference", "torch", "triton", "cuda")))
def test_tensor_and_float_lrs_in_one_step(backend):
    """Two groups, one lr a tensor and one a float, over layers of several p (one middle over
    both groups' layers in the torch backend: a per-layer η gathered from both), guard on: the
    steps of the same two floats."""

    def run(first_lr):
        params, grads = stiefel_problem(SHAPES + [(7, 3, 3, 3)])
        groups = [dict(params=params[:2], orthogonal=True, lr=first_lr), dict(params=params[2:], orthogonal=True)]
        opt = fgd_fast.FGD(groups, lr=0.03, backend=backend, trust_radius=0.5)
        for k in range(3):
            for p, g in zip(params, grads):
                p.grad = g * (1.0 + k)
            opt.step()
            for group in opt.param_groups:
                group["lr"] = group["lr"].mul_(0.5) if isinstance(group["lr"], torch.Tensor) else group["lr"] * 0.5
        return params

    for a, b in zip(run(0.05), run(torch.tensor(0.05))):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=0, atol=1e-7)


@pytest.mark.parametrize("backend", backend_params(("reference", "torch", "triton", "cuda")))
def test_two_tensor_lrs_over_layers_of_one_shape_step_as_their_floats(backend):
    """Per-layer lrs that are two tensors (handed to the backends as they are: the functional
    step), over layers of one shape (one bucket of the torch backend had they been one value):
    each layer steps with its own η, as with floats."""

    def run(lrs):
        params, grads = stiefel_problem([(12, 5)] * 4)
        bufs = [None] * len(params)
        for _ in range(3):
            with torch.no_grad():
                fgd_fast.fgd(
                    params, [g.clone() for g in grads], bufs, lr=lrs, momentum=0.9, feedback=0.4, backend=backend
                )
        return params

    first, second = torch.tensor(0.05, device=device_for_tests()), torch.tensor(0.01, device=device_for_tests())
    floats, tensors = run([0.05, 0.05, 0.01, 0.01]), run([first, first, second, second])
    for a, b in zip(floats, tensors):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=0, atol=1e-7)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # (the interpreter's NaN arithmetic)
@pytest.mark.parametrize("host_reads", [True, False], ids=["host-reads", "device-only"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
@pytest.mark.parametrize(
    "dtype, variant",
    [(torch.float32, "official"), (torch.float64, "official"), (torch.float32, "paper")],
    ids=["f32", "f64", "f32-paper"],  # (the Triton backend: the fused middle, and the torch-ops one)
)
@pytest.mark.parametrize("backend", backend_params(("torch", "triton")))
def test_a_non_finite_lr_on_the_device_resets_and_writes_nothing_non_finite(
    backend, value, host_reads, dtype, variant, monkeypatch
):
    """A guard review: an lr tensor on a GPU is never read on the host, so a NaN or Inf one
    reaches the step unchecked (``_validated``: as FGD passes it). The guard resets the step
    (r = ‖Φ‖ + η‖g‖ is not finite, s = 0), and the reset's coefficients are exact zeros: the
    torch and Triton backends wrote 0·NaN = NaN into θ and Φ. (A mutation review: the Triton
    backend's middle outside the fused kernels — float64, the paper variant — was untested.)"""
    if not host_reads:
        monkeypatch.setattr(guard_rule, "HOST_READ_DEVICES", ())  # as on a GPU: every layer blended
    gen = torch.Generator().manual_seed(0)
    theta = fgd_fast.orthogonalize_(torch.randn(6, 3, generator=gen, dtype=dtype))
    phi = torch.randn(6, 3, generator=gen, dtype=dtype) * 0.01
    grad = torch.randn(6, 3, generator=gen, dtype=dtype) * 0.1
    kw = dict(momentum=0.9, feedback=0.4, backend=backend, variant=variant)
    report = fgd_fast.functional._fgd([theta], [grad], [phi], lr=torch.tensor(value), **kw, _validated=True)
    assert report.guarded[0].item() == 2  # reset
    assert torch.isfinite(theta).all() and torch.isfinite(phi).all()
    assert fgd_fast.stiefel_distance(theta) < 1e-5


@pytest.mark.parametrize("bad", [torch.tensor(-0.1), torch.tensor(float("nan")), torch.tensor(1), torch.ones(2)])
def test_fgd_checks_a_tensor_lr_as_fgd_the_optimizer_does(bad):
    """A guard review: ``fgd_fast.fgd`` checked only float lrs; a NaN tensor lr wrote NaN."""
    theta = fgd_fast.orthogonalize_(torch.randn(6, 3))
    before = theta.clone()
    with pytest.raises((ValueError, TypeError), match="lr"):
        fgd_fast.fgd([theta], [torch.randn(6, 3)], [None], lr=bad, momentum=0.9, feedback=0.4)
    assert torch.equal(theta, before)


@pytest.mark.parametrize("lr", [1e39, torch.tensor(1e39, dtype=torch.float64)], ids=["float", "tensor"])
def test_an_lr_beyond_float32_is_refused(lr):
    """A guard review: lr = 1e39 is Inf in the fused backends' float32 η, and the Triton step
    wrote NaN; refused with the reason."""
    with pytest.raises(ValueError, match="float32"):
        fgd_fast.FGD(stiefel_problem(SHAPES)[0], lr=lr)


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
@pytest.mark.parametrize("backend", backend_params(("torch", "triton", "cuda")))
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


def test_a_plain_groups_tensor_lr_is_read_on_the_device(monkeypatch):
    """A review: the plain groups' SGD read ``float(lr)`` every step, a host synchronisation for
    a GPU lr, which a CUDA graph capture refuses (``stiefel_param_groups`` always makes a plain
    group). A float32 GPU lr goes to torch's fused SGD, which reads it on the device; run here on
    the CPU by letting that path take CPU tensors: no host read of the lr by the SGD (the checks
    read a CPU lr, where that is free), each new value used, the same bits as
    ``torch.optim.SGD(fused=True)``."""
    import fgd_fast.plain_sgd as plain_sgd

    monkeypatch.setattr(plain_sgd, "_FUSED_LR_DEVICES", ("cuda", "cpu"))
    lr = torch.tensor(0.05)
    reads = []
    for name in ("__float__", "item", "tolist"):
        real = getattr(torch.Tensor, name)

        def watched(self, *args, _real=real, _name=name, **kwargs):
            caller = traceback.extract_stack()[-2].filename
            if self is lr and (caller.endswith("functional.py") or caller.endswith("sgd.py")):  # (the SGD path)
                reads.append((_name, caller))
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, watched)
    torch.manual_seed(0)
    plain = [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(7))]
    twins = [torch.nn.Parameter(p.detach().clone()) for p in plain]
    kw = dict(momentum=0.9, weight_decay=1e-2, nesterov=True)
    opt = fgd_fast.FGD([dict(params=plain)], lr=lr, backend="torch", check_finite=False, **kw)
    ref_lr = torch.tensor(0.05)
    ref = torch.optim.SGD(twins, lr=ref_lr, fused=True, **kw)
    for value in (0.05, 0.02, 0.08):
        lr.fill_(value)
        ref_lr.fill_(value)
        for p, t in zip(plain, twins):
            p.grad = torch.randn_like(p)
            t.grad = p.grad.clone()
        opt.step()
        ref.step()
        for p, t in zip(plain, twins):
            assert torch.equal(p, t)
    assert reads == []
    grads, bufs = [p.grad for p in plain], [opt.state[p]["momentum_buffer"] for p in plain]
    assert plain_sgd._fused_reads(torch.tensor(0.1), plain, grads, bufs, 0.9)
    # where the fused kernel cannot read it (its CUDA kernel refuses these with an error, the CPU's
    # takes them: checked here by the predicate), a host read: a float64 lr; buffers of which some
    # are still to be made (a parameter whose first gradient comes later); a gradient or buffer of
    # other strides; a non-dense parameter; and the CPU's own default
    assert not plain_sgd._fused_reads(torch.tensor(0.1, dtype=torch.float64), plain, grads, bufs, 0.9)
    assert not plain_sgd._fused_reads(torch.tensor(0.1), plain, grads, [bufs[0], None], 0.9)
    assert plain_sgd._fused_reads(torch.tensor(0.1), plain, grads, [bufs[0], None], 0.0)
    assert not plain_sgd._fused_reads(torch.tensor(0.1), plain, [grads[0].t().contiguous().t(), grads[1]], bufs, 0.9)
    assert not plain_sgd._fused_reads(torch.tensor(0.1), plain, grads, [bufs[0].t().contiguous().t(), bufs[1]], 0.9)
    wide = torch.randn(5, 6)[:, :3]
    assert not plain_sgd._fused_reads(torch.tensor(0.1), [wide, plain[1]], [torch.randn(5, 3), grads[1]], bufs, 0.0)
    monkeypatch.setattr(plain_sgd, "_FUSED_LR_DEVICES", ("cuda",))
    assert not plain_sgd._fused_reads(torch.tensor(0.1), plain, grads, bufs, 0.9)


def test_a_plain_group_whose_parameter_gets_its_first_gradient_later_steps_with_a_tensor_lr(monkeypatch):
    """A review of the fused path: torch's fused SGD makes every momentum buffer at its first step
    and refuses a group where some are made and some are not (a parameter of an unused branch,
    unfrozen later): such a step reads the lr on the host and steps as torch's SGD."""
    import fgd_fast.plain_sgd as plain_sgd

    monkeypatch.setattr(plain_sgd, "_FUSED_LR_DEVICES", ("cuda", "cpu"))
    torch.manual_seed(0)
    plain = [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(7))]
    twins = [torch.nn.Parameter(p.detach().clone()) for p in plain]
    opt = fgd_fast.FGD([dict(params=plain)], lr=torch.tensor(0.05), backend="torch")
    ref = torch.optim.SGD(twins, lr=0.05, momentum=0.9)
    for step in range(3):
        for k, (p, t) in enumerate(zip(plain, twins)):
            p.grad = t.grad = None
            if k == 0 or step > 0:  # (the second parameter's first gradient at step 1)
                p.grad = torch.randn_like(p)
                t.grad = p.grad.clone()
        opt.step()
        ref.step()
        for p, t in zip(plain, twins):
            torch.testing.assert_close(p, t, rtol=0, atol=1e-7)


def test_a_hyper_table_rewritten_by_a_replay_is_copied_again_by_the_next_eager_step():
    """A review: after a capture, a replay writes the captured values into the table; an eager
    step with the values the table last had from an eager copy skipped its copy and ran with the
    replay's values."""
    from fgd_fast.backends.base import _HyperTable

    table = _HyperTable(2, torch.float32, torch.device("cpu"))
    now = ((0.1, 0.9, 0.4), (0.2, 0.9, 0.4))
    table.set(now)
    table.captured.append(torch.empty(2, 3))  # (a capture recorded a copy of its own mirror)
    table.table.fill_(7.0)  # (what a replay wrote)
    assert torch.equal(table.set(now), torch.tensor(now, dtype=torch.float32))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graph capture needs a CUDA GPU")
def test_a_captured_step_with_a_plain_group_replays_each_new_tensor_lr():
    """As the capture test above, with the plain group ``stiefel_param_groups`` makes (biases):
    its SGD reads the CUDA lr on the device, so the capture succeeds and each replay uses the new
    value (the eager twin, a float lr, steps torch's multi-tensor SGD: equal to rounding)."""
    params, grads = stiefel_problem([(8, 4, 3, 3), (20, 6)])
    plain = [torch.nn.Parameter(torch.randn(8, device=params[0].device)) for _ in range(2)]
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params + plain]
    lr = torch.tensor(0.1, device="cuda")
    kw = dict(backend="torch", check_finite=False, check_manifold=False)
    groups = [dict(params=params, orthogonal=True), dict(params=plain)]
    opt = fgd_fast.FGD(groups, lr=lr, **kw)
    eager = fgd_fast.FGD([dict(params=twins[:2], orthogonal=True), dict(params=twins[2:])], lr=0.1, **kw)
    for p, t, g in zip(params + plain, twins, grads + [torch.randn_like(q) for q in plain]):
        p.grad, t.grad = g.clone(), g.clone()
    graph = captured(opt.step)
    for _ in range(2):
        eager.step()
    for value in (0.05, 0.02, 0.08):
        lr.fill_(value)
        for group in eager.param_groups:
            group["lr"] = value
        graph.replay()
        eager.step()
    torch.cuda.synchronize()
    for p, t in zip(params + plain, twins):
        torch.testing.assert_close(p.detach(), t.detach(), rtol=1e-6, atol=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CPU tensor lr beside GPU parameters)")
@pytest.mark.parametrize("backend", backend_params(("torch", "triton", "cuda")))
def test_the_functional_step_reads_a_cpu_tensor_lr_for_gpu_parameters_on_the_host(backend):
    """A review: ``fgd_fast.fgd`` handed a CPU tensor lr to the fused backends, which copied it to
    the GPU every step (blocking; refused inside a CUDA-graph capture). Its value is read where
    that is free, so a captured step replays (with the captured value, as a float lr does)."""
    params, grads = stiefel_problem([(8, 4, 3, 3), (20, 6)])
    bufs = [None] * len(params)
    kw = dict(momentum=0.9, feedback=0.4, backend=backend, check_finite=False, check_manifold=False)

    def step():
        fgd_fast.fgd(params, [g.clone() for g in grads], bufs, lr=torch.tensor(0.05), **kw)

    graph = captured(step)
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.isfinite(p).all() for p in params)
