"""One benchmark case, measured (one concern: the measurement protocol).

:func:`gradient_pool` makes the gradients every contender sees; :func:`measure_case` runs the
protocol of :mod:`plan` on a :class:`contenders.Case`:

1. **Gradient stream.** ``POOL`` seeded random gradient sets, one tensor per constrained
   weight, each scaled to unit Frobenius norm; step ``k`` uses set ``k mod POOL``. The same
   seed (hence the same stream) for every contender of a workload. With ``lr = LR`` and
   momentum 0.9 a layer moves by ‖Φ‖ ≈ 1e-3 per step, the training regime in which the
   paper reports ‖θᵀθ − I‖_F of 1e-6 … 1e-5 for FGD.
2. **Warm-up and stability.** The first ``warmup`` steps of the stream warm up (the last one
   is timed: the probe); the stream then continues to ``stability_steps`` steps and
   ``‖θᵀθ − I‖_F`` (float64) of every constrained weight is recorded: max and mean, and
   the mean over layers of ‖ΔW‖_F in the last step (how far a step moves: the contenders
   should be comparable, so the distances are too).
3. **Timing.** The gradient is fixed to set 0; ``settle`` untimed steps on it (every case alike,
   whether its stability run ran or not), then ``benchmark.pedantic`` times one step per round
   (synchronising inside the timed function on a GPU).
4. **Host budget** (FGD only). One step's non-view aten ops and Triton launches
   (:mod:`opcount`) and the median host time of ``HOST_REPEATS`` step calls (:func:`launch_budget`).
5. **Memory.** One more step measures the peak extra memory (:mod:`memtrack`).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

import fgd_fast
from benchmarks.contenders import Case
from benchmarks.memtrack import peak_extra_bytes
from benchmarks.opcount import count_ops
from benchmarks.plan import Budget, rounds_for

__all__ = ["LR", "POOL", "GRAD_SEED", "gradient_pool", "measure_case", "synchronizer"]

LR = 5e-4
POOL = 8
GRAD_SEED = 1234
HOST_REPEATS = 11


def gradient_pool(shapes: list[torch.Size], device: torch.device, sets: int = POOL) -> list[list[torch.Tensor]]:
    """``sets`` lists of random tensors of ``shapes``, each of unit Frobenius norm (seeded)."""
    gen = torch.Generator(device=device).manual_seed(GRAD_SEED)
    pool = []
    for _ in range(sets):
        grads = [torch.randn(s, device=device, generator=gen) for s in shapes]
        pool.append([g.div_(torch.linalg.vector_norm(g)) for g in grads])
    return pool


def synchronizer(device: torch.device) -> Callable[[], None]:
    """Wait for ``device``'s queued work (a no-op on a CPU)."""
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def launch_budget(step: Callable[[], None], sync: Callable[[], None], repeats: int = HOST_REPEATS) -> dict:
    """What one step asks of the host: its non-view aten ops (plus Triton kernel launches) and
    the median host time of the call itself (not waiting for the device afterwards; a step
    whose checks read device values waits there)."""
    import sys

    triton = sys.modules.get("fgd_fast.backends.triton")
    before = sum(triton.launch_counts.values()) if triton is not None else 0
    ops = count_ops(step)
    launches = (sum(triton.launch_counts.values()) - before) if triton is not None else 0
    sync()
    host = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step()
        host.append(time.perf_counter() - t0)
        sync()
    return {"ops_per_step": ops, "launches_per_step": launches, "host_s": statistics.median(host)}


def measure_case(
    benchmark,
    case: Case,
    pool: list[list[torch.Tensor]],
    device: torch.device,
    budget: Budget,
    stability_skip: dict | None = None,
) -> dict:
    """Run the protocol above; returns the extra information (stability, memory, rounds).

    ``stability_skip`` (from :func:`plan.stability_skip`) leaves the stability run out."""
    sync = synchronizer(device)

    def stream_step(k: int) -> None:
        case.set_grads(pool[k % len(pool)])
        case.step()

    probe = 0.0
    for k in range(budget.warmup):
        sync()
        t0 = time.perf_counter()
        stream_step(k)
        sync()
        probe = time.perf_counter() - t0

    info: dict = {"probe_s": probe, "lr": LR, "grad_sets": len(pool)}
    want = budget.stability_steps
    if stability_skip:
        info["stability"] = dict(stability_skip)
    elif want * probe <= budget.stability_s:
        t0 = time.perf_counter()
        for k in range(budget.warmup, want - 1):
            stream_step(k)
        before = [w.clone() for w in case.weights()]
        stream_step(want - 1)
        sync()
        moved = [float(torch.linalg.vector_norm(w.double() - b.double())) for w, b in zip(case.weights(), before)]
        dist = [fgd_fast.stiefel_distance(w) for w in case.weights()]
        info["stability"] = {
            "steps": want,
            "max": max(dist),
            "mean": statistics.fmean(dist),
            "step_norm": statistics.fmean(moved),
            "seconds": time.perf_counter() - t0,
        }
    else:
        info["stability"] = {
            "skipped": f"{want} steps ≈ {want * probe:.0f} s > the {budget.stability_s:g} s budget of this scale"
        }

    case.set_grads(pool[0])
    for _ in range(budget.settle):
        case.step()
    sync()

    def timed() -> None:
        case.step()
        sync()

    rounds = rounds_for(budget, probe)
    benchmark.pedantic(timed, rounds=rounds, warmup_rounds=0, iterations=1)
    info["rounds"] = rounds
    info["settle"] = budget.settle

    if isinstance(case.optimizer, fgd_fast.FGD):
        info.update(launch_budget(case.step, sync))

    peak, method = peak_extra_bytes(case.step, device)
    info["peak_extra_bytes"] = peak
    info["memory_method"] = method
    return info
