"""Train one network with several optimizers, side by side, and compare what users care about:
test accuracy, time per training step, and how far the constrained weights are from the
Stiefel manifold.

Usage (from the repository root; ``pip install 'fgd_fast[examples]'`` brings scikit-learn,
matplotlib and tqdm)::

    python -m benchmarks.training                                   # digits, sgd/fgd/cayley-sgd/cayley-adam/landing
    python -m benchmarks.training --dataset digits --epochs 3 --out OUT
    python -m benchmarks.training --dataset cifar10 --data-dir DIR --epochs 200   # the paper's run
    python -m benchmarks.training --dataset synthetic --model wrn --depth 28 --width 10 \\
        --optimizers sgd,fgd,cayley-sgd --epochs 2 --steps-per-epoch 50      # GPU timing only
    python -m benchmarks.training --optimizers all --set fgd.lr=0.1 --set fgd.feedback=0.2

Every optimizer starts from the same weights (the constrained ones orthonormalised once) and
sees the same batches: the runs are interleaved, each batch going through every optimizer in
turn, so a shared machine whose load changes during the comparison slows all of them alike.
The learning rates follow the authors' schedule, × ``--gamma`` (0.2) after 30 %, 60 % and 80 %
of the steps (their epochs 60/120/160 of 200), scaled to the run's length; the settings are in
``benchmarks/training/optimizers.py``. Progress: a bar per optimizer on a terminal, else a line
per evaluation (on stderr).

Measured per optimizer: forward + backward time and optimizer-step time (medians over the
steps after the first few; CUDA events on a GPU, ``perf_counter`` on a CPU), the full
training step's ratio to ``sgd``'s (the paper's WRN-28-10 table: FGD 1.24× SGD), training
loss, test accuracy, and max / mean ‖θᵀθ − I‖_F over the constrained layers, at
``--evals-per-epoch`` points per epoch. On a GPU the run uses what users run: bf16 autocast
and channels_last (``--amp``, ``--channels-last``), recorded in the output.

Writes ``OUT/train.json`` (``{"optimizers": {NAME: {"test_accuracy", "max_distance",
"step_seconds", "fwd_bwd_seconds", "train_step_ratio_to_sgd", ..., "history": ...}},
"config", "device", "versions", "commit"}``) and ``OUT/train.png`` (loss, accuracy and
distance against step; time per step), and prints a summary table. ``table_builds_per_step``:
the device tables the backends built per optimizer step after the first few (a steady step
builds none; the Triton backend's metadata holds the gradients' addresses, so gradients
autograd places anew every step would rebuild it every step).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

# before torch loads OpenMP: idle threads sleep instead of spinning, so a shared machine's
# other jobs do not stall the threads of a parallel region (set it to ACTIVE to override)
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
from torch import nn  # noqa: E402

import fgd_fast  # noqa: E402
from benchmarks.machine import environment, version_of  # noqa: E402
from benchmarks.models import cifar_resnet, small_cnn, wide_resnet  # noqa: E402
from benchmarks.training.data import DATASETS, Dataset, load_dataset  # noqa: E402
from benchmarks.training.optimizers import FAMILIES, available_fgd_backends, build_optimizer, family, settings_for  # noqa: E402
from benchmarks.training.report import plot, summary_lines  # noqa: E402
from fgd_fast.backends.base import TableCache  # noqa: E402

DEFAULT_OPTIMIZERS = "sgd,fgd,cayley-sgd,cayley-adam,landing"
MILESTONES = (0.3, 0.6, 0.8)  # the authors' epochs 60, 120, 160 of 200


# -- set-up ----------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dataset", choices=DATASETS, default="digits")
    ap.add_argument("--data-dir", help="cifar10: the folder holding cifar-10-batches-py/")
    ap.add_argument(
        "--model", choices=("auto", "cnn", "wrn", "resnet"), default="auto", help="auto: cnn for digits, wrn otherwise"
    )
    ap.add_argument("--depth", type=int, help="wrn: 28 (default); resnet: 18 (default) or 34")
    ap.add_argument("--width", type=float, help="width multiplier (wrn: k; default 10 on a GPU, 1 on a CPU)")
    ap.add_argument(
        "--rule", choices=("paper", "official", "all"), default="paper", help="which weights are constrained"
    )
    ap.add_argument(
        "--optimizers",
        default=DEFAULT_OPTIMIZERS,
        help=f"comma-separated from {', '.join(FAMILIES)}, fgd-<backend>; 'all' adds every backend the device runs",
    )
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="OPT.KEY=VALUE",
        help="override a setting, e.g. fgd.lr=0.1, fgd.feedback=0.2, sgd.lr=0.05 (repeatable)",
    )
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--steps-per-epoch", type=int, help="cap (or, for synthetic data, set) the steps of an epoch")
    ap.add_argument("--batch-size", type=int, help="default 128 (the authors'); 32 for digits (1,437 images)")
    ap.add_argument("--gamma", type=float, default=0.2, help="lr factor at 30 %%, 60 %% and 80 %% of the steps")
    ap.add_argument(
        "--evals-per-epoch", type=int, help="test accuracy and distance points per epoch (digits: 4, else 1)"
    )
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument(
        "--amp",
        choices=("auto", "bf16", "fp16", "off"),
        default="auto",
        help="autocast (auto: bf16 on a GPU; fp16 adds a GradScaler)",
    )
    ap.add_argument("--channels-last", choices=("auto", "on", "off"), default="auto", help="auto: on on a GPU")
    ap.add_argument("--compile", action="store_true", help="torch.compile the model (the optimizers are unchanged)")
    ap.add_argument(
        "--threads",
        type=int,
        default=_env_threads(ap),
        help="torch CPU threads (default: FGD_BENCH_THREADS, else 1 for digits on a CPU — its "
        "layers are too small to share — and torch's default otherwise)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="out/train", help="folder for train.json and train.png")
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--no-progress", action="store_true", help="no progress bars")
    args = ap.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # (what train.json records as the command)
    check_args(ap, args)
    return args


def _env_threads(ap: argparse.ArgumentParser) -> int | None:
    """``FGD_BENCH_THREADS`` as the default of ``--threads`` (checked like the option)."""
    text = os.environ.get("FGD_BENCH_THREADS", "")
    if not text:
        return None
    try:
        value = int(text)
    except ValueError:
        ap.error(f"FGD_BENCH_THREADS={text!r}: expected a number of threads (at least 1), or unset it")
    if value < 1:
        ap.error(f"FGD_BENCH_THREADS={value}: expected a number of threads (at least 1), or unset it")
    return value


def check_args(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse what would otherwise run something else than asked (``ap.error``: exit 2)."""
    for name in ("epochs", "steps_per_epoch", "batch_size", "evals_per_epoch", "threads"):
        value = getattr(args, name)
        if value is not None and value < 1:
            ap.error(f"--{name.replace('_', '-')} {value}: must be at least 1")
    if args.width is not None and not args.width > 0:
        ap.error(f"--width {args.width}: must be positive")
    if not 0 < args.gamma <= 1:
        ap.error(f"--gamma {args.gamma}: the lr factor at each milestone must be in (0, 1]")
    if args.seed < 0:
        ap.error(f"--seed {args.seed}: must be at least 0")
    if args.width is not None and args.width > 1024:
        ap.error(f"--width {args.width:g}: at most 1024 (WRN-28-10 is --width 10)")
    if args.depth is not None:
        cnn = args.model == "cnn" or (args.model == "auto" and args.dataset == "digits")
        if cnn:
            ap.error(f"--depth {args.depth}: the small CNN has a fixed depth; use --model wrn or resnet to set one")
        if args.model == "resnet" and args.depth not in (18, 34):
            ap.error(f"--depth {args.depth}: a CIFAR ResNet is 18 or 34 layers deep")
        wrn = args.model == "wrn" or (args.model == "auto" and args.dataset != "digits")
        if wrn and (args.depth < 10 or (args.depth - 4) % 6):
            near = max(10, 4 + 6 * round((args.depth - 4) / 6))
            ap.error(f"--depth {args.depth}: a WRN is 6k + 4 layers deep (10, 16, 22, 28, ...); e.g. --depth {near}")
    try:
        device = torch.device(args.device)
    except RuntimeError as exc:
        ap.error(f"--device {args.device!r}: {exc}")
    if device.type not in ("cpu", "cuda"):  # (the run's timers, autocast and distances know these two)
        ap.error(f"--device {args.device}: a run trains on cpu or cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error(
            f"--device {args.device}: this machine has no CUDA device (torch {torch.__version__}); use --device cpu"
        )
    names = [n.strip() for n in args.optimizers.split(",") if n.strip()]
    if names == ["all"]:
        names = optimizer_names("all", device)[0]  # (what the run will train, every backend this device runs)
    for n in names:
        if family(n) not in FAMILIES:
            ap.error(f"--optimizers: unknown {n!r}; choose from {', '.join(FAMILIES)}, fgd-<backend>, or all")
    if not names:
        ap.error(f"--optimizers {args.optimizers!r}: name at least one, from {', '.join(FAMILIES)}")
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        ap.error(f"--optimizers: {', '.join(twice)} named twice (each name is one run)")
    try:
        overrides = parse_overrides(args.set)
    except ValueError as exc:
        ap.error(str(exc))
    for key in overrides:  # a typo in the optimizer's name would change nothing, silently
        if key not in names and key not in {family(n) for n in names}:
            ap.error(f"--set {key}.…: no optimizer {key!r} in this run (it runs {', '.join(names)})")
    probe = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(4, 2))  # (a throwaway model)
    for n in names:
        try:
            settings = settings_for(n, overrides)
            with warnings.catch_warnings():  # (the run itself warns, once)
                warnings.simplefilter("ignore")
                # the optimizer's own checks of the values (a backend's refusal comes at the run, with its reason)
                build_optimizer(family(n), probe, args.rule, settings)
        except (TypeError, ValueError) as exc:
            ap.error(f"{n}: {exc}")


def parse_overrides(items: list[str]) -> dict[str, dict[str, str]]:
    out: dict[str, dict[str, str]] = {}
    for item in items:
        key, sep, value = item.partition("=")
        opt, dot, name = key.rpartition(".")
        if not (sep and dot and opt and name):
            raise ValueError(f"--set {item!r}: expected OPT.KEY=VALUE, e.g. fgd.lr=0.1")
        out.setdefault(opt, {})[name] = value
    return out


def optimizer_names(spec: str, device: torch.device) -> tuple[list[str], dict[str, str]]:
    ok, why = available_fgd_backends(device)
    if spec == "all":
        auto = fgd_fast.functional.backend_for("auto", device)
        names = ["sgd", "fgd"] + [f"fgd-{b}" for b in ok if b != auto] + ["cayley-sgd", "cayley-adam", "landing"]
        return names, {f"fgd-{b}": r for b, r in why.items()}
    names = [n.strip() for n in spec.split(",") if n.strip()]
    for n in names:
        if family(n) not in FAMILIES or (n.startswith("fgd-") and n[4:] not in ok + list(why)):
            raise SystemExit(f"--optimizers: unknown {n!r}; choose from {', '.join(FAMILIES)}, fgd-<backend>, or all")
        if n.startswith("fgd-") and n[4:] in why:
            raise SystemExit(f"--optimizers {n}: {why[n[4:]]}")
    return names, {}


def make_model(args: argparse.Namespace, data: Dataset, device: torch.device) -> tuple[nn.Module, str]:
    kind = args.model if args.model != "auto" else ("cnn" if data.name == "digits" else "wrn")
    if kind == "cnn":
        width = args.width or 1.0
        return small_cnn(data.in_channels, width, data.num_classes), f"small CNN (width {width:g})"
    if data.in_channels != 3:
        raise SystemExit(f"--model {kind} expects 3-channel images; use --model cnn for {data.name}")
    if kind == "wrn":
        depth, width = args.depth or 28, args.width or (10 if device.type == "cuda" else 1)
        return wide_resnet(depth, width, data.num_classes), f"WRN-{depth}-{width:g}"
    depth, width = args.depth or 18, args.width or 1.0
    return cifar_resnet(depth, width, data.num_classes), f"ResNet-{depth} (CIFAR stem, width {width:g})"


# -- one training run ------------------------------------------------------------------------
class StepTimer:
    """Forward+backward and optimizer-step time of every step: CUDA events on a GPU (read once
    per evaluation, so timing adds no host synchronisation), ``perf_counter`` on a CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.pending: list[tuple] = []
        self.fwd_bwd: list[float] = []
        self.step: list[float] = []

    def mark(self):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def add(self, t0, t1, t2) -> None:
        self.pending.append((t0, t1, t2))

    def flush(self) -> None:
        if self.cuda and self.pending:
            self.pending[-1][2].synchronize()
        for t0, t1, t2 in self.pending:
            if self.cuda:
                self.fwd_bwd.append(t0.elapsed_time(t1) / 1e3)
                self.step.append(t1.elapsed_time(t2) / 1e3)
            else:
                self.fwd_bwd.append(t1 - t0)
                self.step.append(t2 - t1)
        self.pending.clear()


def distances(model: nn.Module, names: list[str]) -> list[float]:
    params = dict(model.named_parameters())
    return [fgd_fast.stiefel_distance(params[n].detach()) for n in names]


@torch.no_grad()
def test_accuracy(model: nn.Module, data: Dataset, autocast, memory_format) -> float:
    model.eval()
    correct = 0
    for x, y in data.test_batches(1024, memory_format):
        with autocast():
            correct += (model(x).argmax(1) == y).sum().item()
    model.train()
    return correct / len(data.test_y)


class Run:
    """One optimizer's training: its copy of the model, optimizer, schedule, step timer and
    history. :func:`train` steps all runs on the same batch, one after the other."""

    def __init__(self, name: str, base: nn.Module, data: Dataset, cfg: dict, settings: dict, bar_position: int | None):
        self.name, self.data, self.cfg, self.settings = name, data, cfg, settings
        self.device = torch.device(cfg["device"])
        self.memory_format = torch.channels_last if cfg["channels_last"] else torch.contiguous_format
        self.model = copy.deepcopy(base).to(device=self.device, memory_format=self.memory_format)
        self.opt = build_optimizer(name, self.model, cfg["rule"], settings)
        self.forward = torch.compile(self.model) if cfg.get("compile") else self.model  # same parameters
        total = cfg["epochs"] * cfg["steps_per_epoch"]
        self.sched = torch.optim.lr_scheduler.MultiStepLR(self.opt, cfg["milestones"], cfg["gamma"])
        self.amp = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg["amp"])
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=cfg["amp"] == "fp16")
        self.loss_fn = nn.CrossEntropyLoss()
        self.timer = StepTimer(self.device)
        self.table_builds: list[int] = []  # device tables the backends built in each optimizer step
        self.losses: list[torch.Tensor] = []
        self.epoch_losses: list[float] = []
        self.epochs: list[dict] = []
        self.error: str | None = None
        self.stopped = False  # (interrupted before the comparison ended)
        self.busy = 0.0  # seconds spent in this run's steps and evaluations
        self.hist: dict = {"step": [], "loss": [], "eval": []}
        self._evaluate_at(0)
        self.bar = _bar(name, total, bar_position)

    def autocast(self):
        return torch.autocast(self.device.type, dtype=self.amp or torch.bfloat16, enabled=self.amp is not None)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """One timed training step (forward, backward, optimizer step), then the schedule."""
        w0 = time.perf_counter()
        t0 = self.timer.mark()
        self.opt.zero_grad(set_to_none=True)
        with self.autocast():
            loss = self.loss_fn(self.forward(x), y)
        self.scaler.scale(loss).backward()
        t1 = self.timer.mark()
        builds = TableCache.builds
        self.scaler.step(self.opt)
        self.scaler.update()
        t2 = self.timer.mark()
        self.timer.add(t0, t1, t2)
        self.table_builds.append(TableCache.builds - builds)
        self.sched.step()
        self.losses.append(loss.detach())
        if self.bar is not None:
            self.bar.update(1)
        self.busy += time.perf_counter() - w0

    def _evaluate_at(self, step: int) -> dict:
        d = distances(self.model, self.cfg["constrained"])
        acc = test_accuracy(self.model, self.data, self.autocast, self.memory_format)
        point = {"step": step, "test_accuracy": acc, "max_distance": max(d, default=0.0), "mean_distance": _mean(d)}
        self.hist["eval"].append(point)
        return point

    def evaluate(self, step: int) -> None:
        """Read the step times and losses since the last evaluation, then test accuracy and
        distances (the only host synchronisation the comparison adds)."""
        w0 = time.perf_counter()
        self.timer.flush()
        values = torch.stack(self.losses).float().tolist()
        self.losses.clear()
        self.hist["step"] += list(range(step - len(values) + 1, step + 1))
        self.hist["loss"] += values
        self.epoch_losses += values
        point = self._evaluate_at(step)
        if not all(math.isfinite(v) for v in values):
            raise FloatingPointError(f"the training loss is not finite at step {step}")
        if not math.isfinite(point["max_distance"]):  # (a finite last loss does not mean finite weights)
            raise FloatingPointError(f"the constrained weights are not finite at step {step}: the run diverged")
        if self.bar is not None:
            self.bar.set_postfix_str(
                f"loss {values[-1]:.3f}  acc {100 * point['test_accuracy']:.1f} %  dist {point['max_distance']:.1e}"
            )
        self.busy += time.perf_counter() - w0

    def end_epoch(self, epoch: int, step: int) -> None:
        last = self.hist["eval"][-1]
        self.epochs.append(
            {
                "epoch": epoch,
                "step": step,
                "train_loss": _mean(self.epoch_losses),
                **{k: last[k] for k in ("test_accuracy", "max_distance", "mean_distance")},
            }
        )
        self.epoch_losses = []

    def fail(self, exc: Exception) -> None:
        self.error = f"{type(exc).__name__}: {exc}"
        if self.bar is not None:
            self.bar.set_postfix_str("failed")
            self.bar.close()
        print(f"{self.name}: stopped: {self.error}", file=sys.stderr, flush=True)

    def record(self) -> dict:
        """The per-optimizer entry of train.json."""
        if self.bar is not None and self.error is None:
            self.bar.close()
        out = {"family": family(self.name), "settings": self.settings, "epochs": self.epochs, "history": self.hist}
        if self.stopped:
            out["stopped"] = True
        if isinstance(self.opt, fgd_fast.FGD):
            out["backend"] = self.opt.resolved_backend(self.device)
            stats = self.opt.guard_stats().values()  # layer-steps the guard scaled / reset
            out["guard_steps"] = {k: sum(s[k] for s in stats) for k in ("scaled", "reset")}
        if self.error:
            return {**out, "error": self.error}
        skip = min(5, len(self.timer.step) // 4)  # warm-up steps (allocation, cuDNN autotuning) left out
        if self.cfg.get("compile") and len(self.timer.step) > 1:
            skip = max(skip, 1)  # (the first step compiles the model)
        fwd_bwd, step_s = self.timer.fwd_bwd[skip:], self.timer.step[skip:]
        final = self.hist["eval"][-1] if self.hist["eval"] else {}  # (a run stopped early: what it has)
        loss = self.epochs[-1]["train_loss"] if self.epochs else None
        return {
            **out,
            "test_accuracy": final.get("test_accuracy"),
            "max_distance": final.get("max_distance"),
            "mean_distance": final.get("mean_distance"),
            "train_loss": loss,
            "fwd_bwd_seconds": statistics.median(fwd_bwd) if fwd_bwd else None,
            "step_seconds": statistics.median(step_s) if step_s else None,
            "train_step_seconds": statistics.median(a + b for a, b in zip(fwd_bwd, step_s)) if step_s else None,
            "wall_seconds": self.busy,
            "timed_steps": len(step_s),
            # (a steady step builds none; new gradient addresses each step would show here)
            "table_builds_per_step": statistics.fmean(self.table_builds[skip:]) if self.table_builds[skip:] else 0.0,
            "final_lrs": [g["lr"] for g in self.opt.param_groups],
        }


def train(
    names: list[str],
    base: nn.Module,
    data: Dataset,
    cfg: dict,
    settings: dict[str, dict],
    progress: bool = True,
    partial_on_interrupt: bool = False,
) -> dict[str, dict]:
    """Train every optimizer in ``names`` from ``base`` on the same batches, interleaved: each
    batch goes through every run in turn (the order rotating from step to step), so a machine
    whose load changes during the comparison slows every optimizer alike. A run that raises
    (e.g. FGD refusing a step off the manifold) stops with its error; the others go on. With
    ``partial_on_interrupt`` (the command line's), an interrupt (Ctrl-C, a time limit's SIGINT)
    ends the comparison where it is: every run's record says ``"stopped": true`` and holds what
    it measured so far; otherwise (a sweep's grid point) it propagates."""
    bars = progress and sys.stderr.isatty()  # else (a log, a pipe): one status line per evaluation
    runs = [Run(n, base, data, cfg, settings[n], i if bars else None) for i, n in enumerate(names)]
    gen = torch.Generator().manual_seed(cfg["seed"])
    memory_format = torch.channels_last if cfg["channels_last"] else torch.contiguous_format
    try:
        _train_loop(runs, data, cfg, gen, memory_format, progress and not bars)
    except KeyboardInterrupt:  # (a time limit's SIGINT, the GPU session's: keep what the runs have so far)
        if not partial_on_interrupt:
            raise
        for run in runs:
            run.stopped = True
    return {r.name: r.record() for r in runs}


def _train_loop(runs, data, cfg, gen, memory_format, lines: bool) -> None:
    """:func:`train`'s batches, every run still live (not failed) stepping on each in turn."""
    live = list(runs)
    total = cfg["epochs"] * cfg["steps_per_epoch"]
    steps, evals = cfg["steps_per_epoch"], cfg["evals_per_epoch"]
    points = {round((j + 1) * steps / evals) for j in range(evals)}  # evals_per_epoch points, the last at its end
    step = 0
    for epoch in range(1, cfg["epochs"] + 1):
        for i, (x, y) in enumerate(data.train_batches(cfg["batch_size"], cfg["steps_per_epoch"], gen, memory_format)):
            step += 1
            k = step % max(1, len(live))
            for run in live[k:] + live[:k]:
                try:
                    run.step(x, y)
                    if i + 1 in points:
                        run.evaluate(step)
                except (FloatingPointError, ValueError, RuntimeError) as exc:
                    run.fail(exc)
            live = [r for r in live if r.error is None]
            if lines and i + 1 in points:
                print(
                    f"step {step}/{total}: "
                    + " | ".join(
                        f"{r.name} acc {100 * r.hist['eval'][-1]['test_accuracy']:.1f} % "
                        f"dist {r.hist['eval'][-1]['max_distance']:.1e}"
                        for r in live
                    ),
                    file=sys.stderr,
                    flush=True,
                )
        for run in live:
            run.end_epoch(epoch, step)


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else 0.0


def _bar(name: str, total: int, position: int | None):
    if position is None:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        if position == 0:
            print(f"training {total} steps per optimizer (pip install tqdm for progress bars)", flush=True)
        return None
    return tqdm(total=total, desc=f"{name:<12}", unit="step", position=position, dynamic_ncols=True, leave=True)


# -- the comparison --------------------------------------------------------------------------
def prepare(args: argparse.Namespace) -> tuple[list[str], dict, Dataset, nn.Module, dict]:
    """Optimizer names and settings, the data, the starting model (its constrained weights
    orthonormalised once, so every optimizer starts from the same point) and the run's config."""
    threads = args.threads or (1 if args.dataset == "digits" and args.device == "cpu" else None)
    if threads:
        torch.set_num_threads(threads)
    device = torch.device(args.device)
    torch.backends.cudnn.benchmark = True  # as CIFAR training scripts run (fixed input shapes)
    torch.manual_seed(args.seed)
    names, _ = optimizer_names(args.optimizers, device)
    overrides = parse_overrides(args.set)  # (checked by parse_args)
    try:
        settings = {n: settings_for(n, overrides) for n in names}
    except ValueError as exc:
        raise SystemExit(str(exc)) from exc
    data = load_dataset(
        args.dataset,
        device,
        data_dir=args.data_dir,
        seed=args.seed,
        synthetic_size=(args.steps_per_epoch or 32) * (args.batch_size or 128),
    )
    base, model_desc = make_model(args, data, device)
    groups = fgd_fast.stiefel_param_groups(base, rule=args.rule)  # orthonormalises the chosen weights once
    if not groups[0]["params"]:
        raise SystemExit(f"--rule {args.rule}: selects no weight of {model_desc}")
    batch = args.batch_size or (32 if data.name == "digits" else 128)
    steps = min(data.steps_per_epoch(batch), args.steps_per_epoch or 10**9)
    gpu = device.type == "cuda"
    cfg = {
        "dataset": data.name,
        "dataset_description": data.description,
        "model": model_desc,
        "parameters": sum(p.numel() for p in base.parameters()),
        "rule": args.rule,
        "constrained": groups[0]["names"],
        "constrained_shapes": [list(fgd_fast.stiefel_shape(p.shape)[:2]) for p in groups[0]["params"]],
        "epochs": args.epochs,
        "steps_per_epoch": steps,
        "batch_size": batch,
        "gamma": args.gamma,
        "milestones": [max(1, round(f * args.epochs * steps)) for f in MILESTONES],
        "evals_per_epoch": min(steps, args.evals_per_epoch or (4 if data.name == "digits" else 1)),
        "device": str(device),
        "amp": {"auto": "bf16" if gpu else "off"}.get(args.amp, args.amp),
        "channels_last": {"auto": gpu, "on": True, "off": False}[args.channels_last],
        "torch_threads": torch.get_num_threads(),
        "seed": args.seed,
        "compile": args.compile,
        "command": "python -m benchmarks.training " + " ".join(getattr(args, "argv", sys.argv[1:])),
    }
    return names, settings, data, base, cfg


def machine_record(device: torch.device) -> dict:
    """``{"device", "versions", "commit"}`` of train.json (see ``benchmarks/machine.py``)."""
    env = environment(device)
    versions = {k: env.pop(k) for k in ("python", "torch", "triton", "numpy", "geoopt")}
    versions["fgd_fast"] = fgd_fast.__version__
    for mod in ("sklearn", "matplotlib", "tqdm"):
        versions[mod] = version_of(mod)
    commit = env.pop("commit")
    commit["source_digest"] = env.pop("source_digest")
    return {"device": env, "versions": versions, "commit": commit}


def run(args: argparse.Namespace) -> dict:
    names, settings, data, base, cfg = prepare(args)
    record = machine_record(torch.device(args.device))  # load average at the start ...
    print(
        f"{cfg['model']} on {data.description}; {len(cfg['constrained'])} constrained weights ({args.rule} rule); "
        f"{_count(cfg['epochs'], 'epoch')} × {cfg['steps_per_epoch']} steps of {cfg['batch_size']}; "
        f"device {cfg['device']}, "
        f"autocast {cfg['amp']}, channels_last {cfg['channels_last']}",
        flush=True,
    )
    results = train(names, base, data, cfg, settings, progress=not args.no_progress, partial_on_interrupt=True)
    sgd = results.get("sgd", {}).get("train_step_seconds")
    for r in results.values():
        if "error" not in r:
            r["train_step_ratio_to_sgd"] = r["train_step_seconds"] / sgd if sgd and r["train_step_seconds"] else None
    if hasattr(os, "getloadavg"):
        record["device"]["load_average_end"] = [round(x, 2) for x in os.getloadavg()]  # ... and at the end
    return {"optimizers": results, "config": cfg, **record}


def _count(n: int, what: str) -> str:
    return f"{n} {what}" + ("" if n == 1 else "s")


def finite_json(value):
    """``value`` with every NaN/Inf float as ``None`` (strict JSON has no NaN: a diverged run's
    history would make the file unreadable to other tools)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_json(v) for v in value]
    return value


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    try:  # found before the training, not after it
        out.mkdir(parents=True, exist_ok=True)
        (out / ".write-test").write_text("")
        (out / ".write-test").unlink()
    except OSError as exc:
        raise SystemExit(f"--out {args.out}: cannot write there ({exc})") from None
    result = run(args)
    (out / "train.json").write_text(json.dumps(finite_json(result), indent=1, allow_nan=False) + "\n", encoding="utf-8")
    print("\n".join(summary_lines(result)))
    written = [out / "train.json"]
    if not args.no_plot:
        png = plot(result, out / "train.png")
        if png:
            written.append(png)
    print("wrote " + ", ".join(map(str, written)))
    failed = [n for n, r in result["optimizers"].items() if "error" in r]
    if failed:
        print(f"stopped with an error: {', '.join(failed)}", file=sys.stderr)
    if any(r.get("stopped") for r in result["optimizers"].values()):
        print("interrupted: train.json holds what every run measured until then", file=sys.stderr)
        return 130  # (as a shell reports an interrupted command)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
