"""The torch backend's own promises: every way it can take the products (layer by layer in
place, staged stacks, symmetric Grams as block halves) matches the float64 oracle; ``apply``
allocates nothing (all scratch is made in ``prepare``, so running out of memory happens before
any write); and a step's extra memory stays within 3× the constrained parameters' bytes
or, on a CPU, a fixed allowance of 36 MB (deterministic byte accounting of the aten ops, not
timing)."""

from __future__ import annotations

import pytest
import torch

import fgd_fast
from fgd_fast.backends import guard_rule, torch_batched, torch_bucket, torch_groups
from fgd_fast.backends.torch_batched import prepare_torch
from helpers import device_for_tests, fgd_steps, stiefel_problem
from test_fgd_oracle import _rel_err, _run

GPU_BOUNDS = {"_CPU_MIDDLE_FLOOR": 0, "_CPU_STACK_FLOOR": 0}  # the chunk and stack sizes from the model's bytes alone
# staging rule, halves rule: the CPU default, everything staged (the GPU's stacks), halves for every p
MODES = {
    "default": {},
    "staged": {"_CPU_STACK_BELOW": 1 << 62, "_STACK_FRACTION": 1 / 6, **GPU_BOUNDS},
    "in-place": {"_CPU_STACK_BELOW": 0},
    "halves": {"_HALVES_FROM": 2},
    "staged-halves": {"_CPU_STACK_BELOW": 1 << 62, "_HALVES_FROM": 2},
    "one-layer-stacks": {"_CPU_STACK_BELOW": 1 << 62, "_STACK_FRACTION": 1e-9, **GPU_BOUNDS},
}


@pytest.fixture(params=sorted(MODES))
def mode(request, monkeypatch):
    if device_for_tests().type != "cpu" and request.param != "default":
        pytest.skip("the staging knobs are the CPU's; a GPU always stages")
    for name, value in MODES[request.param].items():
        owner = torch_bucket if hasattr(torch_bucket, name) else torch_batched  # (setattr raises on a name it lacks)
        monkeypatch.setattr(owner, name, value)
    if request.param == "staged":  # as on a GPU: no host reads (every layer blended, every mask applied)
        monkeypatch.setattr(guard_rule, "HOST_READ_DEVICES", ())
    return request.param


@pytest.mark.parametrize("problem", ["channels-last", "mixed-groups", "same-shape", "square", "stateless", "odd"])
def test_every_product_path_matches_the_float64_oracle(mode, problem):
    params, opt, ow, ophi = _run(problem, "torch", torch.float64, steps=6)
    for p, w, phi in zip(params, ow, ophi):
        assert _rel_err(p, w) < 1e-12
        if phi is not None:
            assert _rel_err(fgd_fast.as_stiefel(opt.state[p]["momentum_buffer"]), phi) < 1e-11


class _ProductShapes(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the output shape of every ``bmm``."""

    def __init__(self):
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket is torch.ops.aten.bmm:
            self.shapes.append(tuple(out.shape))
        return out


@pytest.mark.parametrize("mode", ["default", "halves", "staged-halves"], indirect=True)
def test_halves_modes_form_the_symmetric_grams_in_halves(mode):
    """The modes that ask for block halves take them (so the oracle test above covers that path):
    the symmetric Grams come as an upper block row ``(c, h, p)`` and a ``(c, p − h, p − h)`` corner
    (h = ⌊p/2⌋); the default (halves from p = 160) forms these p = 5 and 6 blocks whole."""
    params, grads = stiefel_problem([(12, 5), (6, 2, 3, 1)])
    opt = fgd_steps(params, grads, "torch", steps=1)
    for p, g in zip(params, grads):
        p.grad = g.clone()
    with _ProductShapes() as seen:
        opt.step()
    halves = {shape[1:] for shape in seen.shapes} & {(2, 5), (3, 3), (3, 6)}
    assert halves == (set() if mode == "default" else {(2, 5), (3, 3), (3, 6)}), seen.shapes


class _NewStorages(torch.utils._python_dispatch.TorchDispatchMode):
    """Records every aten op that returns a tensor on storage none of its inputs had."""

    def __init__(self):
        super().__init__()
        self.allocating: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        leaves = torch.utils._pytree.tree_leaves
        seen = {t.untyped_storage().data_ptr() for t in leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in leaves(out):
            if isinstance(t, torch.Tensor) and t.numel() and t.untyped_storage().data_ptr() not in seen:
                self.allocating.append(str(func))
        return out


@pytest.mark.parametrize("precision", ["ieee", "tf32x3"])
@pytest.mark.parametrize("first", [True, False], ids=["first-step", "with-momentum"])
def test_apply_allocates_nothing(mode, precision, first):
    """Every write of the step happens in ``apply``, in place, into buffers made in ``prepare``:
    a step that runs out of memory does so before it has written anything."""
    shapes = [(8, 4, 3, 3), (8, 4, 3, 3), (30, 6), (5, 11), (16, 16)]
    params, grads = stiefel_problem(shapes)
    params[0].data = params[0].data.to(memory_format=torch.channels_last)
    bufs = [torch.zeros_like(p) for p in params]
    bufs[-1] = None  # a stateless layer among them
    fresh = [first] * len(params)
    count = len(params)
    with torch.no_grad():
        plan = prepare_torch(
            params,
            grads,
            bufs,
            fresh,
            lr=[0.1] * count,
            momentum=[0.9] * 4 + [0.0],
            feedback=[0.4] * count,
            check_finite=True,
            precision=precision,
        )
        with _NewStorages() as watch:
            plan.apply()
    assert watch.allocating == []


def test_out_of_memory_in_prepare_changes_nothing(monkeypatch):
    """A failure inside prepare (here: running out of memory as the second bucket takes its
    share of the middle) leaves every parameter and buffer as it was, the first bucket's
    included."""
    params, grads = stiefel_problem([(8, 4, 3, 3), (12, 5)])
    opt = fgd_steps(params, grads, "torch", steps=1)
    before = [p.detach().clone() for p in params], [opt.state[p]["momentum_buffer"].clone() for p in params]
    real, calls = torch_bucket.Bucket.take, []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise torch.OutOfMemoryError("simulated: out of memory")
        return real(*args, **kwargs)

    monkeypatch.setattr(torch_bucket.Bucket, "take", failing)
    for p, g in zip(params, grads):
        p.grad = g.clone()
    with pytest.raises(torch.OutOfMemoryError):
        opt.step()
    for p, w, phi in zip(params, *before):
        assert torch.equal(p.detach(), w)
        assert torch.equal(opt.state[p]["momentum_buffer"], phi)


@pytest.mark.filterwarnings("ignore:the FGD step guard bound")
@pytest.mark.parametrize("mode", ["staged", "one-layer-stacks"], indirect=True)
@pytest.mark.parametrize("nan_at", [0, 2], ids=["first-chunk", "last-chunk"])
def test_a_reset_in_one_middle_chunk_writes_nothing_non_finite(mode, nan_at):
    """A bucket whose middle runs in several chunks (a GPU's middle budget: one layer each here),
    a NaN gradient in one layer with the checks off: the guard resets that layer, and the update
    applies the reset's zero masks wherever the reset was — not only when the last chunk had one
    (a NaN written into θ and Φ passed every test before); the others step as the reference's."""
    shapes = [(20, 5)] * 3
    params_by = {}
    for backend in ("reference", "torch"):
        params, grads = stiefel_problem(shapes, dtype=torch.float64)
        opt = fgd_steps(params, grads, backend, steps=1, check_finite=False)
        for p, g in zip(params, grads):
            p.grad = g.clone()
        params[nan_at].grad[3, 2] = float("nan")
        opt.step()
        assert opt.guard_stats()[nan_at]["reset"] == 1
        params_by[backend] = [p.detach() for p in params], [opt.state[p]["momentum_buffer"] for p in params]
    for got, want in zip(*(sum(params_by[b], []) for b in ("torch", "reference"))):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


class _MatmulPrecisions(torch.utils._python_dispatch.TorchDispatchMode):
    """Records, for every ``bmm``, whether both operands read ``storage`` and the float32 matmul
    precision in force (what cuBLAS would honour on a GPU)."""

    def __init__(self, storage: int):
        super().__init__()
        self.storage, self.seen = storage, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket is torch.ops.aten.bmm:
            gram = all(a.untyped_storage().data_ptr() == self.storage for a in args[:2])
            self.seen.append((gram, torch.get_float32_matmul_precision()))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("precision", ["ieee", "tf32x3", "tf32"])
@pytest.mark.parametrize("p", [5, 12])
def test_each_precision_forms_a_at_its_own_setting(precision, p, monkeypatch):
    """``"tf32x3"`` forms A = θᵀθ in IEEE fp32 (cuBLAS's TF32 sums are biased: A sets the distance
    the feedback settles at) and every other product with TF32 allowed; ``"tf32"`` all of them in
    TF32, ``"ieee"`` none; the caller's setting is restored. Read on a CPU from the setting in
    force at each product (p = 12: A in block halves too)."""
    monkeypatch.setattr(torch_bucket, "_HALVES_FROM", 10)
    params, grads = stiefel_problem([(30, p)])
    opt = fgd_steps(params, grads, "torch", steps=1, precision=precision)
    params[0].grad = grads[0].clone()
    saved = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("medium")
    try:
        with _MatmulPrecisions(params[0].untyped_storage().data_ptr()) as products:
            opt.step()
        assert torch.get_float32_matmul_precision() == "medium"
    finally:
        torch.set_float32_matmul_precision(saved)
    a = {mode for gram, mode in products.seen if gram}
    rest = {mode for gram, mode in products.seen if not gram}
    assert len([gram for gram, _ in products.seen if gram]) == (2 if p == 12 else 1), products.seen
    want_a, want_rest = {"ieee": ("highest", "highest"), "tf32x3": ("highest", "high"), "tf32": ("high", "high")}[
        precision
    ]
    assert a == {want_a} and rest == {want_rest}, products.seen


def _workload_params(name: str):
    """The constrained weights of a benchmark workload at the CPU scale, with gradients."""
    from benchmarks.memtrack import peak_extra_bytes
    from benchmarks.workloads import workloads

    w = next(x for x in workloads("cpu") if x.name == name)
    group = fgd_fast.stiefel_param_groups(w.model("cpu"), w.rule, orthogonalize=False)[0]
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(p.shape, generator=gen) * 1e-2 for p in group["params"]]
    return group, grads, peak_extra_bytes


@pytest.mark.parametrize("mode", ["default", "staged"], indirect=True)  # (what the staging rule bounds)
@pytest.mark.parametrize("precision", ["ieee", "tf32x3"])
@pytest.mark.parametrize("workload", ["wrn-28-10", "transformer"])
def test_extra_memory_of_a_step_is_bounded_by_the_parameters_and_their_blocks(mode, workload, precision):
    """Peak bytes the step allocates (every aten op's new storage, tracked live: the
    benchmark's CPU method), with momentum, against the bytes of the constrained weights. The CPU
    default: at most twice the weights (the stacks of small layers) plus 12 p × p blocks a layer
    (the Gram blocks A, E, B, C, G, H, the two M's, four temporaries of the middle); measured: 1.76×
    the weights on WRN-28-10 (0.53× the bound), 9.8 MB on the Transformer set, whose blocks are as
    large as its layers (0.78×). A review found the old bound, a fixed 36 MB floor, passing a step
    that kept three more copies of every gradient (this one fails it). Staged (the GPU's stacks):
    at most three times the weights."""
    group, grads, peak_extra_bytes = _workload_params(workload)
    params = group["params"]
    opt = fgd_fast.FGD([group], lr=5e-4, backend="torch", precision=precision)
    for _ in range(2):  # the measured step has momentum buffers
        for p, g in zip(params, grads):
            p.grad = g
        opt.step()
    constrained = sum(p.numel() * p.element_size() for p in params)
    blocks = sum(fgd_fast.stiefel_shape(p.shape)[1] ** 2 * p.element_size() for p in params)  # Σ p² per layer
    peak, _ = peak_extra_bytes(opt.step, torch.device("cpu"))
    bound = 3 * constrained if mode == "staged" else 2 * constrained + 12 * blocks
    assert 0 < peak <= bound, (peak / constrained, peak / blocks)


def test_unknown_precision_is_refused_by_the_backend():
    params, grads = stiefel_problem([(8, 4, 3, 3)])
    with pytest.raises(ValueError, match="precision"):
        prepare_torch(
            params, grads, [None], [True], lr=[0.1], momentum=[0.0], feedback=[0.4], check_finite=False, precision="fp8"
        )


@pytest.mark.parametrize("scale", [1e-3, 1.0, 1e18, 1e30])
def test_gradient_norm_in_float32_where_host_reads_are_free_matches_float64(scale, monkeypatch):
    """On a CPU ‖g‖² of a float32 g is taken in float32 and redone in float64 only when it
    overflows (or g is not finite): the float64 pass's value to float32 rounding, and inf/NaN
    where that is."""
    gen = torch.Generator().manual_seed(0)
    grads = list(torch.randn(3, 24, 216, generator=gen) * scale)
    grads[2][0, 0] = float("inf")
    got, want = torch.empty(3, dtype=torch.float64), torch.empty(3, dtype=torch.float64)
    torch_groups.grad_sq_into(grads, got)
    monkeypatch.setattr(guard_rule, "HOST_READ_DEVICES", ())  # the GPU's way: always float64
    torch_groups.grad_sq_into(grads, want)
    assert torch.allclose(got[:2], want[:2], rtol=1e-5) and torch.isinf(got[2]) and torch.isinf(want[2])


def test_cpu_step_in_inference_mode_leaves_normal_tensors_and_autograd_safe(monkeypatch):
    """The CPU step runs in ``torch.inference_mode`` (its temporaries skip autograd's tracking),
    yet what outlives it is normal: θ and Φ (written in place, versions bumped, so a graph that
    saved θ refuses to backpropagate), the guard's counters, the layout's cached indices; Φ can
    be changed in place afterwards (e.g. a checkpoint loaded into it), and the step matches the
    same step outside inference mode bit for bit."""
    from fgd_fast.backends import layout

    monkeypatch.setattr(layout, "_indices", {})  # (built by these steps)
    gen = torch.Generator().manual_seed(11)
    shapes = [(12, 5, 3, 3), (12, 5, 3, 3), (6, 20), (9, 9), (9, 9)]  # three p: a multi-group layout
    runs = {}
    for mode in (1, 0):
        torch_batched._CPU_INFERENCE_MODE = mode
        try:
            gen.manual_seed(11)
            params = [torch.nn.Parameter(fgd_fast.orthogonalize_(torch.randn(s, generator=gen))) for s in shapes]
            opt = fgd_fast.FGD([dict(params=params, orthogonal=True)], lr=0.05, backend="torch")
            grads = torch.Generator().manual_seed(12)
            for _ in range(3):
                for p in params:
                    p.grad = torch.randn(p.shape, generator=grads) * 0.1
                opt.step()
            runs[mode] = [p.detach().clone() for p in params]
        finally:
            torch_batched._CPU_INFERENCE_MODE = 1
    for a, b in zip(runs[1], runs[0]):
        assert torch.equal(a, b)
    saved = (params[0] * params[0]).sum()  # saves θ for backward
    version = params[0]._version
    opt.step()
    assert params[0]._version > version
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        saved.backward()
    for p in params:
        state = opt.state[p]
        tensors = [state["momentum_buffer"], p] + [t for t in state.values() if isinstance(t, torch.Tensor)]
        assert not any(t.is_inference() for t in tensors)
        state["momentum_buffer"].mul_(0.5)  # in place outside inference mode: allowed
    built = [t for index in layout._indices.values() for t in (index._layer, index._perm) if t is not None]
    assert built  # (built inside the mode, by the steps)
    for index in layout._indices.values():
        assert not any(t.is_inference() for t in (*built, index.diag, *index.eyes.values()))


def test_layers_of_different_shapes_with_one_w2_share_a_bucket_and_match_the_reference():
    """A Linear (6, 40), a Conv (6, 10, 2, 2) and a (6, 5, 8) tensor are one ``W2 = 6 × 40``:
    one bucket whose stacked operands copy each layer in its own shape (a view in the first
    layer's shape for all failed only here)."""
    out = {}
    for backend in ("reference", "torch"):
        params, grads = stiefel_problem([(6, 40), (6, 10, 2, 2), (6, 40), (6, 5, 8)], dtype=torch.float64)
        opt = fgd_steps(params, grads, backend, steps=3, momentum=0.9)
        out[backend] = [(p.detach().clone(), opt.state[p]["momentum_buffer"].clone()) for p in params]
    for (w_ref, b_ref), (w, b) in zip(out["reference"], out["torch"]):
        torch.testing.assert_close(w, w_ref, rtol=0, atol=1e-12)
        torch.testing.assert_close(b, b_ref, rtol=0, atol=1e-12)
