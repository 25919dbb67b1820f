"""What every backend promises, parametrised over every backend (skipped per parameter, with
the reason, where this machine cannot run it): which backend ``"auto"`` and explicit names
resolve to, which precisions each accepts, no host synchronisation with the checks off, and
CUDA graph capture. (Numerics against the oracle: ``test_fgd_oracle.py``; a failed step
changes nothing: ``test_failed_step_contract.py``.)"""

from __future__ import annotations

import pytest
import torch

import fgd_fast
import fgd_fast.backends as registry
from fgd_fast.backends import PRECISIONS, BackendUnavailable, guard_rule, resolve_backend
from helpers import backend_params, captured, device_for_tests, fgd_steps, stiefel_problem

# The selection rule, as the README's backends table states it: (device type, precision) ->
# what "auto" resolves to when Triton loads, and when it does not. On an H200 "torch" was
# measured fastest in IEEE fp32 and Triton's tensor-core step in "tf32x3" and "tf32".
AUTO_RESOLVES_TO = {
    ("cpu", "ieee"): ("torch", "torch"),
    ("cpu", "tf32x3"): ("torch", "torch"),
    ("cpu", "tf32"): ("torch", "torch"),
    ("cuda", "ieee"): ("torch", "torch"),
    ("cuda", "tf32x3"): ("triton", "torch"),
    ("cuda", "tf32"): ("triton", "torch"),
}
# The precisions an explicit backend accepts; the others are refused at construction.
ACCEPTED_PRECISIONS = {
    "auto": {"ieee", "tf32x3", "tf32"},
    "reference": {"ieee"},
    "torch": {"ieee", "tf32x3", "tf32"},
    "triton": {"ieee", "tf32x3", "tf32"},
    "cuda": {"ieee"},
}


@pytest.mark.parametrize("triton_loads", [True, False], ids=["triton-loads", "no-triton"])
@pytest.mark.parametrize("device, precision", sorted(AUTO_RESOLVES_TO))
def test_auto_resolves_as_the_selection_table_states(monkeypatch, device, precision, triton_loads):
    """Resolution needs no GPU: the Triton loader is replaced by one that succeeds or fails."""

    def fake_triton_loader(dev):
        if not triton_loads:
            raise BackendUnavailable("backend='triton' is unavailable: (test) not installed")
        return fake_triton_loader

    monkeypatch.setattr(registry, "_load_triton", fake_triton_loader)
    monkeypatch.setattr(registry, "_tf32_tensor_cores", lambda dev: True)  # (an Ampere, Hopper, … GPU)
    name, prepare = resolve_backend("auto", torch.device(device), precision)
    assert name == AUTO_RESOLVES_TO[device, precision][0 if triton_loads else 1]
    assert (prepare is fake_triton_loader) == (name == "triton")


@pytest.mark.parametrize("gpu", ["sm_75", "sm_80", "rocm"])
def test_auto_picks_the_tensor_core_step_only_where_tf32_tensor_cores_are(monkeypatch, gpu):
    """A review: "auto" took the Triton tensor-core step on any CUDA device, where a GPU older
    than Ampere (a T4, a V100) runs its TF32 products as fp32 FMA, slower than cuBLAS, and a
    ROCm build's Triton refuses a TF32 dot (all but the MI300): the default step failed to
    compile. They get the torch backend; an explicit "triton" on ROCm says why it cannot run."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: {"sm_75": (7, 5)}.get(gpu, (8, 0)))
    monkeypatch.setattr(torch.version, "hip", "6.2.0" if gpu == "rocm" else None)
    want = "triton" if gpu == "sm_80" else "torch"
    for precision in ("tf32x3", "tf32"):
        assert resolve_backend("auto", torch.device("cuda"), precision)[0] == want
    assert resolve_backend("auto", torch.device("cuda"), "ieee")[0] == "torch"
    if gpu == "rocm":
        with pytest.raises(BackendUnavailable, match="ROCm .*use backend='torch'"):
            resolve_backend("triton", torch.device("cuda"), "tf32x3")


def test_auto_is_resolved_per_gpu(monkeypatch):
    """A review: the resolution was cached per device *type*, asking the current GPU: on a machine
    with a T4 as cuda:0 and an H100 as cuda:1, both took the T4's answer (or both the H100's).
    Each GPU is asked now, and each answer kept for it."""
    from fgd_fast import functional

    asked = []
    monkeypatch.setattr(
        torch.cuda,
        "get_device_capability",
        lambda device=None: (asked.append(device), {0: (7, 5), 1: (9, 0)})[1][torch.device(device).index],
    )
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(functional, "_resolved", {})
    assert [functional.backend_for("auto", f"cuda:{k}", "tf32x3") for k in (1, 0, 1)] == ["triton", "torch", "triton"]
    assert [torch.device(d).index for d in asked] == [1, 0]  # (once per GPU)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_auto_on_cpu_tensors_is_the_torch_backend(precision):
    opt = fgd_fast.FGD([torch.nn.Parameter(torch.eye(3))], lr=0.1, precision=precision)
    assert opt.resolved_backend("cpu") == AUTO_RESOLVES_TO["cpu", precision][0] == "torch"


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("name", ["reference", "torch", "triton", "cuda"])
def test_explicit_backend_is_itself_or_fails_with_the_reason(name, device):
    """An explicit name never resolves to another backend: it runs, or it raises
    ``BackendUnavailable`` naming itself and why."""
    try:
        resolved, prepare = resolve_backend(name, torch.device(device))
    except BackendUnavailable as exc:
        assert f"backend={name!r}" in str(exc)
        assert name in ("triton", "cuda")  # reference and torch run anywhere
        return
    assert resolved == name and callable(prepare)


def test_unknown_backend_name_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="'reference', 'torch', 'triton', 'cuda'"):
        resolve_backend("tritonn", torch.device("cpu"))


@pytest.mark.parametrize("precision", [*PRECISIONS, "fp8"])
@pytest.mark.parametrize("backend", sorted(ACCEPTED_PRECISIONS))
def test_precision_the_backend_cannot_honour_is_refused_at_construction(backend, precision):
    """Checked at construction, so it needs no device: nothing silently runs in another precision."""

    def make():
        return fgd_fast.FGD([torch.nn.Parameter(torch.eye(3))], lr=0.1, backend=backend, precision=precision)

    if precision in ACCEPTED_PRECISIONS[backend]:
        assert make().precision == precision
    else:
        with pytest.raises(ValueError, match="precision"):
            make()


@pytest.mark.parametrize("backend", backend_params())
def test_step_without_checks_never_reads_device_values(monkeypatch, backend):
    """With both checks off, step() makes no host synchronisation (capturable): no
    .item()/.tolist()/.cpu()/bool() on a tensor happens inside it, in any backend."""
    shapes = [(8, 4, 3, 3), (20, 6)]
    params, grads = stiefel_problem(shapes)
    opt = fgd_steps(params, grads, backend, steps=2, check_finite=False, check_manifold=False)

    def forbidden(*args, **kwargs):
        raise AssertionError("host synchronisation inside step()")

    for p, g in zip(params, grads):
        p.grad = g.clone()
    # the guard's full-step-first read is a CPU-only shortcut (free there); on CUDA it always blends
    assert "cuda" not in guard_rule.HOST_READ_DEVICES
    monkeypatch.setattr(guard_rule, "HOST_READ_DEVICES", ())
    for name in ("item", "tolist", "__bool__"):
        monkeypatch.setattr(torch.Tensor, name, forbidden)
    if device_for_tests().type == "cuda":
        monkeypatch.setattr(torch.Tensor, "cpu", forbidden)
        torch.cuda.set_sync_debug_mode("error")  # any synchronising CUDA call raises
        try:
            opt.step()
            for p, g in zip(params, grads):  # a new gradient (new addresses) and a new lr
                p.grad = g.clone()
            opt.param_groups[0]["lr"] = 0.05
            opt.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        return
    opt.step()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graph capture needs a CUDA GPU")
@pytest.mark.parametrize("backend", backend_params(("torch", "triton", "cuda")))
def test_step_captured_in_a_cuda_graph_replays_like_eager_steps(backend):
    """With both checks off, step() of the fast backends (the reference is the oracle, not
    promised capturable) can be captured in a CUDA graph (after warm-up steps on a side
    stream, as any capture needs); replays continue exactly like eager steps."""
    params, grads = stiefel_problem([(8, 4, 3, 3), (20, 6), (40, 40)])
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    kw = dict(lr=0.1, backend=backend, check_finite=False, check_manifold=False)
    opt = fgd_fast.FGD([dict(params=params, orthogonal=True)], **kw)
    eager = fgd_fast.FGD([dict(params=twins, orthogonal=True)], **kw)
    for p, t, g in zip(params, twins, grads):
        p.grad, t.grad = g.clone(), g.clone()
    graph = captured(opt.step)  # two warm-up steps: the first creates Φ; the second is the captured form
    for _ in range(2):
        eager.step()
    for _ in range(3):
        graph.replay()
        eager.step()
    torch.cuda.synchronize()
    for p, t in zip(params, twins):
        torch.testing.assert_close(p.detach(), t.detach(), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(
            opt.state[p]["momentum_buffer"], eager.state[t]["momentum_buffer"], rtol=1e-6, atol=1e-6
        )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graph capture needs a CUDA GPU")
def test_a_table_first_built_inside_a_capture_replays_its_own_rows():
    """A fused backend's table built during a CUDA-graph capture (a cache miss there) is copied
    from pinned host memory at every replay: that memory stays the table's, so pinned blocks
    handed out after the capture (here of the same size, with other values) change nothing."""
    from fgd_fast.backends.base import device_table

    rows = list(range(1, 4097))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        table = device_table(rows, torch.int64, torch.device("cuda"))
    torch.cuda.synchronize()
    others = [torch.full((len(rows),), -7, dtype=torch.int64).pin_memory() for _ in range(8)]
    table.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert table.tolist() == rows, f"a replay copied other data ({len(others)} pinned blocks later)"


@pytest.mark.parametrize("backend", backend_params())
def test_a_step_moves_the_version_counters_of_what_it_writes(backend):
    """An ownership review: the CUDA extension (and Triton) write θ and Φ through raw pointers,
    which torch's version counters do not see, so a backward through a graph that saved the old θ
    ran on silently with the stepped one (torch refuses it after any in-place write), and caches
    keyed on versions missed the step. Every backend's step now moves them."""
    params, grads = stiefel_problem([(24, 6), (5, 11)])
    opt = fgd_fast.FGD([dict(params=params, orthogonal=True)], lr=0.1, momentum=0.9, backend=backend)
    x = torch.randn(6, device=params[0].device)
    loss = (params[0] @ (params[0].T @ params[0] @ x)).sum()  # (saves θ for its backward)
    for p, g in zip(params, grads):
        p.grad = g.clone()
    opt.step()  # (the first step makes Φ)
    before = [p._version for p in params] + [opt.state[p]["momentum_buffer"]._version for p in params]
    opt.step()
    after = [p._version for p in params] + [opt.state[p]["momentum_buffer"]._version for p in params]
    assert all(a > b for a, b in zip(after, before)), (before, after)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
