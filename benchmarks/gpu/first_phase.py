"""The first minutes of a GPU session: the numbers that decide the defaults, one line at a time.

Usage (repository root, after a pure-Python editable install; or ``--cpu-dry-run`` anywhere)::

    python -m benchmarks.gpu.first_phase OUT.jsonl [--budget 150] [--cases fgd-torch ...]
    python -m benchmarks.gpu.first_phase OUT.jsonl --report      # the Markdown tables of OUT.jsonl

Each case (a contender of :mod:`contenders` on the WRN-28-10 layer set) runs in its own
subprocess, so a crashing kernel (a sticky CUDA error) takes only its own case down, and every
result is appended to ``OUT.jsonl`` as one JSON line (flushed and synced) the moment it exists,
so a run killed at any point keeps everything measured before. In priority order, per case:

- ``agreement``: one step from the same (θ, Φ) as ``fgd-torch`` (IEEE fp32), max |Δθ₊| and
  |ΔΦ₊|, both the first step (Φ = 0) and a second step from a shared non-zero Φ; and each
  one's distance from a float64 step (``vs_f64``), so the error reads against what plain
  fp32 makes on the same data (``fgd-torch``'s own line holds that yardstick);
- ``time``: the step with the default checks (CUDA events, median of ``--reps``), and with the
  checks off (eager; ``host_ms`` is the time ``step()`` takes to return without waiting for the
  GPU, the launch cost);
- ``graph``: the step captured in a CUDA graph (checks off) and replayed (median of events), or
  why it could not be captured;
- ``breakdown``: one profiled step (checks off), GPU time per kind of kernel (split, Gram,
  update, the Triton middle's kernels and guard kernels, cuBLAS products, the rest: the torch
  paths' p × p middle, guard and bookkeeping), the kernel count, the top kernels by time, and
  per part of the step as the FGD backends mark it (``phases``: Gram pass, middle, update) the
  time of the kernels that ran inside it on the GPU timeline and the host time inside it — the
  split the kernel names cannot give where every product is a cuBLAS kernel (the torch backend);
- ``memory`` (measured first): the peak memory the first and a later step allocate above what
  existed before each, and what the first step left allocated (state and the backend's buffers);
- ``distance``: max ‖θᵀθ − I‖_F (float64) over ``--steps`` steps of the benchmark's gradient
  stream (:func:`measure.gradient_pool`, ``lr = measure.LR``), for the cases the precision
  policy is judged by.

A case that crashes or passes its share of the budget leaves an ``exit`` line with its
return code and the tail of its output; the next case starts anyway (``FGD_FIRST_PHASE_ABORT=
<case>`` makes that case abort at its start, to rehearse it; ``tests/test_gpu_session.py``).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent

WORKLOAD = "wrn-28-10"
#: (contender, measurements) in priority order: the yardstick, then the candidate defaults
#: (memory first: the buffers a backend keeps between steps are allocated by that first step)
CASES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("fgd-torch", ("memory", "agreement", "time", "graph", "breakdown", "distance")),
    ("fgd-triton-tf32x3", ("memory", "agreement", "time", "graph", "breakdown", "distance")),
    ("fgd-torch-tf32x3", ("memory", "agreement", "time", "graph", "breakdown", "distance")),
    ("fgd-reference", ("memory", "time", "distance")),  # (the yardstick of the precision default's rule)
    ("fgd-triton-tf32", ("memory", "agreement", "time", "graph", "breakdown")),
    ("fgd-triton", ("memory", "agreement", "time", "graph", "breakdown")),
    ("fgd-torch-tf32", ("memory", "agreement", "time", "graph")),
    ("sgd", ("memory", "time", "graph")),
    ("cayley-sgd-lowrank", ("memory", "time", "graph", "breakdown")),
    ("fgd-cuda", ("memory", "agreement", "time", "graph", "breakdown")),
)
MEASUREMENTS = ("memory", "agreement", "time", "graph", "breakdown", "distance")
#: seconds a case gets at least, where its measurements need more than an even share: the
#: reference form's 1,000-step distance (~37 ms a step on an H200, plus its start) and the
#: tensor-core step's first compile of its kernels (~15 s with a cold Triton cache)
MIN_CASE_S = {"fgd-reference": 60.0, "fgd-triton-tf32x3": 50.0}


class Sink:
    """Appends one JSON line per result to a file, flushed and synced at once."""

    def __init__(self, path: Path, case: str):
        self.path, self.case = path, case

    def __call__(self, what: str, **fields) -> None:
        line = json.dumps({"case": self.case, "what": what, **fields}, default=str)
        with open(self.path, "a", encoding="utf-8") as fh:
            fh.write(line + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        print(line, flush=True)


# --------------------------------------------------------------------------- one case (child)


def _device(cpu: bool):
    import torch

    return torch.device("cuda" if torch.cuda.is_available() and not cpu else "cpu")


def _events_ms(fn, device, reps: int) -> list[float]:
    """Per-call milliseconds of ``fn`` (CUDA events on a GPU, wall clock on a CPU)."""
    import torch

    out = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            out.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            out.append(1e3 * (time.perf_counter() - t0))
    return out


CHECKS = ("check_finite", "check_manifold")  # the host-synchronising checks (FGD both; Cayley, Landing the first)


def _checks_off(case) -> bool:
    """Turn the optimizer's host-synchronising checks off (needed for capture; every contender
    that has one, so the checks-off times compare like with like); False if it has none."""
    opt = case.optimizer
    found = [name for name in CHECKS if hasattr(opt, name)]
    for name in found:
        setattr(opt, name, False)
    return bool(found)


def _kind(name: str) -> str:
    n = name.lower()
    if any(k in n for k in ("mid_prep", "mid_jobs", "mid_mm", "gram_gather")):
        return "middle kernels"  # the Triton middle: the blocks' gather, prologue, products
    if "guard_" in n:
        return "guard kernels"
    if "split" in n:
        return "split"
    if "gram" in n:
        return "gram"
    if "update" in n and ("triton" in n or "kernel" in n or "fgd" in n):
        return "update"
    if any(k in n for k in ("gemm", "cutlass", "xmma", "sm90_", "sm80_", "cublas", "matmul")):
        return "cuBLAS products"
    return "other (middle, guard, bookkeeping)"


def _breakdown(case, device) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    case.step()  # warm
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    with profile(activities=activities) as prof:
        case.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
    wall = 1e3 * (time.perf_counter() - t0)
    kinds, kernels = kernel_times(prof.events(), device.type == "cuda")
    top = sorted(kernels.items(), key=lambda kv: -sum(kv[1]))[:12]
    return dict(
        profiled_wall_ms=round(wall, 3),
        gpu_ms=round(sum(kinds.values()), 4),
        kernels=sum(len(v) for v in kernels.values()),
        kinds_ms={k: round(v, 4) for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])},
        top=[dict(name=k, calls=len(v), ms=round(sum(v), 4)) for k, v in top],
        phases=_phases(prof, device),
    )


def kernel_times(events, cuda: bool) -> tuple[dict[str, float], dict[str, list[float]]]:
    """Milliseconds per kind of kernel and per kernel name, from profiler events: on a GPU the
    kernels (not the ranges' copies on the GPU timeline, which span whole parts of the step), on
    a CPU the aten ops called from Python (not from another aten op)."""
    from torch.autograd import DeviceType

    kinds: dict[str, float] = {}
    kernels: dict[str, list[float]] = {}
    for e in events:
        if cuda and (e.device_type != DeviceType.CUDA or _annotation(e)):
            continue
        if not cuda:
            parent = e.cpu_parent
            if not e.name.startswith("aten::") or (parent is not None and parent.name.startswith("aten::")):
                continue
        ms = (e.device_time if cuda else e.cpu_time) / 1e3
        kinds[_kind(e.name)] = kinds.get(_kind(e.name), 0.0) + ms
        kernels.setdefault(e.name[:90], []).append(ms)
    return kinds, kernels


def _annotation(e) -> bool:
    """A ``record_function`` range, which the profiler also puts on the GPU timeline (its whole
    span, not a kernel: ``Optimizer.step#FGD.step``, the backends' ``fgd::`` parts)."""
    return bool(getattr(e, "is_user_annotation", False)) or e.name.startswith(("fgd::", "Optimizer.", "ProfilerStep"))


def _phases(prof, device) -> dict:
    """The step's parts as the FGD backends mark them (``fgd::gram``, ``fgd::middle``,
    ``fgd::update``: :func:`fgd_fast.backends.base.phase`): per part the host time inside the
    range and, on a GPU, the time of the kernels that ran inside its copy on the GPU timeline
    (``gpu_ms``); empty for a contender that marks none."""
    return phase_times(prof.events(), device.type == "cuda")


def phase_times(events, cuda: bool) -> dict:
    """:func:`_phases` from profiler events. ``gpu_ms`` is attributed by time window: a kernel
    belongs to a part when it starts inside that part's range as the profiler puts it on the GPU
    timeline. The profiler's own link (a range's ``device_time_total``) reaches only kernels
    launched by an aten op inside the range: the Triton backend's kernels, launched directly,
    would count for nothing (kept as ``gpu_ms_linked``, for comparison)."""
    from torch.autograd import DeviceType

    out: dict[str, dict] = {}
    windows: list[tuple[str, float, float]] = []  # (part, start, end) in µs on the GPU timeline
    kernels: list[tuple[float, float]] = []  # (start, duration) in µs
    for e in events:
        if e.device_type == DeviceType.CPU:
            if e.name.startswith("fgd::"):  # the host range
                part = out.setdefault(e.name.removeprefix("fgd::"), dict(host_ms=0.0, gpu_ms=0.0, ranges=0))
                part["host_ms"] += e.cpu_time_total / 1e3
                if cuda:
                    part["gpu_ms_linked"] = part.get("gpu_ms_linked", 0.0) + e.device_time_total / 1e3
                part["ranges"] += 1
        elif cuda and e.device_type == DeviceType.CUDA:
            if e.name.startswith("fgd::"):  # the range's copy on the GPU timeline
                windows.append((e.name.removeprefix("fgd::"), e.time_range.start, e.time_range.end))
            elif not _annotation(e):
                kernels.append((e.time_range.start, e.time_range.end - e.time_range.start))
    for name, start, end in windows:
        part = out.setdefault(name, dict(host_ms=0.0, gpu_ms=0.0, ranges=0))
        part["gpu_ms"] += sum(d for t, d in kernels if start <= t < end) / 1e3
    if cuda and out and not windows:  # (a profiler that puts no ranges on the GPU timeline: say so)
        for part in out.values():
            part["gpu_ms"] = None
    return {
        k: {
            **v,
            "host_ms": round(v["host_ms"], 4),
            "gpu_ms": round(v["gpu_ms"], 4) if cuda and v["gpu_ms"] is not None else None,
            **({"gpu_ms_linked": round(v["gpu_ms_linked"], 4)} if "gpu_ms_linked" in v else {}),
        }
        for k, v in out.items()
    }


def _capture(case, device, reps: int) -> dict:
    import torch

    if device.type != "cuda":
        return dict(skipped="no CUDA device")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            case.step()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        case.step()
    graph.replay()
    torch.cuda.synchronize()
    ms = _events_ms(graph.replay, device, reps)
    return dict(median_ms=round(statistics.median(ms), 4), min_ms=round(min(ms), 4), reps=reps)


def _state_of(case):
    return [case.optimizer.state[p].get("momentum_buffer") for p in case.params]


def _agreement(name: str, workload, pool, device) -> dict:
    """One step of ``name`` and of fgd-torch (IEEE fp32) from the same state; both against float64."""
    import torch

    from benchmarks.contenders import contender
    from benchmarks.measure import LR
    from benchmarks.workloads import template_model

    template = template_model(workload, device)
    cands, refs, f64s = [], [], []
    for c, store in ((name, cands), ("fgd-torch", refs), ("fgd-torch", f64s)):
        model = copy.deepcopy(template)
        if store is f64s:
            model = model.double()
        store.append(contender(c).make(model, workload.rule, LR))
    cand, ref, f64 = cands[0], refs[0], f64s[0]
    out: dict = {}

    def compare(tag: str) -> None:
        ws = [w.double() for w in f64.weights()]
        phis = [p.double() for p in _state_of(f64)]
        row = {}
        for label, case in (("cand", cand), ("ieee", ref)):
            dth = max(float((a.double() - b).abs().max()) for a, b in zip(case.weights(), ws))
            dph = max(float((a.double() - b).abs().max()) for a, b in zip(_state_of(case), phis))
            row[f"{label}_vs_f64_theta"], row[f"{label}_vs_f64_phi"] = dth, dph
        row["theta"] = max(float((a - b).abs().max()) for a, b in zip(cand.weights(), ref.weights()))
        row["phi"] = max(float((a - b).abs().max()) for a, b in zip(_state_of(cand), _state_of(ref)))
        out[tag] = row

    for case in (cand, ref, f64):
        case.set_grads([g.to(case.params[0].dtype) for g in pool[0]])
        case.step()
    compare("step1")
    with torch.no_grad():  # a shared state for step 2: the float64 run's, rounded to each dtype
        for case in (cand, ref):
            for p, q in zip(case.params, f64.params):
                p.copy_(q)
            for s, t in zip(_state_of(case), _state_of(f64)):
                s.copy_(t)
    for case in (cand, ref, f64):
        case.set_grads([g.to(case.params[0].dtype) for g in pool[1]])
        case.step()
    compare("step2")
    return out


def _distance(case, pool, device, steps: int, deadline: float) -> dict:
    from benchmarks.gpu.accuracy import distances

    every = max(1, steps // 20)
    worst, done, t0 = 0.0, 0, time.monotonic()
    while done < steps:
        case.set_grads(pool[done % len(pool)])
        case.step()
        done += 1
        if done % every == 0:
            worst = max(worst, *distances(case.weights()))
            if time.monotonic() > deadline:
                break
    final = max(distances(case.weights()))
    return dict(steps=done, max=max(worst, final), final=final, run_s=round(time.monotonic() - t0, 1))


def run_one(args) -> int:
    import torch

    from benchmarks.contenders import contender, unavailable
    from benchmarks.measure import LR, gradient_pool
    from benchmarks.memtrack import peak_extra_bytes
    from benchmarks.workloads import template_model, weight_shapes, workloads

    if os.environ.get("FGD_FIRST_PHASE_ABORT") == args.one:  # rehearsal: a case that dies like a CUDA fault
        os.abort()
    sink = Sink(Path(args.out), args.one)
    # the driver's deadline counts from before this process started (torch's import included)
    deadline = time.monotonic() + (args.case_deadline - time.time() if args.case_deadline else args.case_budget)
    device = _device(args.cpu_dry_run)
    scale = "tiny" if args.cpu_dry_run else os.environ.get("FGD_BENCH_SCALE", "full")
    workload = next(w for w in workloads(scale) if w.name == WORKLOAD)
    c = contender(args.one)
    why = unavailable(c, device, allow_interpreter=args.cpu_dry_run)
    if why:
        sink("unavailable", reason=why)
        return 0
    pool = gradient_pool(weight_shapes(workload), device)
    wanted = [m for m in dict(CASES).get(args.one, MEASUREMENTS) if m in args.measure]
    reps, steps = (3, 4) if args.cpu_dry_run else (args.reps, args.steps)

    def fresh():
        case = c.make(copy.deepcopy(template_model(workload, device)), workload.rule, LR)
        case.set_grads(pool[0])
        return case

    sync = (lambda: torch.cuda.synchronize()) if device.type == "cuda" else (lambda: None)
    for what in wanted:
        if time.monotonic() > deadline:
            sink("skipped", measurement=what, reason="the case's share of the budget is spent")
            continue
        t0 = time.monotonic()
        try:
            if what == "agreement":
                if c.family != "fgd":
                    continue
                fields = _agreement(args.one, workload, pool, device)
            elif what == "time":
                case = fresh()
                for _ in range(3):
                    case.step()
                sync()
                checked = _events_ms(case.step, device, reps)
                fields = dict(checks_median_ms=round(statistics.median(checked), 4), reps=reps)
                if _checks_off(case):
                    free = _events_ms(case.step, device, reps)
                    fields["median_ms"] = round(statistics.median(free), 4)
                else:
                    fields["median_ms"] = fields["checks_median_ms"]
                host = []
                for _ in range(reps):
                    sync()
                    h0 = time.perf_counter()
                    case.step()
                    host.append(1e3 * (time.perf_counter() - h0))
                sync()
                fields["host_ms"] = round(statistics.median(host), 4)
            elif what == "graph":
                case = fresh()
                fields = dict(checks_off=_checks_off(case))
                fields.update(_capture(case, device, reps))
            elif what == "breakdown":
                case = fresh()
                _checks_off(case)
                case.step()
                fields = _breakdown(case, device)
            elif what == "memory":
                case = fresh()
                sync()
                kept = torch.cuda.memory_allocated(device) if device.type == "cuda" else None
                first_peak, method = peak_extra_bytes(case.step, device)  # (compiles, makes state and caches)
                if kept is not None:
                    kept = torch.cuda.memory_allocated(device) - kept
                peak, method = peak_extra_bytes(case.step, device)
                fields = dict(
                    peak_extra_mib=round(peak / 2**20, 2),
                    first_step_peak_mib=round(first_peak / 2**20, 2),
                    kept_mib=None if kept is None else round(kept / 2**20, 2),  # state + the backend's buffers
                    method=method,
                )
            else:  # distance
                fields = _distance(fresh(), pool, device, steps, deadline)
            sink(what, seconds=round(time.monotonic() - t0, 2), **fields)
        except Exception as exc:  # one measurement failing must not hide the next
            sink("error", measurement=what, error=f"{type(exc).__name__}: {str(exc)[:400]}")
            if device.type == "cuda":
                try:
                    torch.cuda.synchronize()
                except Exception:  # a sticky CUDA error: nothing after it can run in this process
                    sink("aborted", reason="the CUDA context is unusable after the error")
                    return 3
    return 0


# --------------------------------------------------------------------------- the driver


def run_all(args) -> int:
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    device = _device(args.cpu_dry_run)
    try:
        from benchmarks.machine import environment

        env = environment(device)
    except Exception as exc:  # never lose the run to a missing tool
        env = {"error": repr(exc)}
    Sink(out, "-")("environment", budget_s=args.budget, cpu_dry_run=args.cpu_dry_run, **env)
    end = time.monotonic() + args.budget
    cases = [c for c, _ in CASES if c in args.cases]
    for i, name in enumerate(cases):
        left = end - time.monotonic()
        if left < 5:
            Sink(out, name)("skipped", reason=f"{left:.0f} s of the phase's budget left")
            continue
        share = max(args.min_case_s, left / max(1, len(cases) - i) * 2.5)  # a slow case may take 2.5 shares
        if not args.cpu_dry_run:
            share = max(share, MIN_CASE_S.get(name, 0.0))
        share = min(share, left)
        cmd = [sys.executable, "-m", "benchmarks.gpu.first_phase", str(out), "--one", name]
        cmd += ["--case-deadline", f"{time.time() + share - 8:.1f}"]  # (8 s for the last checkpoint and exit)
        cmd += ["--reps", str(args.reps), "--steps", str(args.steps), "--measure", *args.measure]
        if args.cpu_dry_run:
            cmd.append("--cpu-dry-run")
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "FGD_FAST_JIT": os.environ.get("FGD_FAST_JIT", "0")}
        if args.cpu_dry_run:
            env.update(TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
        t0 = time.monotonic()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=share, env=env, cwd=ROOT)
            rc, tail = proc.returncode, (proc.stdout + proc.stderr)[-1500:]
        except subprocess.TimeoutExpired as exc:
            rc, tail = "timeout", ((exc.stdout or b"")[-800:] + (exc.stderr or b"")[-700:]).decode(errors="replace")
        Sink(out, name)("exit", rc=rc, seconds=round(time.monotonic() - t0, 1), tail=tail if rc != 0 else "")
    return 0


# --------------------------------------------------------------------------- the report


def load(path: Path) -> list[dict]:
    """The lines of a first-phase file (a torn last line is skipped)."""
    rows = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            pass
    return rows


def _f(x, digits=3) -> str:
    return "—" if x is None else f"{x:.{digits}g}"


def report(rows: list[dict]) -> str:
    """Markdown tables of a first-phase file: agreement, times, breakdown, distance, memory."""
    by: dict[tuple[str, str], dict] = {}
    for r in rows:
        by[(r["case"], r["what"])] = r
    env = by.get(("-", "environment"), {})
    cases = list(dict.fromkeys(r["case"] for r in rows if r["case"] != "-"))
    lines = [
        f"## First phase ({WORKLOAD}, `benchmarks/gpu/first_phase.py`)",
        "",
        f"- device: {env.get('gpu') or env.get('cpu', '?')}; torch {env.get('torch', '?')}, "
        f"triton {env.get('triton', '?')}",
        "",
        "### Step time (ms; median of CUDA events on a GPU, of the wall clock on a CPU)",
        "",
        "| case | checks on | checks off | host (launch) | CUDA graph | GPU time (profiled) | kernels |",
        "|---|---|---|---|---|---|---|",
    ]
    for c in cases:
        t, g, b = by.get((c, "time"), {}), by.get((c, "graph"), {}), by.get((c, "breakdown"), {})
        if not (t or g or b):
            continue
        graph = _f(g.get("median_ms")) if "median_ms" in g else (g.get("skipped") or "—")
        err = by.get((c, "error"))
        if err and err.get("measurement") == "graph":
            graph = "not capturable: " + err["error"][:60]
        lines.append(
            f"| {c} | {_f(t.get('checks_median_ms'))} | {_f(t.get('median_ms'))} | {_f(t.get('host_ms'))} "
            f"| {graph} | {_f(b.get('gpu_ms'))} | {b.get('kernels', '—')} |"
        )
    lines += [
        "",
        "### One-step agreement (max |Δ| against fgd-torch in IEEE fp32; and against a float64 step)",
        "",
        "| case | step | θ₊ vs ieee | Φ₊ vs ieee | θ₊ vs f64 | ieee θ₊ vs f64 | Φ₊ vs f64 | ieee Φ₊ vs f64 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for c in cases:
        a = by.get((c, "agreement"))
        for step in ("step1", "step2") if a else ():
            s = a[step]
            lines.append(
                f"| {c} | {step[-1]} | {_f(s['theta'])} | {_f(s['phi'])} | {_f(s['cand_vs_f64_theta'])} "
                f"| {_f(s['ieee_vs_f64_theta'])} | {_f(s['cand_vs_f64_phi'])} | {_f(s['ieee_vs_f64_phi'])} |"
            )
    lines += ["", "### Breakdown of one step (GPU ms per kind of kernel)", ""]
    for c in cases:
        b = by.get((c, "breakdown"))
        if b:
            kinds = ", ".join(f"{k} {v:.3g}" for k, v in b["kinds_ms"].items())
            lines.append(f"- **{c}**: {kinds} (total {b['gpu_ms']:.3g} ms in {b['kernels']} kernels)")
            parts = b.get("phases") or {}
            if parts:  # the backend's own ranges: device time launched and host time inside each
                cells = ", ".join(
                    f"{k} {v['gpu_ms']:.3g} ms (host {v['host_ms']:.3g} ms)"
                    if v.get("gpu_ms") is not None
                    else f"{k}: host {v['host_ms']:.3g} ms"
                    for k, v in parts.items()
                )
                lines.append(f"  - by part of the step: {cells}")
    lines += [
        "",
        "### Distance and memory",
        "",
        "Memory (MiB): *peak extra* is what a step allocates above what existed before it, from the "
        "second step on; *first step* the same for the first step (state and the backend's buffers "
        "made); *kept* what the first step left allocated (momentum state and buffers kept between steps).",
        "",
        "| case | steps | max ‖θᵀθ − I‖_F | final | peak extra | first step | kept |",
        "|---|---|---|---|---|---|---|",
    ]
    for c in cases:
        d, m = by.get((c, "distance"), {}), by.get((c, "memory"), {})
        if d or m:
            lines.append(
                f"| {c} | {d.get('steps', '—')} | {_f(d.get('max'))} | {_f(d.get('final'))} "
                f"| {_f(m.get('peak_extra_mib'), 4)} | {_f(m.get('first_step_peak_mib'), 4)} "
                f"| {_f(m.get('kept_mib'), 4)} |"
            )
    problems = [r for r in rows if r["what"] in ("error", "aborted", "unavailable", "skipped")]
    problems += [r for r in rows if r["what"] == "exit" and r.get("rc") != 0]
    if problems:
        lines += ["", "### Not measured", ""]
        for r in problems:
            why = r.get("error") or r.get("reason") or f"exit {r.get('rc')}: {r.get('tail', '')[-200:]}"
            lines.append(f"- {r['case']} {r.get('measurement', r['what'])}: {why}".replace("\n", " "))
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", help="the JSON-lines file results are appended to")
    ap.add_argument("--budget", type=float, default=150.0, help="seconds for all cases (default 150)")
    ap.add_argument("--cases", nargs="+", default=[c for c, _ in CASES], choices=[c for c, _ in CASES])
    ap.add_argument("--measure", nargs="+", default=list(MEASUREMENTS), choices=MEASUREMENTS)
    ap.add_argument("--reps", type=int, default=30, help="timed steps per time measurement")
    ap.add_argument("--steps", type=int, default=1000, help="steps of the distance run")
    ap.add_argument("--min-case-s", type=float, default=25.0)
    ap.add_argument("--cpu-dry-run", action="store_true", help="rehearse on a CPU: tiny shapes, Triton interpreted")
    ap.add_argument("--report", action="store_true", help="print the Markdown tables of OUT and exit")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--case-budget", type=float, default=60.0, help=argparse.SUPPRESS)
    ap.add_argument("--case-deadline", type=float, help=argparse.SUPPRESS)  # (epoch seconds; beats --case-budget)
    args = ap.parse_args(argv)
    if args.report:
        print(report(load(Path(args.out))))
        return 0
    if args.one:
        return run_one(args)
    return run_all(args)


if __name__ == "__main__":
    sys.exit(main())
