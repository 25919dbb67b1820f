"""Code paths a GPU takes, checked on a CPU where they can be: the step's kernels launch on
the parameters' GPU (not the current one), and hyper-parameters that differ between groups
reach the torch backend's middle without a table built on the host (whose copy to a GPU
synchronises, and fails inside a CUDA-graph capture)."""

from __future__ import annotations

import traceback
from contextlib import nullcontext

import pytest
import torch

import fgd_fast
import fgd_fast.functional
from helpers import stiefel_problem

SHAPES = [(24, 6), (30, 6), (40, 8)]


def _step(opt, params, grads):
    for p, g in zip(params, grads):
        p.grad = g.clone()
    opt.step()


def test_the_step_prepares_and_writes_inside_its_devices_context(monkeypatch):
    """A review: Triton launches on the current CUDA device, so a model on cuda:1 while cuda:0 is
    current had its kernels run on the wrong GPU. The step enters its parameters' device for the
    prepare (Gram pass, middle) and for the writes."""
    seen = []
    monkeypatch.setattr(fgd_fast.functional, "on_device", lambda d: (seen.append(d), nullcontext())[1])
    params, grads = stiefel_problem(SHAPES)
    opt = fgd_fast.FGD([dict(params=params, orthogonal=True)], lr=0.05, backend="torch")
    _step(opt, params, grads)
    assert seen == [torch.device("cpu")] * 2


def test_a_sharded_step_prepares_inside_its_devices_context(monkeypatch):
    """The DTensor layers' prepare (FSDP2's Gram pass and middle) ran in whatever device was
    current; it runs in their device's context too, like the plain layers' (one process, gloo)."""
    import torch.distributed as dist
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    if not dist.is_available() or dist.is_initialized():
        pytest.skip("needs torch.distributed, not already initialised")
    seen = []
    monkeypatch.setattr(fgd_fast.functional, "on_device", lambda d: (seen.append(d), nullcontext())[1])
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        (theta,), (grad,) = stiefel_problem([(12, 5)])
        p = torch.nn.Parameter(distribute_tensor(theta.detach(), mesh, [Shard(0)]))
        p.grad = distribute_tensor(grad, mesh, [Shard(0)])
        fgd_fast.FGD([dict(params=[p], orthogonal=True)], lr=0.05, backend="torch").step()
    finally:
        dist.destroy_process_group()
    assert seen == [torch.device("cpu")] * 2  # (the prepare, then the writes)


def test_on_device_enters_another_gpu_only(monkeypatch):
    from fgd_fast.functional import on_device

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert isinstance(on_device(torch.device("cpu")), nullcontext)
    assert isinstance(on_device(torch.device("cuda", 0)), nullcontext)  # (the current one: nothing to do)
    assert isinstance(on_device(torch.device("cuda")), nullcontext)
    other = on_device(torch.device("cuda", 1))
    assert isinstance(other, torch.cuda.device) and other.idx == 1


def test_groups_with_their_own_hyper_parameters_build_no_host_table(monkeypatch):
    """A review: groups with different lr, momentum or feedback share one middle in the torch
    backend, whose per-layer columns were built by torch.tensor(list, device=...): on a GPU a
    blocking copy, four per step, and an error inside a capture. They are fills now."""
    built = []
    real = torch.tensor

    def watched(*args, **kwargs):
        if traceback.extract_stack()[-2].filename.endswith("torch_groups.py"):
            built.append(args[0] if args else kwargs.get("data"))
        return real(*args, **kwargs)

    params, grads = stiefel_problem(SHAPES)
    twin = [p.detach().clone().requires_grad_() for p in params]
    kw = dict(lr=0.01, momentum=0.5, feedback=0.3, backend="torch")
    first = dict(orthogonal=True, lr=0.1, momentum=0.9)
    opt = fgd_fast.FGD([dict(first, params=params[:2]), dict(params=params[2:], orthogonal=True)], **kw)
    apart = [
        fgd_fast.FGD([dict(first, params=twin[:2])], **kw),
        fgd_fast.FGD([dict(params=twin[2:], orthogonal=True)], **kw),
    ]
    monkeypatch.setattr(torch, "tensor", watched)
    for _ in range(2):
        _step(opt, params, grads)
    monkeypatch.setattr(torch, "tensor", real)
    assert built == []
    for _ in range(2):  # (each group alone: one value per middle, no per-layer column)
        for o in apart:
            _step(o, twin, grads)
    for a, b in zip(params, twin):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-7)


@pytest.mark.parametrize("module, kernel", [("middle", "mid_prep_kernel"), ("blocks", "gram_gather_kernel")])
def test_the_middle_kernels_offset_their_slots_in_64_bits(module, kernel):
    """A review: these kernels address slot k of the blocks at k·numel (numel = Σp², an i32
    argument), computed in 32 bits: past 2³¹ — Σp² ≈ 2.4e8, e.g. 60 square 2,048-wide layers — the
    offsets wrapped negative (silent corruption or a fault, on a GPU only: no CPU test can hold
    such buffers). Each casts numel to int64 before its first use."""
    import importlib
    import inspect

    pytest.importorskip("triton")
    fn = getattr(importlib.import_module(f"fgd_fast.kernels.{module}"), kernel).fn
    body = inspect.getsource(fn).split("):\n", 1)[1]
    first = next(line.strip() for line in body.splitlines() if "numel" in line)
    assert first.startswith("numel = tl.cast(numel, tl.int64)"), first
