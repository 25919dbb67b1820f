"""Triton-specific behaviour: launch counts, split-K, determinism, precision tilings.
(Numerics against the oracle, capture and no-sync live in the backend-parametrised tests.)"""

from __future__ import annotations

import pytest
import torch

import fgd_fast
from helpers import backend_reason, device_for_tests
from helpers import fgd_steps as _steps
from helpers import stiefel_problem as _problem

pytestmark = pytest.mark.skipif(
    backend_reason("triton", str(device_for_tests())) is not None,
    reason=f"triton backend unavailable: {backend_reason('triton', str(device_for_tests()))}",
)


@pytest.mark.parametrize("layers", [3, 12])
def test_kernel_launches_per_step_do_not_grow_with_layers(layers):
    from fgd_fast.backends import triton as tb

    shapes = [(8, 4, 3, 3), (20, 6), (5, 40)] * (layers // 3)  # rows and columns layouts
    params, grads = _problem(shapes)
    opt = _steps(params, grads, "triton", steps=1, precision="ieee")  # first step: creates Φ (CUDA-core kernels)
    before = dict(tb.launch_counts)
    for p, g in zip(params, grads):
        p.grad = g.clone()
    opt.step()
    launched = {k: v - before.get(k, 0) for k, v in tb.launch_counts.items() if v != before.get(k, 0)}
    # two launch classes (rows / columns layout), each six Gram launches (A, B, C, E and the
    # guard's G, H), one gather of the blocks into the middle's layout, the fused middle (its
    # prologue, five product launches, the guard's three) and two update launches (Φ₊, then θ₊),
    # whatever the number of layers
    want = {"gram_kernel": 12, "gram_gather_kernel": 2, "mid_prep_kernel": 2, "mid_jobs_kernel": 10}
    want |= {"guard_sums_kernel": 2, "guard_choose_kernel": 2, "guard_blend_kernel": 2, "update_kernel": 4}
    assert launched == want


_SPLIT_SHAPES = [(16, 8, 3, 3), (33, 70), (9, 130)]


@pytest.fixture(scope="module")
def unsplit_run():
    """The unsplit reference of the split-K tests, run once for all of them."""
    params, grads = _problem(_SPLIT_SHAPES, dtype=torch.float64)
    start = [p.detach().clone() for p in params]
    _steps(params, grads, "triton", steps=3)
    return start, grads, [p.detach().clone() for p in params]


@pytest.mark.parametrize("splits", [2, 3, 7])
def test_split_k_gram_matches_unsplit(splits, monkeypatch, unsplit_run):
    from fgd_fast.backends import triton as tb

    start, grads, unsplit = unsplit_run
    params = [torch.nn.Parameter(p.clone()) for p in start]
    monkeypatch.setattr(tb, "force_splits", splits)
    _steps(params, grads, "triton", steps=3)
    for a, b in zip(unsplit, params):
        torch.testing.assert_close(a, b, rtol=1e-13, atol=1e-14)


def test_deterministic_run_to_run():
    shapes = [(16, 8, 3, 3), (33, 70)]
    runs = []
    for _ in range(2):
        params, grads = _problem(shapes, seed=5)
        _steps(params, grads, "triton", steps=3)
        runs.append([p.detach().clone() for p in params])
    for a, b in zip(*runs):
        assert torch.equal(a, b)


@pytest.mark.parametrize("momentum", [0.9, 0.0], ids=["momentum", "no-momentum"])
@pytest.mark.parametrize("precision", ["ieee", "tf32x3", "tf32"])
def test_precision_mode_matches_the_reference_within_the_mode_bound(precision, momentum):
    """Each precision launches its own kernels: "ieee" the CUDA-core ones (fp32: 1e-5),
    "tf32x3"/"tf32" the tensor-core ones, whose operands are rounded to TF32 by their split pass
    even under the interpreter: tf32x3 (A in 3×TF32, the rest TF32) within 3e-5 after three
    steps of lr 0.1, tf32 (A in TF32: ~1e-3 relative error in θᵀθ) within 5e-3. p = 67 takes
    two column blocks of the updates: without momentum θ₊ = θ − ηg + θM_θ with a large M_θ, so
    the CUDA-core update, in place, must read θ from its snapshot of the row block, never
    columns it has already written."""
    shapes = [(16, 8, 3, 3), (24, 40), (100, 67)]
    params, grads = _problem(shapes, seed=2)
    ref = [torch.nn.Parameter(p.detach().clone()) for p in params]
    _steps(params, grads, "triton", steps=3, precision=precision, momentum=momentum)
    _steps(ref, grads, "reference", steps=3, momentum=momentum)
    tol = {"ieee": 1e-5, "tf32x3": 3e-5, "tf32": 5e-3}[precision]
    for a, b in zip(params, ref):
        torch.testing.assert_close(a, b, rtol=0, atol=tol)


@pytest.mark.parametrize(
    "dtype, precision, tol",
    [(torch.float64, "ieee", 1e-10), (torch.float32, "tf32x3", 1e-3)],
    ids=["f64", "tensor-cores"],
)
def test_launch_classes_of_as_many_layers_keep_their_own_hyper_parameters(dtype, precision, tol):
    """Two launch classes of one dtype and one layer each (θ = W2ᵀ and θ = W2), groups with other
    η and β, the guard off (the update kernels read the hyper-parameter table itself): each class
    keeps its own table (keyed by its parameters), not one table per layer count, which the second
    class rewrote before the first one's update read it."""

    def groups(params):
        return [
            dict(params=[params[0]], orthogonal=True),
            dict(params=[params[1]], lr=0.02, momentum=0.5, orthogonal=True),
        ]

    _beside_reference([(8, 4, 3, 3), (20, 6)], groups, precision=precision, tol=tol, dtype=dtype, guard=False)


def _beside_reference(shapes, groups, *, precision: str, tol: float, dtype=torch.float32, **options) -> None:
    """Three steps (lr 0.1, momentum 0.9, ``options``) of the Triton backend at ``precision`` and of
    the reference on the same problem (``groups(params)``: the parameter groups; gradients g,
    2g, 3g): the same θ within ``tol``."""
    results = {}
    for backend in ("reference", "triton"):
        params, grads = _problem(shapes, dtype=dtype)
        kw = dict(precision=precision) if backend == "triton" else {}
        opt = fgd_fast.FGD(groups(params), lr=0.1, momentum=0.9, backend=backend, **kw, **options)
        for k in range(3):
            for p, g in zip(params, grads):
                p.grad = g * (k + 1)
            opt.step()
        results[backend] = [p.detach().clone() for p in params]
    for a, b in zip(results["reference"], results["triton"]):
        torch.testing.assert_close(b, a, rtol=0, atol=tol)


@pytest.mark.parametrize("precision, tol", [("ieee", 1e-5), ("tf32x3", 1e-3)], ids=["cuda-cores", "tensor-cores"])
def test_launch_classes_of_the_same_shapes_keep_their_own_fused_middle(precision, tol):
    """Two launch classes in one step whose middles have the same layout (θ = W2ᵀ of a 6 × 20
    weight and θ = W2 of a 20 × 6 one: p = 6 both, with Φ both): each class keeps its own fused
    middle's memory (keyed by its parameters), where one buffer per layout let the second class's
    middle overwrite the first's M_θ and M_Φ before the first class's update read them."""
    _beside_reference([(6, 20), (20, 6)], lambda ps: [dict(params=ps, orthogonal=True)], precision=precision, tol=tol)


@pytest.mark.parametrize("precision, tol", [("ieee", 1e-5), ("tf32x3", 1e-3)], ids=["cuda-cores", "tensor-cores"])
def test_a_momentum_buffer_in_another_layout_is_stepped_and_written_back(precision, tol):
    """A momentum buffer whose memory is not a dense ``(c_o, m)`` matrix (channels_last: a caller's
    own buffer list, or a checkpoint's tensors) is stepped through a contiguous copy and written
    back: Φ₊ reaches the caller's tensor (and the next step reads it), as the reference's."""
    results = {}
    for backend in ("reference", "triton"):
        params, grads = _problem([(8, 4, 3, 3), (6, 3, 3, 3)])
        bufs = [None, None]
        kw = dict(lr=0.1, momentum=0.9, feedback=0.4, backend=backend)
        kw |= dict(precision=precision) if backend == "triton" else {}
        for k in range(3):
            fgd_fast.fgd(params, [g * (k + 1) for g in grads], bufs, **kw)
            bufs = [b.to(memory_format=torch.channels_last) for b in bufs]
            assert not bufs[0].is_contiguous()
        results[backend] = [t.detach().clone() for t in (*params, *bufs)]
    for a, b in zip(results["reference"], results["triton"]):
        torch.testing.assert_close(b, a, rtol=0, atol=tol)


def test_a_refused_step_names_the_layer_of_its_input_order():
    """One launch class whose layers run in another order than given (sorted by p): a NaN gradient
    of the first parameter is named as the first, whatever row the fused middle's check table
    gives it (the table is read as it is only where the orders agree)."""
    params, grads = _problem([(20, 5), (20, 3)])
    opt = fgd_fast.FGD([dict(params=params, names=["wide", "narrow"], orthogonal=True)], lr=0.1, backend="triton")
    for p, g in zip(params, grads):
        p.grad = g.clone()
    params[0].grad[3, 2] = float("nan")
    before = [p.detach().clone() for p in params]
    with pytest.raises(FloatingPointError, match="'wide'") as refused:
        opt.step()
    assert "'narrow'" not in str(refused.value)
    assert all(torch.equal(p.detach(), b) for p, b in zip(params, before))
