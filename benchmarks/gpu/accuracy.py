"""The long accuracy run: max ‖θᵀθ − I‖_F over 2,000 FGD steps per workload and precision.

Usage (repository root; on a GPU after an editable install, or ``--cpu-dry-run`` anywhere)::

    python -m benchmarks.gpu.accuracy OUT.json [--steps 2000] [--every 20] [--budget 150]
                                       [--workloads wrn-28-10 ...] [--cases fgd-reference ...]

Every case runs the benchmark's gradient stream (:func:`measure.gradient_pool`: unit-norm random
gradient sets, step k uses set k mod POOL; ``lr = LR``, momentum 0.9, feedback 0.4) from the
workload's orthonormalised weights, and records ‖θᵀθ − I‖_F in float64 of every constrained
weight every ``--every`` steps and after the last: ``max`` (over layers and checkpoints),
``final`` (max over layers after the last step) and their ratio to the reference form
(``fgd-reference``, term by term in IEEE fp32) of the same workload, the number the precision
policy is judged by (within 1.5× on every workload for a default precision). Cases run in
priority order (every workload's reference and ``fgd-auto`` first) until ``--budget`` seconds
are spent: a case running at the deadline stops at its next checkpoint (``steps`` says how
many ran), the rest are recorded as skipped. Results are written to OUT.json after every case.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
from pathlib import Path

import torch

#: the reference form first (the yardstick), then the fast paths, the candidate default first
CASES = (
    "fgd-reference",
    "fgd-auto",
    "fgd-torch-tf32x3",
    "fgd-triton-tf32x3",
    "fgd-torch",
    "fgd-triton",
    "fgd-torch-tf32",
    "fgd-triton-tf32",
    "fgd-cuda",
)


@torch.no_grad()
def distances(weights: list[torch.Tensor]) -> list[float]:
    """‖θᵀθ − I‖_F in float64 of each weight (θ its ``n × p`` matrix)."""
    from fgd_fast._matrix import stiefel_shape

    out = []
    for w in weights:
        m = w.detach().reshape(w.shape[0], -1).double()
        theta = m.T if stiefel_shape(w.shape).transposed else m
        gram = theta.T @ theta
        gram.diagonal().sub_(1.0)
        out.append(float(torch.linalg.matrix_norm(gram)))
    return out


def run_case(contender, workload, pool, device, steps: int, every: int, deadline: float) -> dict:
    """``steps`` steps of one case (fewer if ``deadline`` passes: ``steps`` says how many ran)."""
    from benchmarks.measure import LR, synchronizer
    from benchmarks.workloads import template_model

    model = copy.deepcopy(template_model(workload, device))
    case = contender.make(model, workload.rule, LR)
    sync = synchronizer(device)
    worst, t0, done = 0.0, time.monotonic(), 0
    while done < steps:
        case.set_grads(pool[done % len(pool)])
        case.step()
        done += 1
        if done % every == 0:
            worst = max(worst, *distances(case.weights()))  # (synchronises: a natural checkpoint)
            if time.monotonic() > deadline:
                break
    sync()
    final = max(distances(case.weights()))
    seconds = time.monotonic() - t0
    ms = round(1e3 * seconds / done, 2)
    return dict(max=max(worst, final), final=final, steps=done, seconds=round(seconds, 1), ms_per_step=ms)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--steps", type=int, help="default 2000 (CPU dry run: 4)")
    ap.add_argument("--every", type=int, default=20, help="measure the distance every this many steps")
    ap.add_argument("--budget", type=float, default=150.0, help="seconds for all cases")
    ap.add_argument("--workloads", nargs="+", help="default: every workload")
    ap.add_argument("--cases", nargs="+", default=list(CASES))
    ap.add_argument(
        "--cpu-dry-run",
        action="store_true",
        help="rehearse on a CPU: tiny shapes, 4 steps, Triton interpreted",
    )
    args = ap.parse_args(argv)
    deadline = time.monotonic() + args.budget
    if args.cpu_dry_run:  # the Triton kernels too, under the interpreter (before fgd_fast is imported)
        os.environ.setdefault("TRITON_INTERPRET", "1")

    from benchmarks.contenders import contender, unavailable
    from benchmarks.machine import environment
    from benchmarks.measure import LR, POOL, gradient_pool
    from benchmarks.plan import stability_skip
    from benchmarks.workloads import weight_shapes, workloads

    device = torch.device("cpu" if args.cpu_dry_run or not torch.cuda.is_available() else "cuda")
    steps = args.steps or (4 if args.cpu_dry_run else 2000)
    every = min(args.every, steps)
    scale = "tiny" if args.cpu_dry_run else "full"
    chosen = [w for w in workloads(scale) if not args.workloads or w.name in args.workloads]
    out: dict = {
        "environment": environment(device),
        "steps": steps,
        "every": every,
        "lr": LR,
        "grad_sets": POOL,
        "scale": scale,
        "results": [],
    }
    path = Path(args.out)

    def record(**entry) -> None:
        out["results"].append(entry)
        path.write_text(json.dumps(out, indent=1, default=str), encoding="utf-8")
        print(json.dumps(entry, default=str), flush=True)

    # priority: every workload's reference and default first, then the other cases
    order = [(w, c) for rank in (0, 1) for w in chosen for c in args.cases if (c in CASES[:2]) == (rank == 0)]
    pools: dict = {}
    ran: set[tuple[str, str]] = set()  # (workload, case) of the cases that ran
    for w, name in order:
        c = contender(name)
        reason = unavailable(c, device, allow_interpreter=args.cpu_dry_run)
        if reason:
            record(workload=w.name, case=name, skipped=reason)
            continue
        twin = (stability_skip(scale, c, device) or {}).get("same_as")  # (fgd-auto's code: fgd-triton-tf32x3
        if (w.name, twin) in ran:  # on a GPU; the same distances, twice the time)
            record(workload=w.name, case=name, skipped=f"the same code as {twin} here", same_as=twin)
            continue
        ran.add((w.name, name))
        if time.monotonic() > deadline:
            record(workload=w.name, case=name, skipped="out of time")
            continue
        if w.name not in pools:
            pools.clear()  # one workload's gradient sets in memory at a time
            pools[w.name] = gradient_pool(weight_shapes(w), device)
        try:
            result = run_case(c, w, pools[w.name], device, steps, every, deadline)
        except Exception as exc:  # a case that fails is a result too
            record(workload=w.name, case=name, error=repr(exc)[:300])
            continue
        refs = [r for r in out["results"] if r["workload"] == w.name and r["case"] == "fgd-reference" and "max" in r]
        ref = refs[0] if refs else None
        if ref is not None and ref["max"] > 0 and ref["steps"] == result["steps"]:  # (a case cut short: no ratio)
            result["max_vs_reference"] = result["max"] / ref["max"]
        record(workload=w.name, case=name, **result)
    out["table"] = table(out["results"])
    path.write_text(json.dumps(out, indent=1, default=str), encoding="utf-8")
    print(out["table"])
    return 0


def table(results: list[dict]) -> str:
    """The markdown table of the report: one row per (workload, case)."""
    lines = [
        "| workload | case | steps | max ‖θᵀθ − I‖_F | final | × reference | ms/step |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if "max" in r:
            ratio = f"{r['max_vs_reference']:.2f}" if "max_vs_reference" in r else "—"
            row = f"{r['steps']} | {r['max']:.3g} | {r['final']:.3g} | {ratio} | {r['ms_per_step']}"
        else:
            row = "— | — | — | — | " + str(r.get("skipped") or r.get("error")).split(" (")[0].split(":")[0][:80]
        lines.append(f"| {r['workload']} | {r['case']} | {row} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
