"""Everything a rare GPU session should do, in one call, most valuable numbers first.

Usage (from the repository root, on the GPU machine)::

    python -m benchmarks.gpu.gpu_check OUTDIR [--budget 460] [--commit SHA]
    python -m benchmarks.gpu.gpu_check OUTDIR --cpu-dry-run [--no-install]   # rehearsal on a CPU

``OUTDIR`` is the folder that comes back from the device (``$OUT``): it never holds more than
eight files, and every one of them is rewritten as soon as the phase behind it has something, so
a call killed at any moment returns everything finished before. The logs live in a work folder
(``--work``, default ``/tmp/gpu_check``) and are packed into ``OUTDIR/logs.tgz`` after every
phase, with ``report.md`` and ``gpu_check.json``. Phases, each in subprocesses with their own
timeouts, in the order of what decides the product's defaults:

1. **install**: a pure-Python editable install (``FGD_FAST_BUILD_CUDA=0``; seconds, no nvcc).
2. **first** (``FIRST_S``): ``benchmarks/gpu/first_phase.py`` into ``first.jsonl``: one-step
   agreement, step times (eager, CUDA graph), a breakdown of one step, peak memory and the
   1,000-step distance on WRN-28-10, each backend × precision in its own subprocess.
3. **tests**: the GPU-relevant tests (tensor cores, the Triton and torch backends, the backend
   contract, CUDA-graph capture; ``--tests`` replaces the selection), JUnit XML in the logs.
4. **accuracy**: ``benchmarks/gpu/accuracy.py``, max ‖θᵀθ − I‖_F over 500 steps on ResNet-50
   and the Transformer set (the first phase has WRN-28-10's) for the reference form and the
   precision candidates (``accuracy.json``): with the first phase, what the precision default
   is decided by.
5. **bench**: the pytest-benchmark suite on WRN-28-10, ResNet-50 and the Transformer set, one
   process per group of contenders (each Triton code alone — ``fgd-auto`` with
   ``fgd-triton-tf32x3``, which it runs on a GPU —: a sticky CUDA error takes only the cases of
   that code down; each group's time in proportion to its contenders), all appending
   to ``bench-cases.jsonl``.
6. **triton-probe** (``--no-probe`` skips it): the phases of the Triton step and a tile sweep
   of the tensor-core kernels (``triton_probe.json``).
7. **train**: the WRN-28-10 training comparison (``python -m benchmarks.training``, synthetic data,
   ``train-wrn.json``).
8. **build** last: the nvcc build of ``fgd_fast._C`` (``FGD_FAST_BUILD_CUDA=1``), then, if it
   built, the CUDA tests and the ``fgd-cuda`` case of the first phase.

``--budget`` (default 460 s) bounds the whole run; each phase gets at most its cap and what is
left after the reserves of the phases still to come. Without git on the device, pass
``--commit`` (or set ``FGD_BENCH_COMMIT``); the source digest identifies the tree either way.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from traceback import format_exc

from benchmarks.sources import source_digest

ROOT = Path(__file__).resolve().parent.parent.parent

REPORT_RESERVE_S = 15
#: a file in the work folder saying this script made it (so a rerun may clear it)
WORK_MARK = ".gpu_check_work"
#: per phase: (cap in seconds, seconds kept for the phases after it) on a GPU
#: (the default budget, 440–460 s, runs install to bench in full — ~380 s at their caps with a
#: seconds-long install — and gives the probe and the training run what is left, ~25–45 s each)
PLAN = {
    "install": (60, 380),
    "first": (165, 215),
    "tests": (70, 145),
    "accuracy": (55, 90),
    "bench": (85, 20),
    "triton-probe": (25, 0),
    "train": (40, 0),
    "build": (200, 0),
}
#: a phase whose name in the plan and the report is not its function's (``--phases`` takes either)
PLAN_NAME = {"probe": "triton-probe"}
#: the accuracy phase: the workloads the first phase does not run, and the precision candidates
ACCURACY_WORKLOADS = ("resnet-50", "transformer")
ACCURACY_CASES = ("fgd-reference", "fgd-auto", "fgd-torch-tf32x3", "fgd-triton-tf32x3")
#: the benchmark's workloads and its contenders, one process per group
BENCH_WORKLOADS = ("wrn-28-10", "resnet-50", "transformer")
BENCH_GROUPS = (
    ("fgd-torch", "fgd-torch-tf32x3", "fgd-torch-tf32", "sgd", "cayley-sgd-lowrank"),
    ("fgd-auto", "fgd-triton-tf32x3"),  # (auto is Triton at tf32x3 on a GPU: the same kernels, one process)
    ("fgd-triton-tf32",),
    ("fgd-triton",),
    ("fgd-reference", "cayley-adam-lowrank", "geoopt-qr"),
)
GPU_TESTS = (
    "tests/test_triton_tensor_cores.py",
    "tests/test_triton_backend.py",
    "tests/test_backend_contract.py",
    "tests/test_torch_backend.py",
    "tests/test_tf32_split.py",
    "tests/test_device_lr.py",  # a captured step with lr a CUDA tensor, changed between replays
    "tests/test_layout.py",  # the middle over several p (index_select, segmented sums on the GPU)
    "tests/test_guard_blend.py",  # the guard's blend kernels compiled for the GPU, against the torch ops
    "tests/test_gram_gather.py",  # the Gram blocks' gather into the middle's layout, bit for bit
    "tests/test_mid_products.py",  # the middle's products in one launch for every p, against torch's
    "tests/test_fused_middle.py",  # the fused middle (prologue, product jobs, guard) against the torch ops
)  # (not test_triton_aot.py: on a GPU it compiles every configuration, minutes that need no GPU —
#  run FGD_AOT_FULL=1 with Triton 3.6 on a CPU before the session instead)


class Check:
    """The run: options, the deadline, the environment of the phases, and the outcome files."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.out = Path(args.outdir).resolve()
        self.out.mkdir(parents=True, exist_ok=True)
        self.work = Path(args.work).resolve()
        if (self.work / WORK_MARK).exists():  # a rerun on a warm machine must not report the last run's logs
            shutil.rmtree(self.work, ignore_errors=True)  # (only a folder this script made: never a user's)
        self.work.mkdir(parents=True, exist_ok=True)
        (self.work / WORK_MARK).touch()
        self.current: subprocess.Popen | None = None  # the phase's process group, killed on SIGTERM
        self.current_name: tuple[str, str, float] | None = None  # (phase, log, start) while one runs
        self.publishing = False  # inside publish(): a SIGTERM then waits for its end
        self.stop_signal: int | None = None
        self.deadline = time.monotonic() + args.budget
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", "FGD_FAST_JIT": "0"}
        if args.commit:
            self.env["FGD_BENCH_COMMIT"] = args.commit
        if args.cpu_dry_run:
            self.env.update(
                FGD_BENCH_DEVICE="cpu", FGD_BENCH_SCALE="tiny", FGD_BENCH_THREADS="1", OMP_WAIT_POLICY="PASSIVE"
            )
        else:
            self.env.setdefault("FGD_BENCH_SCALE", "full")
        chosen = args.phases or [p.__name__ for p in PHASES]
        self.selected = [PLAN_NAME.get(n, n) for n in chosen]
        self.result: dict = {"args": vars(args), "source_digest": source_digest(ROOT), "phases": {}}
        self.save()

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def allowance(self, phase: str) -> float:
        """Seconds ``phase`` may take: its cap, less what the later phases keep."""
        cap, later = PLAN[phase]
        names = [n for n in PLAN if n in self.selected]  # the phases of this run, in order
        after = names[names.index(phase) + 1 :] if phase in names else []
        later = min(later, sum(PLAN[n][0] for n in after))  # nothing kept for phases not run
        if self.args.cpu_dry_run:
            cap, later = cap * 3, later / 4  # interpreted kernels on 2 cores: slower, fewer
        # the later phases' reserve never squeezes a phase below a quarter of its cap (a 1 s
        # install would cost every later phase its package)
        return max(0.0, min(cap, self.left() - REPORT_RESERVE_S, max(self.left() - REPORT_RESERVE_S - later, cap / 4)))

    def save(self) -> None:
        tmp = self.out / "gpu_check.json.tmp"
        tmp.write_text(json.dumps(self.result, indent=2, default=str), encoding="utf-8")
        tmp.replace(self.out / "gpu_check.json")

    def publish(self) -> None:
        """``gpu_check.json``, ``report.md`` and ``logs.tgz`` in OUTDIR, as they are now. A
        SIGTERM arriving meanwhile waits until the files are whole (see :func:`main`)."""
        self.publishing = True
        try:
            self._publish()
        finally:
            self.publishing = False
        if self.stop_signal is not None:  # (the handler deferred it: publish once more, then exit)
            signum, self.stop_signal = self.stop_signal, None
            self._publish()
            sys.exit(128 + signum)

    def terminated(self, signum: int, frame) -> None:
        """SIGTERM (the session's outer timeout): kill the phase's processes, keep the results."""
        if self.current is not None:
            try:
                os.killpg(self.current.pid, signal.SIGKILL)
            except OSError:
                pass
        self.result["terminated"] = f"signal {signum}"
        if self.current_name is not None:  # (the phase it stopped: in the table, not missing from it)
            name, log, t0 = self.current_name
            seconds = round(time.monotonic() - t0, 1)
            self.result["phases"][name] = {"ok": False, "error": f"stopped by signal {signum}", "log": log}
            self.result["phases"][name]["seconds"] = seconds
        if self.publishing:  # (files half written: publish() ends them, publishes again and exits)
            self.stop_signal = signum
            return
        self.publish()
        sys.exit(128 + signum)

    def _publish(self) -> None:
        self.save()
        try:
            (self.out / "report.md.tmp").write_text(render(self), encoding="utf-8")
            (self.out / "report.md.tmp").replace(self.out / "report.md")
        except Exception as exc:  # a report bug must not cost the results
            self.result["report_error"] = repr(exc)
            self.save()
        tmp = self.out / "logs.tgz.tmp"
        with tarfile.open(tmp, "w:gz") as tar:
            tar.add(self.work, arcname="gpu_check")
        tmp.replace(self.out / "logs.tgz")

    def skip(self, name: str, why: str) -> None:
        self.result["phases"][name] = {"ok": False, "skipped": why}
        self.publish()

    def run(self, name: str, cmd: list[str], timeout: float, env: dict | None = None) -> dict:
        """Run ``cmd`` in its own process group, output to ``WORK/name.log``; never raises."""
        log = self.work / f"{name}.log"
        timeout = max(1.0, min(timeout, self.left() - REPORT_RESERVE_S))
        t0 = time.monotonic()
        outcome = {"cmd": " ".join(cmd), "log": log.name, "timeout_s": round(timeout)}
        try:
            with open(log, "w", encoding="utf-8") as fh:
                proc = subprocess.Popen(
                    cmd, cwd=ROOT, env=env or self.env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True
                )
                self.current, self.current_name = proc, (name, log.name, t0)
                try:
                    outcome["rc"] = proc.wait(timeout=timeout)
                except subprocess.TimeoutExpired:
                    outcome["timed_out"] = True
                    os.killpg(proc.pid, signal.SIGINT)  # pytest writes its reports on SIGINT
                    try:
                        outcome["rc"] = proc.wait(timeout=10)
                    except subprocess.TimeoutExpired:
                        os.killpg(proc.pid, signal.SIGKILL)
                        outcome["rc"] = proc.wait()
        except OSError as exc:
            outcome.update(rc=None, error=str(exc))
        finally:
            self.current = self.current_name = None
        outcome["seconds"] = round(time.monotonic() - t0, 1)
        outcome["ok"] = outcome.get("rc") == 0 and not outcome.get("timed_out")
        outcome["tail"] = _tail(log)
        self.result["phases"][name] = outcome
        self.publish()
        return outcome


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(encoding="utf-8", errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


PROBE = """
import json, torch
import benchmarks.machine as machine
from fgd_fast.backends import BackendUnavailable, resolve_backend
device = torch.device("cuda" if torch.cuda.is_available() and not {cpu} else "cpu")
out = {{"environment": machine.environment(device), "backends": {{}}}}
for name in ("reference", "torch", "triton", "cuda", "auto"):
    try:
        out["backends"][name] = "ok: " + resolve_backend(name, device)[0]
    except (BackendUnavailable, ImportError) as exc:
        out["backends"][name] = "unavailable: " + str(exc).splitlines()[0]
print("PROBE " + json.dumps(out, default=str))
"""


def _pip(check: Check) -> list[str]:
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index"]
    cmd += ["--disable-pip-version-check", "-e", "."]  # (the device has no network)
    return cmd + (["--break-system-packages"] if check.result.get("pip_needs_break") else [])


def install(check: Check) -> None:
    """A pure-Python editable install (no nvcc: seconds), then which backends resolve."""
    if check.args.no_install:
        check.skip("install", "--no-install")
    else:
        env = {**check.env, "FGD_FAST_BUILD_CUDA": "0"}
        r = check.run("install", _pip(check), check.allowance("install"), env=env)
        if not r["ok"] and "externally-managed" in (check.work / "install.log").read_text(errors="replace"):
            check.result["pip_needs_break"] = True
            r = check.run("install", _pip(check), check.allowance("install"), env=env)
        if not r["ok"]:  # last resort: the source tree, with the kernels where the install would map them
            link = ROOT / "fgd_fast" / "kernels"
            if not link.exists():
                try:
                    link.symlink_to(Path("..") / "kernels", target_is_directory=True)
                    check.result["kernels_link"] = "fgd_fast/kernels -> ../kernels (the install failed)"
                except OSError as exc:
                    check.result["kernels_link"] = f"failed: {exc} (no Triton backend)"
            check.env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), check.env.get("PYTHONPATH")]))
    _probe_backends(check)


def _probe_backends(check: Check) -> None:
    check.run("probe", [sys.executable, "-c", PROBE.format(cpu=check.args.cpu_dry_run)], 60)
    for line in (check.work / "probe.log").read_text(errors="replace").splitlines():
        if line.startswith("PROBE "):
            check.result.update(json.loads(line[6:]))
    check.publish()


def first(check: Check, cases: list[str] | None = None, name: str = "first") -> None:
    """``first_phase.py``: each result a line of ``OUTDIR/first.jsonl`` the moment it exists."""
    budget = check.allowance("first") if name == "first" else min(60.0, check.left() - REPORT_RESERVE_S)
    if budget < 20:
        return check.skip(name, f"{budget:.0f} s left")
    cmd = [sys.executable, "-m", "benchmarks.gpu.first_phase", str(check.out / "first.jsonl")]
    cmd += ["--budget", str(round(budget - 10))]
    cases = cases or check.args.first_cases
    if cases:
        cmd += ["--cases", *cases]
    elif not check.result.get("cuda_extension", "").startswith("built"):
        cmd += ["--cases", *[c for c in _first_cases() if c != "fgd-cuda"]]
    if check.args.cpu_dry_run:
        cmd += ["--cpu-dry-run", "--min-case-s", "5"]
    check.run(name, cmd, budget)


def _first_cases() -> list[str]:
    from benchmarks.gpu.first_phase import CASES

    return [c for c, _ in CASES]


def tests(check: Check, selection: list[str] | None = None, name: str = "tests") -> None:
    if selection is None:
        selection = (
            check.args.tests.split()
            if check.args.tests
            else (["tests/test_bad_input.py", "-k", "construction"] if check.args.cpu_dry_run else list(GPU_TESTS))
        )
    budget = check.allowance("tests") if name == "tests" else min(60.0, check.left() - REPORT_RESERVE_S)
    if budget < 15:
        return check.skip(name, f"{budget:.0f} s left")
    junit = check.work / f"{name}-junit.xml"
    # -rs: every skip's reason in the log (a backend that fails to load must not pass as skips)
    cmd = [sys.executable, "-m", "pytest", *selection, "-q", "-rfEs", f"--junitxml={junit}", "-p", "no:cacheprovider"]
    if check.args.workers and not check.args.cpu_dry_run and _has_xdist():
        # Triton compiles on the host CPUs: a few workers share one GPU and cut the wall time
        cmd += ["-n", str(check.args.workers)]
    env = None
    if not check.args.cpu_dry_run:  # on the GPU the backends under test must load: their tests fail, not skip
        env = {**check.env, "FGD_REQUIRE_BACKENDS": "triton,cuda" if name == "tests-cuda" else "triton"}
    check.run(name, cmd, budget, env=env)
    check.result.setdefault("test_summary", {})[name] = junit_summary(junit)
    check.publish()


def _has_xdist() -> bool:
    import importlib.util

    return importlib.util.find_spec("xdist") is not None


def junit_summary(path: Path) -> dict:
    """Counts and the failed test ids of a JUnit XML (``{"missing": ...}`` if unreadable)."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError) as exc:
        return {"missing": str(exc)}
    counts = dict(tests=0, failures=0, errors=0, skipped=0)
    failed = []
    for suite in root.iter("testsuite"):
        for key in counts:
            counts[key] += int(suite.get(key, 0))
    for case in root.iter("testcase"):
        bad = next((e for e in (case.find("failure"), case.find("error")) if e is not None), None)
        if bad is not None:
            message = (bad.get("message") or "").strip().splitlines()
            failed.append(f"{case.get('classname')}::{case.get('name')}: {message[0][:200] if message else ''}")
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    return {**counts, "failed": failed}


def bench(check: Check) -> None:
    """The benchmark suite, one process per group of contenders, into ``bench-cases.jsonl``."""
    record = check.out / "bench-cases.jsonl"
    record.unlink(missing_ok=True)
    end = time.monotonic() + check.allowance("bench")
    workloads = ("wrn-28-10",) if check.args.cpu_dry_run else BENCH_WORKLOADS
    groups = BENCH_GROUPS[:2] if check.args.cpu_dry_run else BENCH_GROUPS
    for i, group in enumerate(groups):
        left = end - time.monotonic()
        name = f"bench-{i}"
        if left < 10:
            check.skip(name, f"{left:.0f} s left for {', '.join(group)}")
            continue
        share = left * len(group) / sum(len(g) for g in groups[i:])  # by the number of contenders
        ids = [f"benchmarks/test_optimizer_step.py::test_step[{w}/{c}]" for w in workloads for c in group]
        cmd = [sys.executable, "-m", "pytest", *ids, "-q", "-p", "no:cacheprovider", f"--bench-record={record}"]
        cmd += ["--benchmark-columns=min,median,max,rounds", "--benchmark-sort=name"]
        if check.args.cpu_dry_run and "triton" in " ".join(group):
            cmd.append("--bench-allow-interpreter")
        env = {**check.env, "TRITON_INTERPRET": "1"} if check.args.cpu_dry_run else check.env
        check.run(name, cmd, min(left, max(20.0, share * 1.3)), env=env)


def accuracy(check: Check) -> None:
    """``benchmarks/gpu/accuracy.py``: max ‖θᵀθ − I‖_F over 500 steps vs the reference form."""
    budget = check.allowance("accuracy")
    if budget < 20:
        return check.skip("accuracy", f"{budget:.0f} s left")
    cmd = [sys.executable, "-m", "benchmarks.gpu.accuracy", str(check.out / "accuracy.json")]
    cmd += ["--budget", str(round(budget - 10))]
    if check.args.cpu_dry_run:
        cmd += ["--cpu-dry-run", "--workloads", "wrn-28-10"]
        cases = ("fgd-reference", "fgd-torch-tf32x3")
    else:  # (WRN-28-10's distances come from the first phase, at 1,000 steps)
        cmd += ["--workloads", *ACCURACY_WORKLOADS, "--steps", "500"]
        cases = ACCURACY_CASES
    cmd += ["--cases", *(check.args.accuracy_cases or cases)]  # (--accuracy-cases replaces the default)
    check.run("accuracy", cmd, budget)


def _accuracy_lines(check: Check) -> list[str]:
    try:
        data = json.loads((check.out / "accuracy.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []
    from benchmarks.gpu.accuracy import table

    head = f"## Accuracy ({data['steps']} steps, `benchmarks/gpu/accuracy.py`)"
    return ["", head, "", table(data["results"])]


def _probing(check: Check) -> bool:
    return getattr(check.args, "probe", True)


def probe(check: Check) -> None:
    """``benchmarks/gpu/triton_probe.py``: phases of the Triton step and a tile sweep."""
    if not _probing(check):
        return check.skip("triton-probe", "--no-probe")
    budget = check.allowance("triton-probe")
    if budget < 20:
        return check.skip("triton-probe", f"{budget:.0f} s left")
    cmd = [sys.executable, "-m", "benchmarks.gpu.triton_probe", str(check.out / "triton_probe.json")]
    cmd += ["--budget", str(round(budget - 10))]
    env = check.env
    if check.args.cpu_dry_run:  # rehearsal: the interpreter on tiny shapes
        cmd.append("--cpu-dry-run")
        env = {**check.env, "TRITON_INTERPRET": "1"}
    check.run("triton-probe", cmd, budget, env=env)


def train(check: Check) -> None:
    """The WRN-28-10 training comparison (synthetic data): sgd, fgd, cayley-sgd side by side."""
    budget = check.allowance("train")
    if budget < 20:
        return check.skip("train", f"{budget:.0f} s left")
    folder = check.work / "train-wrn"
    size = ["--depth", "28", "--width", "10", "--epochs", "2", "--steps-per-epoch", "30"]
    if check.args.cpu_dry_run:
        size = ["--depth", "10", "--width", "0.5", "--batch-size", "16", "--epochs", "1", "--steps-per-epoch", "2"]
    cmd = [sys.executable, "-m", "benchmarks.training", "--dataset", "synthetic", "--model", "wrn"]
    cmd += ["--optimizers", "sgd,fgd,cayley-sgd", "--no-progress", "--no-plot", "--out", str(folder), *size]
    if not check.args.cpu_dry_run:
        cmd += ["--amp", "bf16", "--channels-last", "on"]
    check.run("train", cmd, budget)
    if (folder / "train.json").exists():
        shutil.copy(folder / "train.json", check.out / "train-wrn.json")
        check.publish()


def build(check: Check) -> None:
    """Last: the nvcc build of ``fgd_fast._C``; if it built, the CUDA tests and first-phase case."""
    budget = check.allowance("build")
    if check.args.no_install or check.args.cpu_dry_run:
        check.result["cuda_extension"] = "not built (dry run or --no-install)"
        return check.skip("build", "dry run or --no-install")
    if budget < 40:
        check.result["cuda_extension"] = f"not built ({budget:.0f} s left)"
        return check.skip("build", f"{budget:.0f} s left")
    r = check.run("build", _pip(check), budget, env={**check.env, "FGD_FAST_BUILD_CUDA": "1"})
    check.result["cuda_extension"] = "built" if r["ok"] else "not built (see build.log)"
    check.publish()
    if r["ok"]:
        first(check, ["fgd-cuda"], name="first-cuda")
        tests(check, ["tests/test_cuda_build.py", "tests/test_backend_contract.py", "-k", "cuda"], name="tests-cuda")


def _first_lines(check: Check) -> list[str]:
    path = check.out / "first.jsonl"
    if not path.exists():
        return []
    from benchmarks.gpu.first_phase import load
    from benchmarks.gpu.first_phase import report as first_report

    return ["", *("#" + ln if ln.startswith("#") else ln for ln in first_report(load(path)).splitlines())]


def _probe_lines(check: Check) -> list[str]:
    try:
        results = json.loads((check.out / "triton_probe.json").read_text(encoding="utf-8"))["results"]
    except (OSError, ValueError, KeyError):
        return []
    lines = ["", "## Triton probe (WRN-28-10, `benchmarks/gpu/triton_probe.py`)", ""]
    for r in results:
        if "ms" in r:
            lines.append(f"- {r['what']}: {r['ms']:.3g} ms")
        elif "error" in r:
            lines.append(f"- {r['what']} {r.get('cfg')}: {r['error']}")
        else:
            lines.append(
                f"- {r['what']} {r.get('cfg')}: prepare {r['prepare_ms']:.3g} ms, apply {r['apply_ms']:.3g} ms"
            )
    return lines


def bench_report(check: Check) -> None:
    source = check.out / "bench-cases.jsonl"
    if source.exists() and source.stat().st_size:
        cmd = [sys.executable, "-m", "benchmarks.report", str(source), "-o", str(check.work / "bench-report.md")]
        check.run("report", cmd, 60)


def render(check: Check) -> str:
    r, env = check.result, check.result.get("environment", {})
    commit = env.get("commit", {})
    lines = [
        f"# GPU check: {env.get('gpu') or env.get('cpu', '?')}{' (CPU dry run)' if check.args.cpu_dry_run else ''}",
        "",
        f"- device: {env.get('gpu', 'CPU')}, driver {env.get('driver', '—')}, CUDA {env.get('cuda', '—')}, "
        f"host CPU {env.get('cpu', '?')}",
        f"- versions: torch {env.get('torch', '?')}, triton {env.get('triton', '?')}, geoopt {env.get('geoopt', '?')}, "
        f"Python {env.get('python', '?')}",
        f"- commit: `{commit.get('id', '?')}` ({commit.get('source', '?')}); source digest `{r['source_digest']}`",
        f"- date (UTC): {env.get('date_utc', '?')}; budget {check.args.budget} s",
        f"- CUDA extension: {r.get('cuda_extension', 'not built yet (the build runs last)')}",
        "- backends on the device: " + ", ".join(f"`{k}` {v}" for k, v in r.get("backends", {}).items()),
        "",
        *(
            [f"- **stopped early** ({r['terminated']}: the session's time limit): the phases after it did not run", ""]
            if r.get("terminated")
            else []
        ),
        "| phase | ok | seconds | note |",
        "|---|---|---|---|",
    ]
    for name, p in r["phases"].items():
        note = p.get("skipped") or p.get("error") or ("timed out" if p.get("timed_out") else f"exit {p.get('rc')}")
        note += f", log `{p['log']}`" if p.get("log") else ""
        lines.append(f"| {name} | {'yes' if p.get('ok') else 'no'} | {p.get('seconds', '—')} | {note} |")
    lines += _first_lines(check)
    lines += ["", "## Tests", ""]
    for name, ts in r.get("test_summary", {}).items():
        if "missing" in ts:
            lines.append(f"- {name}: no JUnit result ({ts['missing']}); see `{name}.log`.")
            continue
        lines.append(
            f"- {name}: {ts['passed']} passed, {ts['failures']} failed, {ts['errors']} errors, "
            f"{ts['skipped']} skipped (of {ts['tests']})."
        )
        lines += [f"  - {f}" for f in ts.get("failed", [])]
    bench_md = check.work / "bench-report.md"
    lines += ["", "## Benchmarks", ""]
    if bench_md.exists():
        text = bench_md.read_text(encoding="utf-8").splitlines()
        lines += ["#" + ln if ln.startswith("#") else ln for ln in text]  # one heading level down
    else:
        lines.append("No benchmark report (yet); see `bench-cases.jsonl` and the `bench-*.log` files.")
    lines += _accuracy_lines(check)
    lines += _probe_lines(check)
    return "\n".join(lines) + "\n"


PHASES = (install, first, tests, accuracy, bench, probe, train, build)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("outdir", nargs="?", help="the folder that comes back ($OUT): at most eight files")
    ap.add_argument("--work", default="/tmp/gpu_check", help="folder for the logs (packed into OUTDIR/logs.tgz)")
    ap.add_argument("--budget", type=float, default=460.0, help="seconds for the whole check (default 460)")
    ap.add_argument(
        "--commit", default=os.environ.get("FGD_BENCH_COMMIT"), help="the commit under test, when the device has no git"
    )
    ap.add_argument("--cpu-dry-run", action="store_true", help="rehearse on a CPU: tiny shapes, a few tests")
    ap.add_argument(
        "--no-install", action="store_true", help="skip the pip installs (the package is installed already)"
    )
    ap.add_argument("--tests", help="pytest selection for the tests phase (default: the GPU-relevant test files)")
    ap.add_argument("--first-cases", nargs="+", help="cases of the first phase (default: all that can run)")
    ap.add_argument("--accuracy-cases", nargs="+", help="cases of the accuracy run (default: accuracy.py's)")
    ap.add_argument("--no-probe", dest="probe", action="store_false", help="skip the Triton probe")
    ap.add_argument(
        "--phases",
        nargs="+",
        choices=[p.__name__ for p in PHASES] + list(PLAN_NAME.values()),  # (names in the plan and report too)
        help="run only these phases (default: all; the probe is 'probe' or 'triton-probe')",
    )
    ap.add_argument(
        "--workers", type=int, default=8, help="pytest-xdist workers for the tests phase on a GPU (0: none)"
    )
    ap.add_argument("--digest", action="store_true", help="print this checkout's source digest and exit")
    args = ap.parse_args(argv)
    if args.phases:  # (the function's name from here on)
        function = {v: k for k, v in PLAN_NAME.items()}
        args.phases = [function.get(n, n) for n in args.phases]
    if args.digest:
        print(source_digest(ROOT))
        return 0
    if not args.outdir:
        ap.error("OUTDIR is required")
    unknown = [c for c in args.first_cases or () if c not in _first_cases()]
    if unknown:  # (before any device time: the first phase would measure nothing)
        ap.error(f"--first-cases {' '.join(unknown)}: unknown; choose from {' '.join(_first_cases())}")
    check = Check(args)
    signal.signal(signal.SIGTERM, check.terminated)
    for phase in PHASES:
        if args.phases and phase.__name__ not in args.phases:
            continue
        try:
            phase(check)
            if phase is bench:
                bench_report(check)
        except Exception as exc:  # an orchestration bug must not lose the other phases
            check.result["phases"][phase.__name__] = {"ok": False, "error": repr(exc), "traceback": format_exc()}
        check.publish()
    print((check.out / "report.md").read_text(encoding="utf-8"))
    summaries = check.result.get("test_summary", {}).values()
    return 0 if all(not s.get("failures") and not s.get("errors") and "missing" not in s for s in summaries) else 1


if __name__ == "__main__":
    sys.exit(main())
