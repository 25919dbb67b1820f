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
    assert by[("sgd", "memory")]["first_step_peak_mib"] >= by[("sgd", "memory")]["peak_extra_mib"] >= 0
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
    result = json.loads((out / "gpu_check.json").read_text(encoding="utf-8"))
    assert result["terminated"] == f"signal {signal.SIGTERM}"
    assert result["phases"]["tests"]["error"] == f"stopped by signal {signal.SIGTERM}"
    report = (out / "report.md").read_text(encoding="utf-8")  # (a review: only the JSON said so)
    assert f"**stopped early** (signal {signal.SIGTERM}" in report
    assert f"| tests | no | {result['phases']['tests']['seconds']} | stopped by signal {signal.SIGTERM}" in report
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


@pytest.mark.parametrize("name", ["probe", "triton-probe"])
def test_the_probe_phase_is_chosen_by_either_name(tmp_path, name):
    """A review: the README and the report name the phase ``triton-probe``, which ``--phases``
    refused (argparse exit 2: device time lost on a rerun). Both names choose it."""
    out = tmp_path / "out"
    cmd = [sys.executable, *CHECK, str(out), "--work", str(tmp_path / "work"), "--cpu-dry-run", "--no-install"]
    subprocess.run(
        [*cmd, "--phases", name, "--no-probe"], env=ENV, check=True, timeout=120, capture_output=True, cwd=ROOT
    )
    phases = json.loads((out / "gpu_check.json").read_text(encoding="utf-8"))["phases"]
    assert list(phases) == ["triton-probe"] and "--no-probe" in json.dumps(phases["triton-probe"])


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


def test_the_gpu_breakdown_counts_kernels_not_the_ranges_on_the_gpu_timeline():
    """A review: with CUDA activities the profiler also puts each record_function range on the GPU
    timeline, spanning its whole part of the step; the breakdown added them as kernels (the H200
    report's profiled GPU time was 2-3x the step). Synthetic events, as a GPU profile has them."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    from benchmarks.gpu.first_phase import kernel_times

    def event(name, ms, device=DeviceType.CUDA, annotation=False):
        fields = dict(name=name, device_type=device, device_time=ms * 1e3, cpu_time=0.0, cpu_parent=None)
        return SimpleNamespace(**fields, is_user_annotation=annotation)

    events = [
        event("Optimizer.step#FGD.step", 22.5, annotation=True),
        event("fgd::gram", 6.0, annotation=True),
        event("fgd::update", 5.0),  # (a torch without the flag: the name alone)
        event("_gram_kernel", 4.0),
        event("_update_kernel_fgd", 3.0),
        event("sm90_xmma_gemm_f32f32", 2.0),
        event("aten::mm", 9.0, device=DeviceType.CPU),
    ]
    kinds, kernels = kernel_times(events, cuda=True)
    assert sorted(kernels) == ["_gram_kernel", "_update_kernel_fgd", "sm90_xmma_gemm_f32f32"]
    assert kinds == {"gram": 4.0, "update": 3.0, "cuBLAS products": 2.0}


def test_the_gpu_parts_of_a_step_count_the_kernels_that_ran_inside_them():
    """A review of the GPU-only paths: each part's GPU time came from its host range's
    ``device_time_total``, which reaches only kernels an aten op inside the range launched; the
    Triton backend's kernels, launched directly, counted for nothing (every part would have read
    as host-bound). Now by time window on the GPU timeline. Synthetic events, as a GPU profile
    has them (times in µs)."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    from benchmarks.gpu.first_phase import phase_times

    def event(name, start, end, device=DeviceType.CUDA, annotation=False, cpu_total=0.0, linked=0.0):
        fields = dict(name=name, device_type=device, time_range=SimpleNamespace(start=start, end=end))
        fields.update(cpu_time_total=cpu_total, device_time_total=linked, is_user_annotation=annotation)
        return SimpleNamespace(**fields)

    events = [
        event("fgd::gram", 0, 50, device=DeviceType.CPU, cpu_total=50.0),  # host ranges: no aten op inside
        event("fgd::update", 60, 90, device=DeviceType.CPU, cpu_total=30.0),
        event("Optimizer.step#FGD.step", 100, 400, annotation=True),  # the GPU timeline
        event("fgd::gram", 100, 200, annotation=True),
        event("_tc_gram_kernel", 105, 185),
        event("_tc_split_kernel", 101, 104),
        event("fgd::update", 250, 400),  # (a torch without the annotation flag: the name alone)
        event("_tc_update_kernel", 260, 390),
        event("_between_the_parts", 210, 240),
    ]
    got = phase_times(events, cuda=True)
    assert got == {
        "gram": dict(host_ms=0.05, gpu_ms=0.083, ranges=1, gpu_ms_linked=0.0),
        "update": dict(host_ms=0.03, gpu_ms=0.13, ranges=1, gpu_ms_linked=0.0),
    }
    assert all(v["gpu_ms"] is None for v in phase_times(events[:2], cuda=True).values())  # no GPU copies: unknown
    assert phase_times(events, cuda=False) == {
        "gram": dict(host_ms=0.05, gpu_ms=None, ranges=1),
        "update": dict(host_ms=0.03, gpu_ms=None, ranges=1),
    }


def _args(tmp_path, **kw):
    import argparse

    fields = dict(outdir=str(tmp_path / "out"), work=str(tmp_path / "work"), commit="x", tests=None, first_cases=None)
    fields.update(accuracy_cases=None, probe=True, phases=None, workers=8)
    return argparse.Namespace(**fields, **kw)


def _spend(check, seconds):
    check.deadline -= seconds  # (a phase that took this long)


def test_the_default_budget_runs_every_decisive_phase_in_full(tmp_path):
    """A review: at the session's budget of 440 s the old plan left the Triton probe 10 s (never
    run) and the accuracy run ~30 s. Each phase taking its whole allowance, install to bench now
    get their caps and the probe its minimum."""
    from benchmarks.gpu import gpu_check

    check = gpu_check.Check(_args(tmp_path, budget=440.0, cpu_dry_run=False, no_install=False))
    got = {}
    for phase in gpu_check.PHASES:
        name = {"probe": "triton-probe"}.get(phase.__name__, phase.__name__)
        got[name] = check.allowance(name)
        _spend(check, 5.0 if name == "install" else got[name])
    for name in ("first", "tests", "accuracy", "bench"):
        assert got[name] == gpu_check.PLAN[name][0], got
    assert got["triton-probe"] >= 20, got


def test_a_sigterm_during_publish_waits_for_whole_files(tmp_path):
    """A review: the handler published while an interrupted publish() had its files open, and could
    leave a torn gpu_check.json or logs.tgz. Inside publish() it now only marks the signal; publish()
    ends, publishes once more and exits."""
    import tarfile

    from benchmarks.gpu import gpu_check

    out = tmp_path / "out"
    check = gpu_check.Check(_args(tmp_path, budget=100.0, cpu_dry_run=True, no_install=True))
    original, landed = check._publish, []

    def interrupted():
        if not landed:  # (the signal lands in the middle of the first publish)
            landed.append(True)
            check.terminated(signal.SIGTERM, None)
            assert not (out / "gpu_check.json").read_text(encoding="utf-8").count("terminated")  # deferred
        original()

    check._publish = interrupted
    with pytest.raises(SystemExit) as exc:
        check.publish()
    assert exc.value.code == 128 + signal.SIGTERM
    assert json.loads((out / "gpu_check.json").read_text(encoding="utf-8"))["terminated"] == f"signal {signal.SIGTERM}"
    with tarfile.open(out / "logs.tgz") as tar:
        assert tar.getnames()


@pytest.mark.parametrize(
    ("name", "checks"), [("fgd-torch", 2), ("cayley-sgd-lowrank", 1), ("landing-sgd", 1), ("sgd", 0)]
)
def test_checks_off_turns_off_every_contenders_host_synchronising_checks(name, checks):
    """A review: the first phase turned checks off for FGD only, so Cayley SGD's "checks off"
    time (and its failed capture: a host read inside the graph) was its checks-on time beside
    FGD's checks-off one. Every contender with a check now steps without it."""
    import torch

    from benchmarks.contenders import contender
    from benchmarks.gpu.first_phase import CHECKS, _checks_off
    from benchmarks.measure import LR
    from benchmarks.workloads import workloads

    w = workloads("tiny")[0]
    case = contender(name).make(w.model(torch.device("cpu")), w.rule, LR)
    assert _checks_off(case) is bool(checks)
    found = [c for c in CHECKS if hasattr(case.optimizer, c)]
    assert len(found) == checks and not any(getattr(case.optimizer, c) for c in found)


@pytest.mark.parametrize("name, required", [("tests", "triton"), ("tests-cuda", "triton,cuda")])
def test_the_gpu_tests_phase_requires_its_backends_and_prints_the_skips(tmp_path, monkeypatch, name, required):
    """A review: on the GPU machine a backend that failed to load (a Triton or extension build
    error) turned its tests into skips, whose reasons the phase never printed: the session
    passed. The phase now runs pytest with -rs and ``FGD_REQUIRE_BACKENDS``, under which
    ``helpers.backend_reason`` lets a required backend's CUDA tests run and fail."""
    from benchmarks.gpu import gpu_check

    check = gpu_check.Check(_args(tmp_path, budget=440.0, cpu_dry_run=False, no_install=False))
    calls = []
    monkeypatch.setattr(check, "run", lambda phase, cmd, budget, env=None: calls.append((cmd, env)) or {"ok": True})
    gpu_check.tests(check, ["tests/test_bad_input.py"], name=name)
    ((cmd, env),) = calls
    assert "-rfEs" in cmd and env["FGD_REQUIRE_BACKENDS"] == required


def test_a_required_backend_is_not_skipped_on_a_cuda_device(monkeypatch):
    from helpers import backend_reason

    monkeypatch.delenv("FGD_REQUIRE_BACKENDS", raising=False)
    if backend_reason("cuda", "cuda") is None:
        pytest.skip("the CUDA backend loads here: nothing to require")
    monkeypatch.setenv("FGD_REQUIRE_BACKENDS", "triton, cuda")
    assert backend_reason("cuda", "cuda") is None  # its tests run and fail with the loader's reason
    assert backend_reason("cuda", "cpu") is not None  # (only on CUDA devices: CPU tensors cannot take it)
