"""Rehearsal of the GPU session on the CPU: results survive a crash and a kill.

A lent GPU machine returns only what its command left in ``$OUT``, and a call past its limit
is killed. So the session (``benchmarks/gpu/gpu_check.py``, ``benchmarks/gpu/first_phase.py``)
must write every result into the output folder as soon as it exists, and a case that dies
(a sticky CUDA error aborts its process) must not stop the next. These tests run the CPU dry
run (tiny shapes) and check both.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FIRST = ["-m", "benchmarks.gpu.first_phase"]  # run from the repository root (cwd=ROOT)
CHECK = ["-m", "benchmarks.gpu.gpu_check"]
ENV = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_a_case_that_aborts_does_not_stop_the_next(tmp_path):
    out = tmp_path / "first.jsonl"
    cmd = [sys.executable, *FIRST, str(out), "--cpu-dry-run", "--cases", "fgd-torch", "sgd"]
    cmd += ["--measure", "time", "memory", "--min-case-s", "5", "--budget", "120"]
    env = {**ENV, "FGD_FIRST_PHASE_ABORT": "fgd-torch"}
    subprocess.run(cmd, env=env, check=True, timeout=180, capture_output=True, cwd=ROOT)
    rows = lines(out)
    by = {(r["case"], r["what"]): r for r in rows}
    assert by[("fgd-torch", "exit")]["rc"] == -signal.SIGABRT  # the crash is recorded ...
    assert ("fgd-torch", "time") not in by
    assert by[("sgd", "time")]["median_ms"] > 0  # ... and the next case measured
    assert by[("sgd", "exit")]["rc"] == 0
    assert (
        "fgd-torch exit"
        in subprocess.run(
            [sys.executable, *FIRST, str(out), "--report"],
            env=ENV,
            capture_output=True,
            text=True,
            check=True,
            cwd=ROOT,
        ).stdout
    )  # the report names what was not measured


def test_a_run_killed_mid_phase_keeps_every_earlier_result(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    cmd = [sys.executable, *CHECK, str(out), "--work", str(work), "--cpu-dry-run", "--no-install"]
    cmd += ["--phases", "install", "first", "tests", "--first-cases", "sgd", "--budget", "200"]
    cmd += ["--tests", "tests/test_bad_input.py"]  # long enough to be killed in
    proc = subprocess.Popen(
        cmd, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True, cwd=ROOT
    )
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:  # wait for the first phase to end, then kill in the tests phase
            try:
                phases = json.loads((out / "gpu_check.json").read_text(encoding="utf-8"))["phases"]
            except (OSError, ValueError, KeyError):
                phases = {}
            if "first" in phases:
                break
            assert proc.poll() is None, "gpu_check ended before it could be killed"
            time.sleep(0.2)
        else:
            pytest.fail("the first phase never ended")
        time.sleep(1.0)
        assert proc.poll() is None, "gpu_check ended before it could be killed"
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    files = {p.name for p in out.iterdir()}
    assert {"first.jsonl", "gpu_check.json", "report.md", "logs.tgz"} <= files
    assert len(files) <= 8  # what a device call returns at most
    by = {(r["case"], r["what"]): r for r in lines(out / "first.jsonl")}
    assert by[("sgd", "time")]["median_ms"] > 0 and by[("sgd", "exit")]["rc"] == 0
    assert "First phase" in (out / "report.md").read_text(encoding="utf-8")
    assert json.loads((out / "gpu_check.json").read_text(encoding="utf-8"))["phases"]["first"]["ok"]


def test_sigterm_stops_the_phase_and_keeps_the_results(tmp_path):
    """The session's outer ``timeout`` sends SIGTERM: gpu_check kills the running phase's
    process group (it would otherwise outlive the call and compete with a rerun for the GPU)
    and publishes what it has."""
    out, work = tmp_path / "out", tmp_path / "work"
    cmd = [sys.executable, *CHECK, str(out), "--work", str(work), "--cpu-dry-run", "--no-install"]
    cmd += ["--phases", "install", "tests", "--budget", "200", "--tests", "tests/test_bad_input.py"]
    proc = subprocess.Popen(cmd, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT)
    try:
        deadline = time.monotonic() + 120
        while not (work / "tests.log").exists() and time.monotonic() < deadline:  # the tests phase has begun
            assert proc.poll() is None, "gpu_check ended before the tests phase"
            time.sleep(0.2)
        time.sleep(2.0)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 128 + signal.SIGTERM
    finally:
        proc.kill()
    assert json.loads((out / "gpu_check.json").read_text(encoding="utf-8"))["terminated"] == f"signal {signal.SIGTERM}"
    time.sleep(1.0)
    left = subprocess.run(["pgrep", "-f", str(work)], capture_output=True, text=True).stdout.split()
    assert not left, f"the phase's processes outlived gpu_check: {left}"


def test_a_rerun_clears_only_its_own_work_folder(tmp_path):
    """A rerun on a warm machine must not report the last run's logs; a folder gpu_check did
    not make is never cleared."""
    out, work, other = tmp_path / "out", tmp_path / "work", tmp_path / "mine"
    base = [sys.executable, *CHECK, str(out), "--cpu-dry-run", "--no-install", "--phases", "install"]
    subprocess.run([*base, "--work", str(work)], env=ENV, check=True, timeout=120, capture_output=True, cwd=ROOT)
    (work / "tests-junit.xml").write_text("<stale/>")
    subprocess.run([*base, "--work", str(work)], env=ENV, check=True, timeout=120, capture_output=True, cwd=ROOT)
    assert not (work / "tests-junit.xml").exists()
    other.mkdir()
    (other / "keep.txt").write_text("a user's file")
    subprocess.run([*base, "--work", str(other)], env=ENV, check=True, timeout=120, capture_output=True, cwd=ROOT)
    assert (other / "keep.txt").read_text() == "a user's file"


def test_the_breakdown_splits_the_torch_step_into_its_parts(tmp_path):
    """The torch backend's products are all cuBLAS kernels on a GPU: the breakdown takes its Gram
    pass, middle and update from the backend's ``fgd::`` ranges instead (host time on a CPU)."""
    out = tmp_path / "first.jsonl"
    cmd = [sys.executable, *FIRST, str(out), "--cpu-dry-run", "--cases", "fgd-torch", "--measure", "breakdown"]
    subprocess.run(cmd, env=ENV, check=True, timeout=180, capture_output=True, cwd=ROOT)
    row = {(r["case"], r["what"]): r for r in lines(out)}[("fgd-torch", "breakdown")]
    assert sorted(row["phases"]) == ["gram", "middle", "update"], row
    assert all(v["host_ms"] > 0 and v["gpu_ms"] is None for v in row["phases"].values()), row["phases"]
    report = subprocess.run(
        [sys.executable, *FIRST, str(out), "--report"], env=ENV, capture_output=True, text=True, check=True, cwd=ROOT
    ).stdout
    assert "by part of the step: gram: host" in report, report
