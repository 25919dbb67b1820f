"""How an optimizer's lr and its second knob move accuracy and distance from the manifold: a
small grid on scikit-learn's digits, with exactly the set-up of ``benchmarks/training/train.py`` (small
CNN, batch 32, the authors' schedule scaled to the run, Euclidean lr 0.05, momentum 0.9).

    python -m benchmarks.training.sweep [--optimizer fgd] [--epochs 3] [--lr 0.05,0.1,0.2,0.4,0.8] \\
        [--second 0.1,0.2,0.4,0.7] [--out benchmarks/results/NAME.md]

The second knob is FGD's ``feedback`` α, or LandingSGD's ``attraction`` λ (``--optimizer
landing``, default grid 0.5,1,2,4). For each (lr, second) it reports the final test accuracy,
the final max ‖θᵀθ − I‖_F and the peak of that distance during the run (at train.py's evaluation
points: the start and four per epoch on digits), next to an
``sgd`` run of the same length. Writes a Markdown report (and the raw numbers as ``.json``).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import warnings
from pathlib import Path

import torch
from torch import nn

from benchmarks.training import train

#: per optimizer: its second knob and the default grid of it
KNOB = {"fgd": ("feedback", "0.1,0.2,0.4,0.7"), "landing": ("attraction", "0.5,1,2,4")}


def _floats(text: str) -> list[float]:
    """A comma-separated list of finite numbers (for argparse: a bad one is a usage error)."""
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: comma-separated numbers, e.g. 0.1,0.2") from None
    if not values:
        raise argparse.ArgumentTypeError(f"{text!r}: at least one number, comma-separated, e.g. 0.1,0.2")
    if not all(math.isfinite(v) for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: finite numbers only")
    return values


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--lr", type=_floats, default="0.05,0.1,0.2,0.4,0.8", help="Stiefel learning rates")
    ap.add_argument("--optimizer", choices=tuple(KNOB), default="fgd")
    ap.add_argument(
        "--second", "--feedback", dest="second", type=_floats, help="values of the second knob (default per optimizer)"
    )
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="out/sweep-digits.md")
    ap.add_argument("--render", metavar="JSON", help="only print the report of an earlier run's .json")
    args = ap.parse_args(argv)
    if args.render:
        result = json.loads(Path(args.render).read_text(encoding="utf-8"))
        knob = result.get("knob", "feedback")
        lrs = sorted({g["lr"] for g in result["grid"]})
        fbs = sorted({g[knob] for g in result["grid"]})
        print("\n".join(render(result, lrs, fbs)))
        return 0
    if Path(args.out).suffix.lower() == ".json":  # (the report would overwrite the numbers)
        ap.error(
            f"--out {args.out}: the path of the Markdown report (e.g. NAME.md); "
            "the raw numbers go beside it, with the suffix .json"
        )
    try:  # (before the grid trains: a folder that cannot be made failed only after it)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        ap.error(f"--out {args.out}: its folder cannot be made ({exc.strerror})")
    opt_name, knob = args.optimizer, KNOB[args.optimizer][0]
    lrs, fbs = args.lr, args.second or _floats(KNOB[opt_name][1])
    probe = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(4, 2))  # (a throwaway model)
    for lr in lrs:  # every grid point's settings, checked before any training (as train.check_args does)
        for fb in fbs:
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    settings = train.settings_for(opt_name, {opt_name: {"lr": lr, knob: fb}})
                    train.build_optimizer(opt_name, probe, "paper", settings)  # (the sweep runs the default rule)
            except (TypeError, ValueError) as exc:
                ap.error(f"--lr {lr:g}, --second ({knob}) {fb:g}: {exc}")
    t0 = time.perf_counter()
    targs = train.parse_args(
        [
            "--dataset",
            "digits",
            "--epochs",
            str(args.epochs),
            "--threads",
            str(args.threads),
            "--optimizers",
            "sgd",
            "--no-progress",
            "--no-plot",
        ]
    )
    names, settings, data, base, cfg = train.prepare(targs)
    record = train.machine_record(torch.device(targs.device))
    sgd = train.train(["sgd"], base, data, cfg, settings, progress=False)["sgd"]
    grid = []
    for lr in lrs:
        for fb in fbs:
            settings = train.settings_for(opt_name, {opt_name: {"lr": lr, knob: fb}})
            r = train.train([opt_name], base, data, cfg, {opt_name: settings}, progress=False)[opt_name]
            if "error" in r:  # diverged, or left the manifold (FGD's max_distance check)
                grid.append({"lr": lr, knob: fb, "failed": r["error"]})
                continue
            peak = max(e["max_distance"] for e in r["history"]["eval"])
            grid.append(
                {
                    "lr": lr,
                    knob: fb,
                    "test_accuracy": r["test_accuracy"],
                    "max_distance": r["max_distance"],
                    "peak_max_distance": peak,
                    "train_loss": r["train_loss"],
                    **({"guard_steps": r["guard_steps"]} if "guard_steps" in r else {}),
                }
            )
            print(
                f"lr {lr:<5g} {knob} {fb:<4g} acc {100 * r['test_accuracy']:5.1f} %  "
                f"distance {r['max_distance']:.1e} (peak {peak:.1e})",
                flush=True,
            )
    result = {
        "optimizer": opt_name,
        "knob": knob,
        "grid": grid,
        "sgd": {k: sgd[k] for k in ("test_accuracy", "max_distance", "train_loss", "settings")},
        "config": cfg,
        "options": {"epochs": args.epochs, "lr": lrs, "second": fbs, "threads": args.threads},
        **record,
        "seconds": time.perf_counter() - t0,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    text = "\n".join(render(result, lrs, fbs)) + "\n"
    out.write_text(text, encoding="utf-8")
    print(text)
    return 0


def _cell(grid, lr, fb, key, fmt, knob="feedback") -> str:
    for g in grid:
        if g["lr"] == lr and g[knob] == fb:
            return "stopped¹" if "failed" in g else fmt(g[key])
    return "—"


def render(result: dict, lrs: list[float], fbs: list[float]) -> list[str]:
    cfg, dev, sgd = result["config"], result["device"], result["sgd"]
    knob, name = result.get("knob", "feedback"), result.get("optimizer", "fgd")
    title = {"fgd": "FGD", "landing": "LandingSGD"}.get(name, name)
    head = f"| Stiefel lr \\ {knob} | " + " | ".join(f"{f:g}" for f in fbs) + " |"
    rule = "|---" * (len(fbs) + 1) + "|"
    flag = "" if name == "fgd" else f" --optimizer {name}"
    if "options" in result:  # (the grid as run; reports of earlier versions lack it)
        o = result["options"]
        flag += f" --epochs {o['epochs']} --lr {','.join(f'{v:g}' for v in o['lr'])}"
        flag += f" --second {','.join(f'{v:g}' for v in o['second'])} --threads {o['threads']}"
    lines = [
        f"# {title} on digits: test accuracy and distance across lr and {knob}",
        "",
        f"`python -m benchmarks.training.sweep{flag}` ({cfg['model']}, {cfg['epochs']} epochs × "
        f"{cfg['steps_per_epoch']} steps "
        f"of {cfg['batch_size']}, lr × {cfg['gamma']} at steps {cfg['milestones']}, Euclidean lr 0.05, momentum 0.9); "
        f"{dev.get('cpu')}, {cfg['torch_threads']} torch thread(s), load average {dev.get('load_average')}, "
        f"torch {result['versions']['torch']}, commit "
        f"`{result['commit']['id'][:10]}`, {result['seconds']:.0f} s. SGD (lr {sgd['settings']['lr']:g}) on the same "
        f"run: {100 * sgd['test_accuracy']:.1f} %, its constrained-shape weights drift to {sgd['max_distance']:.1f}.",
        "",
        "Test accuracy (%):",
        "",
        head,
        rule,
    ]
    for lr in lrs:
        cells = [_cell(result["grid"], lr, f, "test_accuracy", lambda v: f"{100 * v:.1f}", knob) for f in fbs]
        lines.append(f"| {lr:g} | " + " | ".join(cells) + " |")
    lines += ["", "Max ‖θᵀθ − I‖_F at the end (peak during the run):", "", head, rule]
    for lr in lrs:
        cells = [
            _cell(result["grid"], lr, f, "max_distance", lambda v: f"{v:.1e}", knob)
            + " ("
            + _cell(result["grid"], lr, f, "peak_max_distance", lambda v: f"{v:.0e}", knob)
            + ")"
            for f in fbs
        ]
        lines.append(f"| {lr:g} | " + " | ".join(cells).replace("stopped¹ (stopped¹)", "stopped¹") + " |")
    if any("guard_steps" in g for g in result["grid"]):
        lines += ["", "Layer-steps the step guard scaled / reset (of the run's layers × steps):", "", head, rule]
        for lr in lrs:
            cells = [
                _cell(result["grid"], lr, f, "guard_steps", lambda v: f"{v['scaled']} / {v['reset']}", knob)
                for f in fbs
            ]
            lines.append(f"| {lr:g} | " + " | ".join(cells) + " |")
    failed = [g for g in result["grid"] if "failed" in g]
    if failed:
        lines += ["", "¹ the run stopped with an error:", ""]
        lines += [f"- lr {g['lr']:g}, {knob} {g[knob]:g}: {g['failed'].split(';')[0]})" for g in failed]
    return lines


if __name__ == "__main__":
    sys.exit(main())
