"""The command lines of the studies (``benchmarks/studies``) and of the training scripts
(``benchmarks/training``): an option that would crash, or run something else than asked, is
refused by argparse (exit 2, with the reason) before any work; the options do what they say.
Tiny settings: each test takes a few seconds."""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")  # geoopt's import


@pytest.fixture(autouse=True)
def _keep_threads():
    """A study sets torch's thread count for the whole process: restore it after each test."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def refused(main, argv: list[str], capsys, *words: str) -> None:
    """``main(argv)`` exits through ``ap.error`` (code 2), naming each of ``words``."""
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    for word in words:
        assert word in err


def test_studies_let_idle_openmp_threads_sleep(monkeypatch):
    """The package sets OMP_WAIT_POLICY=PASSIVE (a user's value stays) before torch is imported."""
    import benchmarks.studies

    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    importlib.reload(benchmarks.studies)
    assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE"
    monkeypatch.delenv("OMP_WAIT_POLICY")
    importlib.reload(benchmarks.studies)
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"
    code = "import sys, benchmarks.studies; print('torch' in sys.modules)"  # (OpenMP reads it once, at load)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


@pytest.mark.parametrize(
    ("study", "argv"),
    [
        ("guard_cost", ["--scale", "tiny", "--rounds", "1"]),
        ("cpu_backends", ["--widths", "0.25", "--repeat", "1", "--backends", "torch"]),
    ],
)
def test_timing_studies_take_a_thread_count_and_report_it(study, argv, capsys):
    main = importlib.import_module(f"benchmarks.studies.{study}").main
    torch.set_num_threads(2)
    main([*argv, "--threads", "1"])
    header = capsys.readouterr().out.splitlines()[0]
    assert torch.get_num_threads() == 1
    assert "| 1 thread |" in header  # (the header is taken after the count is set)
    refused(main, ["--threads", "0"], capsys, "--threads 0", "at least 1")


def test_tf32_middle_refuses_unknown_workloads_and_no_steps(capsys, monkeypatch):
    from benchmarks.studies.tf32_middle import main

    refused(main, ["--workloads", "foo"], capsys, "foo", "wrn-28-10", "transformer")
    refused(main, ["--steps", "0"], capsys, "--steps 0")
    monkeypatch.setattr("benchmarks.workloads.workloads", lambda scale: [])
    assert main(["--steps", "1"]) == 1  # (no row: no pass)


def test_guard_headroom_means_the_losses_it_has(capsys):
    from benchmarks.studies.guard_headroom import main

    refused(main, ["--steps", "0"], capsys, "--steps 0")
    main(["--steps", "1", "--depth", "10", "--width", "0.25", "--batch", "2"])
    out = capsys.readouterr().out
    first, mean = re.search(r"loss: first ([\d.]+), mean of the last 1 ([\d.]+)", out).groups()
    assert first == mean


def test_step_ratio_refuses_what_it_cannot_run(capsys, monkeypatch):
    from benchmarks.studies import step_ratio

    monkeypatch.setattr(step_ratio, "bench_device", lambda: torch.device("cpu"))  # (fgd-torch-tf32 not available)
    tiny = ["--scale", "tiny"]
    refused(step_ratio.main, [*tiny, "--rounds", "0"], capsys, "--rounds 0")
    refused(
        step_ratio.main,
        [*tiny, "--contenders", "fgd-torch", "nope", "--base", "fgd-torch"],
        capsys,
        "unknown nope",
        "cayley-sgd-lowrank",
    )
    refused(
        step_ratio.main,
        [*tiny, "--rounds", "1", "--contenders", "fgd-torch", "fgd-torch-tf32", "--base", "fgd-torch-tf32"],
        capsys,
        "--base fgd-torch-tf32",
        "available contenders: fgd-torch",
    )


def test_op_time_and_middle_share_refuse_out_of_range_settings(capsys):
    from benchmarks.studies import middle_share, op_time

    refused(op_time.main, ["--workload", "7"], capsys, "--workload 7", "0–3")
    refused(middle_share.main, ["--rounds", "0"], capsys, "--rounds 0")


def test_feedback_contraction_has_a_command_line(capsys):
    from benchmarks.studies.feedback_contraction import ALPHAS, main

    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0 and "--alphas" in capsys.readouterr().out
    refused(main, ["--bogus"], capsys, "--bogus")
    refused(main, ["--steps", "0"], capsys, "--steps 0")
    refused(main, ["--alphas", "0.4", "1"], capsys, "--alphas: 1 not in (0, 1)")
    assert main(["--steps", "3", "--alphas", "0.2", "0.4"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 0.")]
    assert [row.split(" | ")[0] for row in rows] == ["| 0.2", "| 0.4"] and rows[1].endswith("| 1 |")
    assert 0.4 in ALPHAS and len(ALPHAS) == 13  # (the defaults: the table as before)


def test_sweep_refuses_a_json_report_path(tmp_path, capsys):
    from benchmarks.training.sweep import main

    out = tmp_path / "r.json"
    argv = ["--epochs", "1", "--lr", "0.1", "--second", "0.4", "--out", str(out)]
    refused(main, argv, capsys, "Markdown report", ".json")
    assert not out.exists()


def test_sweep_checks_the_whole_grid_before_training(tmp_path, capsys):
    from benchmarks.training.sweep import main

    argv = ["--epochs", "1", "--lr", "0.1", "--second", "0.4,1.5", "--out", str(tmp_path / "r.md")]
    refused(main, argv, capsys, "--second (feedback) 1.5", "invalid feedback=1.5")
    assert not list(tmp_path.iterdir())
    argv = ["--optimizer", "landing", "--lr", "0.1", "--second", "-1", "--out", str(tmp_path / "r.md")]
    refused(main, argv, capsys, "--second (attraction) -1", "invalid attraction=-1")


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--lr", ","], ("argument --lr: ','", "at least one number")),
        (["--lr", "0.1,abc"], ("argument --lr: '0.1,abc'", "comma-separated numbers")),
        (["--second", "0.4,nan"], ("argument --second/--feedback: '0.4,nan'", "finite numbers only")),
    ],
)
def test_sweep_refuses_an_empty_or_unreadable_grid(argv, words, tmp_path, capsys):
    """A review: ``--lr ,`` trained the SGD run and wrote an empty report; a word ended in a
    traceback. argparse refuses both before anything runs."""
    from benchmarks.training.sweep import main

    refused(main, [*argv, "--out", str(tmp_path / "r.md")], capsys, *words)
    assert not list(tmp_path.iterdir())


def test_train_refuses_a_device_it_cannot_train_on(capsys):
    from benchmarks.training import train

    refused(train.parse_args, ["--device", "meta"], capsys, "--device meta", "cpu or cuda")


@pytest.mark.parametrize(
    "study, argv, word",
    [
        ("step_ratio", ["--scale", "bogus"], "invalid choice: 'bogus'"),
        ("step_ratio", ["--threads", "0"], "--threads 0"),
        ("guard_cost", ["--backend", "nosuch"], "invalid choice: 'nosuch'"),
        ("cpu_backends", ["--backends", "nosuch"], "invalid choice: 'nosuch'"),
        ("cpu_backends", ["--widths", "4", "0"], "--widths 0: WRN-28-k widths must be positive"),
        ("cpu_backends", ["--widths", "nan"], "--widths nan"),
        ("cpu_host_ops", ["--reps", "0"], "--reps 0"),
        ("gram_carry", ["--refresh", "4", "0"], "--refresh 0"),
        ("gram_fusion", ["--reps", "0"], "--reps 0"),
        ("variant_distance", ["--steps", "0"], "--steps 0"),
        ("gram_shapes", ["--rounds", "0"], "--rounds 0"),
    ],
)
def test_a_studys_meaningless_count_or_unknown_name_is_refused(study, argv, word, capsys):
    """A review: these options ended in a traceback (ValueError, StatisticsError, ZeroDivisionError)
    after the study had started, or ran something else; argparse refuses them first."""
    main = importlib.import_module(f"benchmarks.studies.{study}").main
    refused(main, argv, capsys, word)
