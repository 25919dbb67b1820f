"""The summary table and the figure of a ``benchmarks/training/train.py`` run (one concern: showing it).

``python -m benchmarks.training.report OUT/train.json [--png FILE] [--markdown]`` prints the
table again (``--markdown`` as a Markdown table, as in the README) and redraws the figure.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

__all__ = ["summary_lines", "markdown_table", "plot"]


def _ms(s: float | None) -> str:
    if s is None:
        return "—"
    return f"{s * 1e3:.3g} ms" if s < 1 else f"{s:.3g} s"


def _ratio(x: float | None) -> str:
    return "—" if x is None else f"{x:.2f}×"


def _rows(result: dict) -> list[list[str]]:
    rows = []
    for name, r in result["optimizers"].items():
        label = f"{name} ({r['backend']})" if r.get("backend") and name == "fgd" else name
        if "error" in r:
            rows.append([label, "stopped¹"] + ["—"] * (len(HEAD) - 2))
            continue
        if r.get("stopped"):  # (interrupted: what it had measured)
            label += " (interrupted)"
        rows.append(
            [
                label,
                _given(r["test_accuracy"], lambda v: f"{100 * v:.1f} %"),
                _given(r["train_loss"], lambda v: f"{v:.4g}"),
                _given(r["max_distance"], lambda v: f"{v:.1e}"),
                _given(r["mean_distance"], lambda v: f"{v:.1e}"),
                _ms(r["fwd_bwd_seconds"]),
                _ms(r["step_seconds"]),
                _ms(r["train_step_seconds"]),
                _ratio(r.get("train_step_ratio_to_sgd")),
            ]
        )
    return rows


def _given(value, fmt) -> str:
    return "—" if value is None else fmt(value)


HEAD = [
    "optimizer",
    "test acc",
    "train loss",
    "max ‖θᵀθ−I‖",
    "mean ‖θᵀθ−I‖",
    "fwd+bwd",
    "opt step",
    "train step",
    "× sgd",
]


def _title(result: dict) -> str:
    c, d = result["config"], result["device"]
    where = d.get("gpu") or d.get("cpu", "?")
    return (
        f"{c['model']} on {c['dataset']}, {c['epochs']} epoch{'' if c['epochs'] == 1 else 's'} × "
        f"{c['steps_per_epoch']} steps of "
        f"{c['batch_size']}, {where}, autocast {c['amp']}, channels_last {c['channels_last']}"
    )


def summary_lines(result: dict) -> list[str]:
    """A compact fixed-width table: one line per optimizer."""
    rows = [HEAD] + _rows(result)
    widths = [max(len(r[i]) for r in rows) for i in range(len(HEAD))]

    def fmt(row):
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))

    table = [fmt(rows[0]), "  ".join("-" * w for w in widths)] + [fmt(r) for r in rows[1:]]
    return ["", _title(result)] + table + _errors(result)


def _errors(result: dict) -> list[str]:
    failed = [(n, r["error"]) for n, r in result["optimizers"].items() if "error" in r]
    return ["", "¹ stopped with an error:"] + [f"- {n}: {e[:200]}" for n, e in failed] if failed else []


def markdown_table(result: dict) -> list[str]:
    rows = [HEAD, ["---"] * len(HEAD)] + _rows(result)
    return ["| " + " | ".join(r) + " |" for r in rows] + _errors(result)


def plot(result: dict, path: Path) -> Path | None:
    """Loss, test accuracy and max distance against step, and time per step; ``None`` (with a
    line saying why) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        print(f"no plot: matplotlib is not installed ({exc}); pip install 'fgd_fast[examples]'")
        return None
    opts = result["optimizers"]
    fig, ax = plt.subplots(2, 2, figsize=(11, 7.5))
    (a_loss, a_acc), (a_dist, a_time) = ax
    for name, r in opts.items():
        h = r["history"]
        k = max(1, len(h["loss"]) // 60)  # moving average over ~1/60 of the run
        window = [h["loss"][max(0, i - k + 1) : i + 1] for i in range(len(h["loss"]))]
        smooth = [sum(w) / len(w) for w in window]
        a_loss.plot(h["step"], smooth, label=name)
        steps = [e["step"] for e in h["eval"]]
        a_acc.plot(steps, [100 * e["test_accuracy"] for e in h["eval"]], marker=".", label=name)
        a_dist.plot(steps, [max(e["max_distance"], 1e-9) for e in h["eval"]], marker=".", label=name)
    a_loss.set(title="training loss (moving average)", xlabel="step", yscale="log")
    a_acc.set(title="test accuracy (%)", xlabel="step")
    a_dist.set(title="max ‖θᵀθ − I‖_F over the constrained weights", xlabel="step", yscale="log")
    names = [n for n in opts if "error" not in opts[n]]
    fb = [1e3 * opts[n]["fwd_bwd_seconds"] for n in names]
    st = [1e3 * opts[n]["step_seconds"] for n in names]
    a_time.barh(names, fb, label="forward + backward")
    a_time.barh(names, st, left=fb, label="optimizer step")
    a_time.invert_yaxis()
    a_time.set(title="time per training step (ms, median)", xlabel="ms")
    for a in (a_loss, a_acc, a_dist, a_time):
        a.grid(alpha=0.3)
        a.legend(fontsize=8)
    fig.suptitle(_title(result), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("json", help="train.json of benchmarks/training/train.py")
    ap.add_argument("--png", help="redraw the figure into this file")
    ap.add_argument("--markdown", action="store_true", help="print a Markdown table")
    args = ap.parse_args(argv)
    result = json.loads(Path(args.json).read_text(encoding="utf-8"))
    print("\n".join(markdown_table(result) if args.markdown else summary_lines(result)))
    if args.png:
        plot(result, Path(args.png))
    return 0


if __name__ == "__main__":
    sys.exit(main())
