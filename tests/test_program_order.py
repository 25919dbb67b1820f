"""No race between the programs of a Triton launch, in whole optimizer steps.

A GPU runs a launch's programs concurrently and in any order; the CPU interpreter runs them one
after another in a fixed order, which hides a race between programs (one reading what another
stores, two storing one element, two sharing a scratch slab). Here whole steps run under the
tools of :mod:`program_order` — with more programs than the interpreter's default and the Gram
pass split over n — for both kernel sets (tensor cores; CUDA cores in float32 and float64),
with and without Φ, the fused and the torch-ops middle, the step guard binding on one layer:

* no program loads or stores memory another program of its launch stores, and none loads what
  it stored itself without a barrier between;
* the programs run in reverse and in shuffled orders give the parameters and momentum buffers
  bit for bit.

Races between the threads of one program (a missing barrier) are for a GPU run to find.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import fgd_fast
from helpers import backend_reason
from program_order import programs_in_order, watch_programs

REASON = backend_reason("triton", "cpu")
pytestmark = [
    pytest.mark.skipif(REASON is not None, reason=f"triton backend unavailable: {REASON}"),
    pytest.mark.skipif(torch.cuda.is_available(), reason="watches the CPU interpreter's programs (CUDA present)"),
]

# both layouts (θ = W2ᵀ for the conv and the wide ones, θ = W2 for the tall one), two p-classes each
SHAPES = [(6, 4, 3, 3), (12, 40), (5, 24), (40, 12), (9, 30)]

CASES = [
    pytest.param(torch.float32, "tf32x3", 0.9, "official", id="tensor-cores-tf32x3-phi"),
    pytest.param(torch.float32, "tf32", 0.0, "official", id="tensor-cores-tf32-no-phi"),
    pytest.param(torch.float32, "ieee", 0.9, "official", id="cuda-cores-float32-phi"),
    pytest.param(torch.float64, "ieee", 0.9, "official", id="cuda-cores-float64-phi"),
    pytest.param(torch.float32, "tf32x3", 0.9, "paper", id="tensor-cores-torch-middle"),
]
# the kernels each case launches with two or more programs (the fused middle: float32, "official")
PASSES = {"tensor": {"tc_split_kernel", "tc_gram_kernel", "tc_update_kernel"}, "cuda": {"gram_kernel", "update_kernel"}}
GUARD = {"gram_gather_kernel", "guard_sums_kernel", "guard_choose_kernel", "guard_blend_kernel"}
FUSED = {"mid_prep_kernel", "mid_jobs_kernel"}


def _expected_kernels(dtype, precision, variant):
    kernels = PASSES["cuda" if precision == "ieee" else "tensor"] | GUARD
    if dtype == torch.float32 and variant == "official":
        return kernels | FUSED
    return kernels | ({"mid_mm_kernel"} if dtype == torch.float32 else set())


@pytest.fixture
def many_programs(monkeypatch):
    from fgd_fast.backends import triton as tb
    from fgd_fast.backends import triton_launch

    monkeypatch.setattr(triton_launch, "force_programs", 5)  # more programs than work items in some launches
    monkeypatch.setattr(tb, "force_splits", 3)  # the Gram pass's partial sums over n


def _steps(dtype, precision, momentum, variant, steps=2):
    """Two steps from fixed orthonormal weights and gradients, the last layer's gradient a spike
    (the guard binds there); returns every parameter and momentum buffer."""
    gen = torch.Generator().manual_seed(3)
    params = [
        torch.nn.Parameter(fgd_fast.orthogonalize_(torch.randn(s, generator=gen, dtype=torch.float64)).to(dtype))
        for s in SHAPES
    ]
    grads = [torch.randn(s, generator=gen, dtype=dtype) * 0.05 for s in SHAPES]
    grads[-1] = grads[-1] * 400.0
    groups = [dict(params=params, orthogonal=True)]
    opt = fgd_fast.FGD(groups, lr=0.1, momentum=momentum, backend="triton", precision=precision, variant=variant)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "the FGD step guard bound")
        for _ in range(steps):
            for p, g in zip(params, grads):
                p.grad = g.clone()
            opt.step()
    assert sum(c["scaled"] + c["reset"] for c in opt.guard_stats().values()) > 0  # the guard's blend ran
    bufs = [opt.state[p].get("momentum_buffer") for p in params]
    return [p.detach().clone() for p in params] + [b for b in bufs if b is not None]


@pytest.mark.parametrize("dtype,precision,momentum,variant", CASES)
def test_no_program_touches_what_another_program_of_its_launch_stores(
    dtype, precision, momentum, variant, many_programs
):
    with watch_programs() as watch:
        _steps(dtype, precision, momentum, variant)
    assert watch.races == []
    assert set(watch.launches) == _expected_kernels(dtype, precision, variant)  # several programs each


@pytest.mark.parametrize("dtype,precision,momentum,variant", CASES)
def test_a_step_is_the_same_bits_whatever_order_the_programs_run_in(dtype, precision, momentum, variant, many_programs):
    base = _steps(dtype, precision, momentum, variant)
    for order, seed in (("reverse", 0), ("shuffle", 1)):
        with programs_in_order(order, seed) as permuted:
            again = _steps(dtype, precision, momentum, variant)
        for k, (a, b) in enumerate(zip(base, again)):
            assert torch.equal(a, b), f"{order}: tensor {k} differs by {(a - b).abs().max().item():.3e}"
        assert set(permuted) == _expected_kernels(dtype, precision, variant)


def _toy_kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def chain(x_ptr):  # program k reads what program k − 1 stores: a race
        k = tl.program_id(0)
        prev = tl.load(x_ptr + k - 1, mask=k > 0, other=0.0)
        tl.store(x_ptr + k, prev + 1.0)

    @triton.jit
    def slab_copy(x_ptr, out_ptr, scratch_ptr, PRIVATE: tl.constexpr):  # out = 2x through a scratch slab
        k = tl.program_id(0)
        r = tl.arange(0, 4)
        slab = scratch_ptr + k * 4 if PRIVATE else scratch_ptr
        tl.store(slab + r, tl.load(x_ptr + k * 4 + r))
        tl.debug_barrier()
        tl.store(out_ptr + k * 4 + r, 2.0 * tl.load(slab + r))

    @triton.jit
    def transpose_through(x_ptr, out_ptr, scratch_ptr, BARRIER: tl.constexpr):  # out = xᵀ through scratch
        r = tl.arange(0, 4)
        tl.store(scratch_ptr + r[:, None] * 4 + r[None, :], tl.load(x_ptr + r[:, None] * 4 + r[None, :]))
        if BARRIER:
            tl.debug_barrier()
        tl.store(out_ptr + r[:, None] * 4 + r[None, :], tl.load(scratch_ptr + r[None, :] * 4 + r[:, None]))

    return chain, slab_copy, transpose_through


def test_the_tools_find_a_race_between_programs_and_nothing_else():
    """A chain (program k reads what k − 1 stores) gives another result in reverse or shuffled
    order, and the watch names it; a scratch slab shared by the programs is a race the order
    cannot show (each program runs whole) and the watch finds; a private slab per program is
    none. Every program runs once, whatever the order."""
    chain, slab_copy, _ = _toy_kernels()
    natural = torch.zeros(8)
    chain[(8,)](natural)
    assert natural.tolist() == [float(k + 1) for k in range(8)]
    for order in ("reverse", "shuffle"):
        with programs_in_order(order, seed=2) as permuted:
            x = torch.zeros(8)
            chain[(8,)](x)
        assert permuted == {"chain": 1}
        assert x.tolist() != natural.tolist(), order
    with watch_programs() as watch:
        chain[(8,)](torch.zeros(8))
    assert [(r.kernel, r.kind) for r in watch.races] == [("chain", "store/load")]

    x = torch.arange(20.0)
    for private in (True, False):
        out, scratch = torch.zeros(20), torch.zeros(20 if private else 4)
        with programs_in_order("reverse"):
            slab_copy[(5,)](x, out, scratch, PRIVATE=private)
        assert torch.equal(out, 2 * x)  # the same result in any order: the order cannot show a shared slab
        with watch_programs() as watch:
            slab_copy[(5,)](x, out, scratch, PRIVATE=private)
        assert sorted(r.kind for r in watch.races) == ([] if private else ["store/load", "store/store"])
        assert watch.launches == {"slab_copy": 1}


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the Inf's arithmetic, and the guard's own warning
@pytest.mark.parametrize("precision", ["tf32x3", "ieee"])
def test_no_race_where_the_guard_resets_a_layer(precision, many_programs):
    """An Inf in one layer's gradient with the checks off: the guard resets that layer (the
    pull-back, Φ₊ = 0) and steps the others, without a race."""
    gen = torch.Generator().manual_seed(4)
    params = [torch.nn.Parameter(fgd_fast.orthogonalize_(torch.randn(s, generator=gen))) for s in SHAPES]
    opt = fgd_fast.FGD(
        [dict(params=params, orthogonal=True)], lr=0.1, backend="triton", precision=precision, check_finite=False
    )
    with watch_programs() as watch:
        for step in range(2):
            for k, p in enumerate(params):
                p.grad = torch.randn(p.shape, generator=gen) * 0.05
                if k == 2 and step == 1:
                    p.grad[0, 0] = float("inf")
            opt.step()
    assert opt.guard_stats()[2] == {"scaled": 0, "reset": 1}
    assert all(torch.isfinite(p).all() for p in params)
    assert watch.races == [] and "guard_blend_kernel" in watch.launches


def test_the_watch_finds_a_program_reading_what_it_stored_without_a_barrier():
    """A program that stores a tile and loads it back transposed (on a GPU, other threads than
    those that stored each entry) needs ``tl.debug_barrier()`` between: without it the watch
    names the launch, with it not."""
    *_, transpose_through = _toy_kernels()
    x = torch.arange(16.0)
    for barrier in (True, False):
        out, scratch = torch.zeros(16), torch.zeros(16)
        with watch_programs() as watch:
            transpose_through[(1,)](x, out, scratch, BARRIER=barrier)
        assert torch.equal(out.view(4, 4), x.view(4, 4).t())  # (the interpreter computes it either way)
        assert [r.kind for r in watch.races] == ([] if barrier else ["own store/load, no barrier"])
