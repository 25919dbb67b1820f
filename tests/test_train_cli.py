"""``benchmarks/training/train.py`` (the end-to-end training comparison) on tiny runs: the CLI writes
``train.json`` with every documented field and ``train.png``; the GPU configuration (synthetic
CIFAR-shaped data, WRN, bf16 autocast, channels_last) runs end to end on a narrow network;
CIFAR-10 is read from the python-pickle batches; bad options fail with the reason."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")  # geoopt's import
FIELDS = (
    "test_accuracy",
    "max_distance",
    "mean_distance",
    "step_seconds",
    "fwd_bwd_seconds",
    "train_step_seconds",
    "train_step_ratio_to_sgd",
    "train_loss",
    "table_builds_per_step",
    "settings",
    "epochs",
    "history",
)


def train_cli(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    """``python -m benchmarks.training ARGS`` as a user runs it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env.update(OMP_WAIT_POLICY="PASSIVE", MPLBACKEND="Agg")
    cmd = [sys.executable, "-m", "benchmarks.training", "--threads", "1", "--out", str(tmp_path), *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return proc


@pytest.fixture(scope="module")
def train_main():
    """``train.main(argv)`` in this process (no interpreter start-up: the runs take a second)."""
    from benchmarks.training import train

    return lambda out, *args: train.main(["--no-progress", "--out", str(out), *args])


def test_digits_run_writes_json_table_and_plot(tmp_path):
    proc = train_cli(
        tmp_path,
        "--dataset",
        "digits",
        "--epochs",
        "2",
        "--steps-per-epoch",
        "6",
        "--optimizers",
        "sgd,fgd,cayley-sgd",
    )
    result = json.loads((tmp_path / "train.json").read_text())
    assert list(result["optimizers"]) == ["sgd", "fgd", "cayley-sgd"]
    for name, r in result["optimizers"].items():
        assert all(k in r for k in FIELDS), (name, sorted(r))
        assert 0.0 <= r["test_accuracy"] <= 1.0 and r["step_seconds"] > 0 and r["fwd_bwd_seconds"] > 0
        assert [e["epoch"] for e in r["epochs"]] == [1, 2] and len(r["history"]["loss"]) == 12
        assert r["history"]["eval"][0]["step"] == 0 and r["history"]["eval"][-1]["step"] == 12
        # the schedule: × 0.2 after 30 %, 60 % and 80 % of the 12 steps
        assert r["final_lrs"][0] == pytest.approx(r["settings"]["lr"] * 0.2**3)
    opts = result["optimizers"]
    # (the torch backend's tables are keyed on the parameters, not the gradients autograd makes anew)
    assert opts["fgd"]["table_builds_per_step"] == 0.0, opts["fgd"]["table_builds_per_step"]
    assert opts["sgd"]["train_step_ratio_to_sgd"] == 1.0 and opts["fgd"]["backend"] == "torch"
    assert opts["fgd"]["max_distance"] < 0.5 and opts["cayley-sgd"]["max_distance"] < 0.1  # constrained ...
    assert opts["sgd"]["max_distance"] > opts["fgd"]["max_distance"]  # ... and sgd drifts away
    assert result["config"]["dataset"] == "digits" and result["config"]["constrained"]
    assert result["versions"]["torch"] == torch.__version__ and result["commit"]["id"]
    assert result["device"]["device"] == "cpu"
    assert (tmp_path / "train.png").stat().st_size > 10_000
    assert "max ‖θᵀθ−I‖" in proc.stdout and "cayley-sgd" in proc.stdout and "× sgd" in proc.stdout
    assert "step 12/12: sgd acc" in proc.stderr  # progress without a terminal: a line per evaluation
    assert opts["fgd"]["guard_steps"] == {"scaled": 0, "reset": 0}  # (layer-steps; ordinary training)


def test_sweep_reports_where_the_guard_bound(tmp_path):
    """``benchmarks.training.sweep``: the grid's report says, per cell, how many layer-steps the
    step guard scaled or reset (at lr 4 it binds; at lr 0.1 it does not)."""
    from benchmarks.training import sweep

    out = tmp_path / "sweep.md"
    assert sweep.main(["--epochs", "1", "--lr", "0.1,4", "--second", "0.4", "--out", str(out)]) == 0
    grid = json.loads(out.with_suffix(".json").read_text())["grid"]
    steps = {g["lr"]: g["guard_steps"] for g in grid}
    assert steps[0.1] == {"scaled": 0, "reset": 0} and steps[4.0]["scaled"] + steps[4.0]["reset"] > 0
    text = out.read_text()
    assert "Layer-steps the step guard scaled / reset" in text
    assert f"| 4 | {steps[4.0]['scaled']} / {steps[4.0]['reset']} |" in text
    # (the command line in the report is the grid that ran, not the default grid)
    assert "`python -m benchmarks.training.sweep --epochs 1 --lr 0.1,4 --second 0.4 --threads 1`" in text


def test_gpu_configuration_rehearsed_on_a_narrow_wrn(tmp_path, train_main):
    """What the GPU session runs (WRN on synthetic CIFAR-shaped data, bf16 autocast,
    channels_last, sgd/fgd/cayley-sgd), with a network narrow enough for a CPU."""
    train_main(
        tmp_path,
        "--dataset",
        "synthetic",
        "--model",
        "wrn",
        "--depth",
        "10",
        "--width",
        "0.5",
        "--batch-size",
        "8",
        "--epochs",
        "1",
        "--steps-per-epoch",
        "3",
        "--optimizers",
        "sgd,fgd,cayley-sgd",
        "--amp",
        "bf16",
        "--channels-last",
        "on",
        "--no-plot",
    )
    result = json.loads((tmp_path / "train.json").read_text())
    cfg = result["config"]
    assert cfg["amp"] == "bf16" and cfg["channels_last"] is True and cfg["model"] == "WRN-10-0.5"
    assert len(cfg["constrained"]) == len(cfg["constrained_shapes"]) > 0
    for r in result["optimizers"].values():
        assert np.isfinite(r["train_loss"]) and len(r["history"]["loss"]) == 3
    assert result["optimizers"]["fgd"]["max_distance"] < 1e-2 and not (tmp_path / "train.png").exists()


def test_cifar10_read_from_the_pickle_batches(tmp_path, train_main):
    root = tmp_path / "data" / "cifar-10-batches-py"
    root.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for name, count in [(f"data_batch_{i}", 4) for i in range(1, 6)] + [("test_batch", 6)]:
        batch = {
            "data": rng.integers(0, 256, (count, 3072), dtype=np.uint8),
            "labels": rng.integers(0, 10, count).tolist(),
        }
        with open(root / name, "wb") as fh:
            pickle.dump(batch, fh)
    train_main(
        tmp_path / "out",
        "--dataset",
        "cifar10",
        "--data-dir",
        str(tmp_path / "data"),
        "--model",
        "resnet",
        "--width",
        "0.125",
        "--batch-size",
        "10",
        "--epochs",
        "1",
        "--optimizers",
        "sgd,fgd",
        "--no-plot",
    )
    result = json.loads((tmp_path / "out" / "train.json").read_text())
    assert result["config"]["steps_per_epoch"] == 2 and "20 train / 6 test" in result["config"]["dataset_description"]


def test_an_interrupted_run_writes_what_it_measured(tmp_path, train_main, monkeypatch, capsys):
    """A review of the GPU session: its time limit stops the training comparison with SIGINT,
    and train.json was written only at the end: the session lost every run. Now an interrupt
    ends the comparison where it is, and train.json holds each run's steps so far."""
    from benchmarks.training import sweep, train

    real, calls = train.Run.step, []

    def step(self, x, y):
        calls.append(self.name)
        if len(calls) == 5:  # (SIGINT: Python raises KeyboardInterrupt in the main thread)
            raise KeyboardInterrupt
        return real(self, x, y)

    monkeypatch.setattr(train.Run, "step", step)
    args = ("--dataset", "digits", "--epochs", "2", "--steps-per-epoch", "4", "--optimizers", "sgd,fgd", "--no-plot")
    rc = train_main(tmp_path, *args)
    result = json.loads((tmp_path / "train.json").read_text())
    assert rc == 130 and all(r["stopped"] for r in result["optimizers"].values())
    assert sorted(len(r["history"]["loss"]) for r in result["optimizers"].values()) == [2, 2]
    assert "(interrupted)" in capsys.readouterr().out
    calls.clear()  # a sweep's grid point is no result when cut short: the interrupt stops the sweep
    with pytest.raises(KeyboardInterrupt):
        sweep.main(["--epochs", "1", "--lr", "0.05", "--second", "0.4", "--out", str(tmp_path / "sweep.md")])


def test_a_failing_optimizer_stops_alone_and_the_run_says_so(tmp_path, train_main, capsys):
    """An lr far too large would take FGD off the manifold: without the step guard its step is
    refused (max_distance), the run records the error, sgd trains on, and the command exits
    with 1. (With the guard, the default, FGD scales such steps and trains on.)"""
    rc = train_main(
        tmp_path,
        "--dataset",
        "digits",
        "--epochs",
        "1",
        "--steps-per-epoch",
        "6",
        "--optimizers",
        "sgd,fgd",
        "--set",
        "fgd.lr=50",
        "--set",
        "fgd.guard=false",
        "--no-plot",
    )
    result = json.loads((tmp_path / "train.json").read_text())
    assert rc == 1 and "max_distance" in result["optimizers"]["fgd"]["error"]
    assert len(result["optimizers"]["sgd"]["history"]["loss"]) == 6 and "error" not in result["optimizers"]["sgd"]
    captured = capsys.readouterr()
    assert "fgd: stopped: ValueError" in captured.err and "stopped¹" in captured.out


@pytest.mark.parametrize(
    "args, message",
    [
        (["--optimizers", "adamw"], "unknown 'adamw'"),
        (["--optimizers", "fgd-cuda"], "needs CUDA tensors"),
        (["--set", "fgd.lr"], "expected OPT.KEY=VALUE"),
        (["--set", "fgd.betas=1"], "fgd has no setting 'betas'"),
        (["--dataset", "cifar10"], "needs --data-dir"),
        (["--set", "fdg.lr=5"], "no optimizer 'fdg' in this run"),
        (["--set", "fgd.lr=abc"], "--set fgd.lr=abc: expected a float"),
        (["--set", "fgd.guard=maybe"], "fgd.guard=maybe: expected true or false"),
        (["--batch-size", "0"], "--batch-size 0: must be at least 1"),
        (["--epochs", "0"], "--epochs 0: must be at least 1"),
        (["--steps-per-epoch", "-3"], "--steps-per-epoch -3: must be at least 1"),
        (["--model", "wrn", "--dataset", "synthetic", "--depth", "27"], "e.g. --depth 28"),
        (["--model", "resnet", "--depth", "20"], "18 or 34"),
        (["--depth", "28"], "the small CNN has a fixed depth"),  # (digits: auto picks the CNN)
        (["--width", "inf"], "at most 1024"),
        (["--gamma", "0"], "--gamma 0"),
        (["--device", "cuda:0"] if not torch.cuda.is_available() else ["--device", "nonsense"], "--device"),
        (["--set", "fgd.lr=-1"], "fgd: invalid lr=-1.0"),  # (the optimizers' own checks, before any training)
        (["--set", "sgd.lr=-1"], "sgd: Invalid learning rate"),
        (["--set", "fgd.feedback=2"], "fgd: invalid feedback"),
        (["--rule", "foo"], "invalid choice: 'foo'"),
        (["--seed", "-1"], "--seed -1: must be at least 0"),
        (["--optimizers", ""], "name at least one"),
        (["--optimizers", "sgd,sgd"], "sgd named twice"),
        (["--optimizers", "fgdtorch"], "unknown 'fgdtorch'"),
    ],
)
def test_bad_options_fail_with_the_reason(tmp_path, train_main, capsys, args, message):
    """One line naming the option, and argparse's exit status 2 for what the command line
    alone decides (a backend the device cannot run, or missing data, are found later: 1)."""
    if "fgd-cuda" in args and torch.cuda.is_available():
        pytest.skip("this machine runs fgd-cuda")
    with pytest.raises(SystemExit) as exc:
        train_main(tmp_path, "--epochs", "1", "--steps-per-epoch", "1", *args)
    err = capsys.readouterr().err
    assert message in str(exc.value.code) + err
    if "fgd-cuda" not in args and "cifar10" not in args:
        assert exc.value.code == 2 and message in err.strip().splitlines()[-1]


def test_a_diverged_run_is_a_failure_and_train_json_stays_strict(tmp_path, train_main):
    """A review: lr 1e8 made sgd's weights NaN while its last loss was finite, and the run was
    reported as a success with NaN in train.json, which strict JSON readers refuse."""
    rc = train_main(
        tmp_path, "--epochs", "1", "--steps-per-epoch", "4", "--optimizers", "sgd", "--set", "sgd.lr=1e8", "--no-plot"
    )
    text = (tmp_path / "train.json").read_text()

    def refuse(name):
        raise ValueError(f"non-standard JSON constant {name}")

    result = json.loads(text, parse_constant=refuse)
    assert rc == 1 and "not finite" in result["optimizers"]["sgd"]["error"]


def test_evals_per_epoch_is_the_number_of_points(tmp_path, train_main):
    """A review: --evals-per-epoch N evaluated N + 1 times an epoch (every steps // N steps and at
    the epoch's end, two points one step apart); now N points, the last at the epoch's end."""
    argv = ["--epochs", "2", "--steps-per-epoch", "7", "--evals-per-epoch", "3", "--optimizers", "sgd", "--no-plot"]
    assert train_main(tmp_path, *argv) == 0
    result = json.loads((tmp_path / "train.json").read_text())
    steps = [e["step"] for e in result["optimizers"]["sgd"]["history"]["eval"]]
    assert steps == [0, 2, 5, 7, 9, 12, 14]
    assert result["config"]["command"].endswith(" ".join(argv))  # (what was run, not this process's argv)


def test_an_unwritable_out_fails_before_the_training(tmp_path, train_main):
    (tmp_path / "afile").write_text("")
    with pytest.raises(SystemExit, match="cannot write there"):
        train_main(tmp_path / "afile", "--epochs", "1", "--steps-per-epoch", "1000", "--optimizers", "sgd")


def test_set_reaches_a_backend_that_all_adds():
    """A review: with --optimizers all, --set fgd-reference.lr was refused ('no optimizer
    fgd-reference in this run') although the run trains it."""
    from benchmarks.training import train

    args = train.parse_args(["--optimizers", "all", "--set", "fgd-reference.lr=0.1", "--no-plot"])
    assert args.set == ["fgd-reference.lr=0.1"]
