"""Turn a benchmark run into the markdown report users read.

Usage::

    python -m benchmarks.report RUN.json [-o REPORT.md] [--summary]

``RUN.json`` is the pytest-benchmark JSON of ``python -m pytest benchmarks
--benchmark-json=RUN.json`` (its ``"fgd_bench"`` key holds the machine, the measured rates
and the skipped cases), or the JSON-lines record of ``--bench-record`` (one line per case as
it finished: what survives a run that was cut off). The report has the machine (device, CPU
or GPU name, driver, versions, commit, load), the measured matmul rate and copy bandwidth,
step time with every contender's ratio to ``fgd-auto``, stability after the gradient stream,
and, per workload, the cost model, fractions of the measured rates, peak extra memory and
the skipped cases with their reasons. ``--summary`` prints only the step-time table.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

__all__ = ["load", "render", "summary_table"]

ORDER = (
    "fgd-auto",
    "fgd-triton",
    "fgd-triton-tf32x3",
    "fgd-triton-tf32",
    "fgd-cuda",
    "fgd-torch",
    "fgd-torch-tf32x3",
    "fgd-torch-carried",
    "fgd-torch-tf32",
    "fgd-reference",
    "cayley-sgd-lowrank",
    "cayley-sgd-dense",
    "cayley-adam-lowrank",
    "landing-sgd",
    "geoopt-qr",
    "geoopt-canonical",
    "torch-orthogonal",
    "sgd",
)


def load(path: str | Path) -> dict:
    """``{"session": ..., "cases": [...], "skips": [...], "source": ...}`` from either format."""
    text = Path(path).read_text(encoding="utf-8")
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        data = None
    if isinstance(data, dict) and "benchmarks" in data:
        session = data.get("fgd_bench") or {}
        cases = [{"stats": b.get("stats", {}), **b.get("extra_info", {})} for b in data["benchmarks"]]
        whole = [c for c in cases if "workload" in c and "contender" in c]  # (an interrupted case has no record)
        left = len(cases) - len(whole)
        source = Path(path).name + (f" ({left} unfinished case(s) left out: an interrupted run)" if left else "")
        return {"session": session, "cases": whole, "skips": session.get("skips", []), "source": source}
    session, cases, skips = {}, [], []
    for line in text.splitlines():
        if not line.strip():
            continue
        entry = json.loads(line)
        kind = entry.pop("kind", None)
        if kind == "session":
            session = entry
        elif kind == "skip":
            skips.append(entry)
        elif kind == "case":
            cases.append({"stats": entry.get("stats", {}), **entry.get("extra_info", {})})
    return {"session": session, "cases": cases, "skips": skips, "source": Path(path).name + " (per-case record)"}


# -- formatting ------------------------------------------------------------------------------
def _time(s: float | None) -> str:
    """Seconds in the unit that keeps three significant figures short (the unit chosen after
    rounding: 0.9996 s is "1.00 s", not "1e+03 ms")."""
    if s is None:
        return "—"
    if float(f"{s:.3g}") >= 1.0:
        return f"{s:.2f} s"
    if float(f"{s * 1e3:.3g}") >= 1.0:
        return f"{s * 1e3:.3g} ms"
    return f"{s * 1e6:.3g} µs"


def _sci(x: float | None) -> str:
    return "—" if x is None else f"{x:.1e}"


def _pct(x: float | None) -> str:
    return "—" if x is None else (f"{100 * x:.1f} %" if x >= 0.01 else f"{100 * x:.2g} %")


def _mb(b: float | None) -> str:
    return "—" if b is None else f"{b / 1e6:.3g} MB"


def _load(values) -> str:
    return " / ".join(f"{v:.2f}" for v in values) if values else "?"


def _layers(shapes) -> str:
    counts = Counter(tuple(s) for s in shapes)
    return ", ".join(f"{k} × {n}×{p}" for (n, p), k in sorted(counts.items(), key=lambda kv: kv[0][0] * kv[0][1]))


def _times(x: float | None) -> str:
    return "—" if x is None else f"{x:.2f}×"


def _memory_multiple(case: dict) -> float | None:
    """Peak extra memory of a step over the bytes of the constrained weights."""
    peak, size = case.get("peak_extra_bytes"), case.get("constrained_bytes")
    return peak / size if peak is not None and size else None


def _median(case: dict) -> float | None:
    return case.get("stats", {}).get("median")


def _sorted(names) -> list[str]:
    return sorted(names, key=lambda n: (ORDER.index(n) if n in ORDER else len(ORDER), n))


def _by_workload(run: dict) -> dict[str, dict[str, dict]]:
    out: dict[str, dict[str, dict]] = {}
    for case in run["cases"]:
        out.setdefault(case["workload"], {})[case["contender"]] = case
    return out


def _workload_order(run: dict) -> list[str]:
    names = list(run["session"].get("workloads", {}))
    return names + [w for w in _by_workload(run) if w not in names]


def _label(run: dict, w: str) -> str:
    info = run["session"].get("workloads", {}).get(w)
    if not info:
        return w
    return f"{info['description']} ({info['rule']}, {len(info['shapes'])} layers)"


def _skip_reason(run: dict, w: str, c: str) -> str | None:
    for s in run["skips"]:
        if s["workload"] == w and s["contender"] == c:
            return s["reason"]
    return None


# -- sections --------------------------------------------------------------------------------
def header(run: dict) -> list[str]:
    s = run["session"]
    env, rates = s.get("environment", {}), s.get("rates", {})
    commit = env.get("commit", {})
    states = {True: " (with uncommitted changes)", False: "", None: " (uncommitted changes unknown)"}
    dirty = states[commit.get("dirty")]
    if env.get("device") == "cuda":
        device = (
            f"GPU: {env.get('gpu')} ({env.get('gpu_memory_gib')} GiB, sm {env.get('compute_capability')}); "
            f"host CPU {env.get('cpu')}"
        )
        driver = f"driver {env.get('driver')}, CUDA {env.get('cuda')}"
    else:
        device = (
            f"CPU: {env.get('cpu')} ({env.get('cpu_count')} cores, torch threads {env.get('torch_threads')}, "
            f"OMP_WAIT_POLICY {env.get('omp_wait_policy', '?')})"
        )
        driver = "— (CPU)"
    load = env.get("load_average")
    lines = [
        f"# Optimizer-step benchmark: {env.get('gpu') or env.get('cpu', '?')}",
        "",
        f"Measured {env.get('date_utc', '?')} UTC by `python -m pytest benchmarks` (pytest-benchmark, "
        f"`benchmarks/test_optimizer_step.py`; `benchmarks/run.sh` runs it); this report: "
        f"`benchmarks/report.py {run['source']}`.",
        "",
        "| | |",
        "|---|---|",
        f"| device | {device} |",
        f"| driver | {driver} |",
        f"| versions | torch {env.get('torch')}, triton {env.get('triton')}, geoopt {env.get('geoopt')}, "
        f"numpy {env.get('numpy')}, Python {env.get('python')} |",
        f"| platform | {env.get('platform')}; load average (1/5/15 min) at start {_load(load)}, "
        f"at the end {_load(s.get('load_average_end'))} |",
        f"| commit | `{commit.get('id', '?')}`{dirty}; source digest `{env.get('source_digest', '?')}` |",
        f"| scale | `{s.get('scale')}` (see `benchmarks/workloads.py`) |",
    ]
    if rates:
        lines.append(
            f"| measured rates | fp32 matmul {rates['matmul_flops'] / 1e9:.4g} GFLOP/s ({rates['matmul']}); "
            f"copy {rates['copy_bytes_per_s'] / 1e9:.4g} GB/s ({rates['copy']}) |"
        )
    st = s.get("settings", {})
    if st:
        lines.append(
            f"| settings | lr {st['lr']:g}, momentum {st['momentum']}, FGD feedback {st['feedback']}; "
            f"{st['grad_sets']} seeded gradient sets, {st['grad_norm']}; "
            f"`fgd-auto` resolves to `{st['fgd_auto_resolves_to']}` |"
        )
    return lines


def summary_table(run: dict) -> list[str]:
    """Step time (median) with the ratio to fgd-auto, contenders × workloads."""
    by = _by_workload(run)
    ws = _workload_order(run)
    names = _sorted({c for w in by.values() for c in w} | {s["contender"] for s in run["skips"]})
    lines = [
        "| contender | " + " | ".join(_label(run, w) for w in ws) + " |",
        "|---|" + "---|" * len(ws),
    ]
    for name in names:
        cells = []
        for w in ws:
            case = by.get(w, {}).get(name)
            auto = _median(by.get(w, {}).get("fgd-auto", {}))
            if case and _median(case) is not None:
                t = _median(case)
                ratio = f" ({t / auto:.2f}×)" if auto else ""
                cells.append(f"{_time(t)}{ratio}")
            else:
                cells.append("skipped" if _skip_reason(run, w, name) else "—")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


#: the ratios of the step-time table's medians and the memory multiples: (label, numerator,
#: denominator, what it measures); the cases ran one after another, so these ratios are indicative
#: (the interleaved section that ``benchmarks/run.sh`` appends gives the ratios to quote)
TARGETS = (
    ("`fgd-auto` ÷ `fgd-torch`", "fgd-auto", "fgd-torch", "time"),
    ("`fgd-auto` ÷ `cayley-sgd-lowrank`", "fgd-auto", "cayley-sgd-lowrank", "time"),
    ("`fgd-torch` ÷ `cayley-sgd-lowrank`", "fgd-torch", "cayley-sgd-lowrank", "time"),
    ("`fgd-torch-tf32x3` ÷ `fgd-torch`", "fgd-torch-tf32x3", "fgd-torch", "time"),
    ("`fgd-auto` peak extra memory ÷ θ bytes", "fgd-auto", None, "memory"),
    ("`fgd-torch` peak extra memory ÷ θ bytes", "fgd-torch", None, "memory"),
    ("`fgd-torch-tf32x3` peak extra memory ÷ θ bytes", "fgd-torch-tf32x3", None, "memory"),
)


def targets_table(run: dict) -> list[str]:
    """Step-time ratios (medians of the same run) and peak extra memory per step over the bytes
    of the constrained weights, workload by workload; rows whose contenders did not run are left out."""
    by = _by_workload(run)
    ws = _workload_order(run)
    lines = ["| ratio | " + " | ".join(_label(run, w) for w in ws) + " |", "|---|" + "---|" * len(ws)]
    for label, num, den, kind in TARGETS:
        cells = []
        for w in ws:
            case = by.get(w, {}).get(num, {})
            if kind == "memory":
                cells.append(_times(_memory_multiple(case)))
                continue
            t, d = _median(case), _median(by.get(w, {}).get(den, {}))
            cells.append(f"{t / d:.2f}×" if t and d else "—")
        if any(cell != "—" for cell in cells):
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines


def stability_table(run: dict) -> list[str]:
    by = _by_workload(run)
    ws = _workload_order(run)
    names = _sorted({c for w in by.values() for c in w})
    lines = ["| contender | " + " | ".join(_label(run, w) for w in ws) + " |", "|---|" + "---|" * len(ws)]
    for name in names:
        cells = []
        for w in ws:
            stab = by.get(w, {}).get(name, {}).get("stability")
            if not stab:
                cells.append("—")
            elif "same_as" in stab:
                cells.append(f"= {stab['same_as']}")
            elif "skipped" in stab:
                cells.append("not run¹")
            else:
                cells.append(f"{_sci(stab['max'])} / {_sci(stab['mean'])}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def workload_section(run: dict, w: str) -> list[str]:
    by = _by_workload(run).get(w, {})
    info = run["session"].get("workloads", {}).get(w, {})
    shapes = info.get("shapes", [])
    any_case = next(iter(by.values()), {})
    floor = any_case.get("fgd_floor", {})
    lines = [f"### {w}: {info.get('description', '')}, rule `{info.get('rule', '?')}`", ""]
    if shapes:
        np2 = sum(n * p * p for n, p in shapes)
        np1 = sum(n * p for n, p in shapes)
        lines += [
            f"{len(shapes)} matrices ({_layers(shapes)}); Σn·p² = {np2:.3g}, Σn·p = {np1:.3g}. "
            f"FGD two-pass work: {10 * np2:.3g} flop and {32 * np1 / 1e6:.3g} MB per step; floor at the measured rates "
            f"{_time(floor.get('compute_s'))} (compute) / {_time(floor.get('memory_s'))} (memory).",
            "",
        ]
    auto = _median(by.get("fgd-auto", {}))
    lines += [
        "| contender | median | IQR | rounds | × fgd-auto | × FGD floor | of matmul rate | of copy bandwidth "
        "| peak extra memory | × θ bytes | max / mean ‖θᵀθ − I‖_F | step ‖ΔW‖_F |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name in _sorted(by):
        case = by[name]
        t, stats = _median(case), case.get("stats", {})
        cost, stab = case.get("cost"), case.get("stability", {})
        label = name + (f" (`{case['backend']}`)" if name == "fgd-auto" and case.get("backend") else "")
        if t and cost:
            rate = run["session"].get("rates", {})
            flop_frac = cost["flops"] / t / rate["matmul_flops"] if rate else None
            bw_frac = cost["bytes"] / t / rate["copy_bytes_per_s"] if rate else None
        else:
            flop_frac = bw_frac = None
        if "same_as" in stab:
            dist = f"= {stab['same_as']}"
        elif "skipped" in stab:
            dist = "not run¹"
        else:
            dist = f"{_sci(stab.get('max'))} / {_sci(stab.get('mean'))}" if stab else "—"
        vs_auto = f"{t / auto:.2f}×" if t and auto else "—"
        vs_floor = f"{t / floor['floor_s']:.3g}×" if t and floor.get("floor_s") else "—"
        lines.append(
            f"| {label} | {_time(t)} | {_time(stats.get('iqr'))} | {stats.get('rounds', '—')} | {vs_auto} | "
            f"{vs_floor} | {_pct(flop_frac)} | {_pct(bw_frac)} | {_mb(case.get('peak_extra_bytes'))} | "
            f"{_times(_memory_multiple(case))} | {dist} | "
            f"{_sci(stab.get('step_norm'))} |"
        )
    budget = [(name, by[name]) for name in _sorted(by) if "ops_per_step" in by[name]]
    if budget:
        lines += ["", "| FGD contender | aten ops per step | Triton launches | host time per step |"]
        lines.append("|---|---|---|---|")
        for name, case in budget:
            ops, launches, host = case["ops_per_step"], case.get("launches_per_step", 0), _time(case.get("host_s"))
            lines.append(f"| {name} | {ops} | {launches} | {host} |")
    skipped = [s for s in run["skips"] if s["workload"] == w]
    not_run = [
        (name, by[name]["stability"]["skipped"])
        for name in _sorted(by)
        if "skipped" in by[name].get("stability", {}) and "same_as" not in by[name]["stability"]
    ]
    if skipped or not_run:
        lines.append("")
    for s in skipped:
        lines.append(f"- skipped `{s['contender']}`: {s['reason']}")
    for name, why in not_run:
        lines.append(f"- ¹ stability of `{name}` not run: {why}")
    return lines


def method(run: dict) -> list[str]:
    s = run["session"]
    b, st = s.get("budget", {}), s.get("settings", {})
    memory = next((c.get("memory_method") for c in run["cases"] if c.get("memory_method")), "?")
    return [
        "## How it is measured",
        "",
        "- **Step time**: one optimizer step over the constrained layers only (the other parameters "
        "have no gradient), gradients fixed random tensors of unit Frobenius norm per layer, set once. "
        f"{b.get('warmup', '?')} warm-up steps (then the stability run, where it runs), {b.get('settle', 0)} "
        "untimed steps on the timed gradient for every case, then pytest-benchmark's median over "
        f"{b.get('min_rounds', '?')}–{b.get('max_rounds', '?')} rounds (about {b.get('case_s', '?')} s per case; "
        f"{b.get('slow_rounds', 1)} when a step takes more than {b.get('slow_step_s', '?')} s). On a GPU every round "
        "ends with `torch.cuda.synchronize()`. `torch-orthogonal` rounds include materialising the weights "
        "from the parametrization and back-propagating the gradient through it "
        "(`torch.autograd.backward(W, G)`) before `SGD.step()`.",
        "- **Ratios** (× fgd-auto): medians from the same run, its cases timed one after another (a "
        "drift of the machine's speed between cases enters them; the interleaved section, where the run "
        "has one, measures every contender in each round: the ratios to quote).",
        f"- **Stability**: max / mean over layers of ‖θᵀθ − I‖_F (float64) after {b.get('stability_steps', '?')} "
        f"steps from the same orthonormal start, on the same stream (step k uses gradient set k mod "
        f"{st.get('grad_sets', '?')}); lr {st.get('lr', '?')}, momentum 0.9 for every contender, so a layer "
        "moves about 1e-3 per step (*step ‖ΔW‖_F*: mean over layers in the last step). `sgd` (no "
        "constraint) shows how far unconstrained steps drift.",
        "- **Cost model** (`benchmarks/costmodel.py`): FGD's two-pass form does 10·Σn·p² flop and moves "
        "32·Σn·p bytes per step (the update's own work: the guard's velocity Gram adds up to 3·Σn·p²); "
        "plain SGD with momentum moves 20·Σn·p bytes. *of matmul rate* / *of copy "
        "bandwidth* divide that work by the step time and by the rates measured at the start of this run; "
        "*× FGD floor* is the step time over max(compute floor, memory floor) of FGD's work, for every contender.",
        "- **Host budget** (FGD): the non-view aten ops and Triton launches of one step (each a kernel "
        "launch on a GPU, a few µs of host time) and the median host time of the `step()` call, not "
        "waiting for the device afterwards (a step whose checks read device values waits there).",
        f"- **Peak extra memory**: {memory}; *× θ bytes* divides it by the bytes of the constrained "
        "weights (float32, 4·Σn·p).",
    ] + (
        [
            "- A fraction above 100 % of the copy bandwidth means the step's data fit in the caches "
            "(the copy measured for the rate is far larger than any cache)."
        ]
        if _any_above_copy_rate(run)
        else []
    )


def _any_above_copy_rate(run: dict) -> bool:
    rate = run["session"].get("rates", {}).get("copy_bytes_per_s")
    return bool(rate) and any(
        c.get("cost") and _median(c) and c["cost"]["bytes"] / _median(c) > rate for c in run["cases"]
    )


def same_code_as_auto(run: dict) -> str | None:
    """The contender that runs what ``fgd-auto`` runs: the backend it resolves to at its own
    precision (``fgd-triton-tf32x3`` on a GPU at the default ``"tf32x3"``; ``fgd-triton`` is
    ``"ieee"``, another code), or ``None`` when the record does not say."""
    resolved = run["session"].get("settings", {}).get("fgd_auto_resolves_to")
    auto = next((c for c in run["cases"] if c["contender"] == "fgd-auto"), None)
    if not resolved or auto is None or "precision" not in auto:
        return None
    return f"fgd-{resolved}" if auto["precision"] == "ieee" else f"fgd-{resolved}-{auto['precision']}"


def render(run: dict) -> str:
    ws = _workload_order(run)
    lines = header(run) + ["", "## Step time (median) and ratio to `fgd-auto`", ""] + summary_table(run)
    notes = []
    if run["skips"]:
        notes.append("*skipped*: the reasons are under each workload below.")
    twin = same_code_as_auto(run)
    same = [
        _median(w[twin]) / _median(w["fgd-auto"])
        for w in _by_workload(run).values()
        if twin and _median(w.get("fgd-auto", {})) and _median(w.get(twin, {}))
    ]
    if same:
        notes.append(
            f"`fgd-auto` resolves to `{twin}` here: the two run the same code, so their ratio "
            f"({min(same):.2f}–{max(same):.2f}× in this run, cases run one after another) shows the "
            "noise of this machine between cases."
        )
    for note in notes:
        lines += ["", note]
    lines += ["", "## Ratios and memory", ""]
    lines += [
        "Ratios of the medians above (cases timed one after another, so a drift of the machine's speed "
        "between them enters the ratio: indicative; an interleaved section, where the run has one, gives "
        "the ratios to quote).",
        "",
    ]
    lines += targets_table(run)
    steps = run["session"].get("budget", {}).get("stability_steps", "?")
    lines += ["", f"## Stability: max / mean ‖θᵀθ − I‖_F after {steps} steps", ""] + stability_table(run)
    if any("skipped" in c.get("stability", {}) and "same_as" not in c["stability"] for c in run["cases"]):
        lines += ["", "¹ not run at this scale; the reasons are under each workload below."]
    if any("same_as" in c.get("stability", {}) for c in run["cases"]):
        lines += ["", "= fgd-auto: the backend `fgd-auto` resolves to here, i.e. the same code and the same numbers."]
    lines += ["", "## Per workload", ""]
    for w in ws:
        lines += workload_section(run, w) + [""]
    lines += method(run)
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", help="pytest-benchmark JSON, or the JSON-lines record of --bench-record")
    ap.add_argument("-o", "--output", help="write the markdown here (it is printed either way)")
    ap.add_argument("--summary", action="store_true", help="print only the step-time table")
    args = ap.parse_args(argv)
    run = load(args.run)
    if not run["cases"] and not run["skips"]:
        print(f"report.py: {args.run} holds no benchmark cases", file=sys.stderr)
        return 1
    text = "\n".join(summary_table(run)) + "\n" if args.summary else render(run)
    if args.output:
        Path(args.output).write_text(text, encoding="utf-8")
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
