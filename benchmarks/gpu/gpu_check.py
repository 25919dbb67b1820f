"""Everything a rare GPU session should do, in one call: build, test, benchmark, report.

Usage (from the repository root, on the GPU machine)::

    python benchmarks/gpu/gpu_check.py OUTDIR [--budget 450] [--commit SHA]
    python benchmarks/gpu/gpu_check.py OUTDIR --cpu-dry-run [--no-install]   # rehearsal on a CPU

Phases, each in a subprocess with its own timeout (its output in ``OUTDIR/<phase>.log``):

1. **build**: ``FGD_FAST_BUILD_CUDA=1 pip install --no-deps --no-build-isolation -e .``
   (builds ``fgd_fast._C``); if that fails, a pure-Python editable install
   (``FGD_FAST_BUILD_CUDA=0``) and the just-in-time build of ``fgd_fast/_cuda_build.py``;
   then which FGD backends resolve on the device. When no build worked, later phases run
   with ``FGD_FAST_JIT=0`` so no test waits for another compiler run.
2. **tests**: ``python -m pytest tests`` (less the CPU-only AOT and emulation checks) with a
   JUnit XML (``tests-junit.xml``).
3. **bench**: ``python -m pytest benchmarks`` on the full workloads (``bench.json``, and
   ``bench-cases.jsonl`` written case by case, which survives a timeout).
4. **accuracy**: ``benchmarks/gpu/accuracy.py``, max ‖θᵀθ − I‖_F over 2,000 steps per workload
   and precision against the reference form (``accuracy.json``; the reference and default
   cases of every workload first, then the others while ``ACCURACY_S`` lasts).
5. **triton-probe** (``--no-probe`` skips it; a CPU dry run interprets it on tiny shapes):
   ``benchmarks/gpu/triton_probe.py``, the phases of the Triton step and a tile sweep of the
   tensor-core kernels on WRN-28-10 (``triton_probe.json``), in the last ~``PROBE_S`` s.
6. **report**: ``bench-report.md`` from ``benchmarks/report.py``, and ``report.md`` with the
   machine (device, driver, torch, triton, commit, source digest), every phase's outcome, the
   test summary and the benchmark report.

``OUTDIR/gpu_check.json`` holds the raw outcome and is rewritten after every phase, so a
phase that fails or times out never loses what came before. A phase past its time gets
SIGINT (pytest then still writes its JUnit / JSON), then SIGKILL 20 s later. The whole run
stays under ``--budget`` seconds (default 450: with the session script's training run, one
device call of ~8 minutes).
Without git on the device, pass ``--commit`` (or set ``FGD_BENCH_COMMIT``); the source
digest (``--digest`` prints this checkout's) identifies the tree either way.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from sources import source_digest  # noqa: E402

REPORT_RESERVE_S = 25
BUILD_MAX_S = 200
TESTS_MAX_S = 180
BENCH_MIN_S = 150
ACCURACY_S = 100  # kept for the 2,000-step accuracy run after the benchmarks
PROBE_S = 60  # kept for the Triton probe after the accuracy run (GPU runs)


class Check:
    """The run: options, the deadline, the environment of the phases, and the outcome file."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.out = Path(args.outdir).resolve()
        self.out.mkdir(parents=True, exist_ok=True)
        self.deadline = time.monotonic() + args.budget
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if args.commit:
            self.env["FGD_BENCH_COMMIT"] = args.commit
        if args.cpu_dry_run:
            self.env.update(
                FGD_BENCH_DEVICE="cpu", FGD_BENCH_SCALE="tiny", FGD_BENCH_THREADS="1", OMP_WAIT_POLICY="PASSIVE"
            )
        else:
            self.env.setdefault("FGD_BENCH_SCALE", "full")
        self.result: dict = {"args": vars(args), "source_digest": source_digest(ROOT), "phases": {}}
        self.save()

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def save(self) -> None:
        tmp = self.out / "gpu_check.json.tmp"
        tmp.write_text(json.dumps(self.result, indent=2, default=str), encoding="utf-8")
        tmp.replace(self.out / "gpu_check.json")

    def run(self, name: str, cmd: list[str], timeout: float, env: dict | None = None) -> dict:
        """Run ``cmd`` in its own process group, output to ``OUTDIR/name.log``; never raises."""
        log = self.out / f"{name}.log"
        timeout = max(1.0, min(timeout, self.left() - REPORT_RESERVE_S))
        t0 = time.monotonic()
        outcome = {"cmd": " ".join(cmd), "log": log.name, "timeout_s": round(timeout)}
        try:
            with open(log, "w", encoding="utf-8") as fh:
                proc = subprocess.Popen(
                    cmd, cwd=ROOT, env=env or self.env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True
                )
                try:
                    outcome["rc"] = proc.wait(timeout=timeout)
                except subprocess.TimeoutExpired:
                    outcome["timed_out"] = True
                    os.killpg(proc.pid, signal.SIGINT)  # pytest writes its reports on SIGINT
                    try:
                        outcome["rc"] = proc.wait(timeout=20)
                    except subprocess.TimeoutExpired:
                        os.killpg(proc.pid, signal.SIGKILL)
                        outcome["rc"] = proc.wait()
        except OSError as exc:
            outcome.update(rc=None, error=str(exc))
        outcome["seconds"] = round(time.monotonic() - t0, 1)
        outcome["ok"] = outcome.get("rc") == 0 and not outcome.get("timed_out")
        outcome["tail"] = _tail(log)
        self.result["phases"][name] = outcome
        self.save()
        return outcome


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(encoding="utf-8", errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


PROBE = """
import json, sys, torch
sys.path.insert(0, "benchmarks")
import machine
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


def build(check: Check) -> None:
    py, pip = sys.executable, [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "-e", "."]
    limit = min(BUILD_MAX_S, check.left() - BENCH_MIN_S - REPORT_RESERVE_S)
    t0 = time.monotonic()
    built = False
    if check.args.no_install:
        check.result["phases"]["build-pip"] = {"ok": False, "skipped": "--no-install"}
    else:
        r = check.run("build-pip", pip, limit, env={**check.env, "FGD_FAST_BUILD_CUDA": "1"})
        if not r["ok"] and "externally-managed" in (check.out / "build-pip.log").read_text(errors="replace"):
            pip.append("--break-system-packages")
            r = check.run(
                "build-pip", pip, limit - (time.monotonic() - t0), env={**check.env, "FGD_FAST_BUILD_CUDA": "1"}
            )
        built = r["ok"]
        if not built:  # the package must import either way (fgd_fast.kernels comes from the install)
            r = check.run(
                "install-python",
                pip,
                max(30.0, limit - (time.monotonic() - t0)),
                env={**check.env, "FGD_FAST_BUILD_CUDA": "0"},
            )
            if not r["ok"]:  # last resort: the source tree (no fgd_fast.kernels, so no Triton backend)
                check.env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), check.env.get("PYTHONPATH")]))
    if not built:
        jit = "from fgd_fast import _cuda_build as b; m = b.load(); print('loaded', m.__file__)"
        r = check.run("build-jit", [py, "-c", jit], max(30.0, limit - (time.monotonic() - t0)))
        built = r["ok"]
    if not built:
        check.env["FGD_FAST_JIT"] = "0"
    check.result["cuda_extension"] = "built" if built else "not built (later phases run with FGD_FAST_JIT=0)"
    r = check.run("probe", [py, "-c", PROBE.format(cpu=check.args.cpu_dry_run)], 120)
    for line in (check.out / "probe.log").read_text(errors="replace").splitlines():
        if line.startswith("PROBE "):
            check.result.update(json.loads(line[6:]))
    check.save()


def tests(check: Check) -> None:
    # the CPU-only checks (ahead-of-time compilation, CUDA emulation) ran in CI already
    full = ["tests", "--ignore=tests/test_triton_aot.py", "--ignore=tests/test_cuda_emulated.py"]
    selection = (
        check.args.tests.split()
        if check.args.tests
        else (["tests/test_bad_input.py", "-k", "construction"] if check.args.cpu_dry_run else full)
    )
    junit = check.out / "tests-junit.xml"
    cmd = [sys.executable, "-m", "pytest", *selection, "-q", "-rfE", f"--junitxml={junit}", "-p", "no:cacheprovider"]
    if check.args.workers and not check.args.cpu_dry_run and _has_xdist():
        # Triton compiles on the host CPUs: a few workers share one GPU and cut the wall time
        cmd += ["-n", str(check.args.workers)]
    check.run("tests", cmd, min(TESTS_MAX_S, check.left() - BENCH_MIN_S - REPORT_RESERVE_S))
    check.result["test_summary"] = junit_summary(junit)
    check.save()


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
    for stale in ("bench.json", "bench-cases.jsonl"):
        (check.out / stale).unlink(missing_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "benchmarks",
        "-q",
        "-p",
        "no:cacheprovider",
        f"--benchmark-json={check.out / 'bench.json'}",
        f"--bench-record={check.out / 'bench-cases.jsonl'}",
        "--benchmark-columns=min,median,max,rounds",
        "--benchmark-sort=name",
    ]
    reserved = ACCURACY_S + (PROBE_S if _probing(check) else 0)
    check.run("bench", cmd, check.left() - REPORT_RESERVE_S - reserved)


def accuracy(check: Check) -> None:
    """``benchmarks/gpu/accuracy.py``: max ‖θᵀθ − I‖_F over 2,000 steps vs the reference form."""
    budget = check.left() - REPORT_RESERVE_S - (PROBE_S if _probing(check) else 0)
    if budget < 20:
        check.result["phases"]["accuracy"] = {"ok": False, "skipped": f"{budget:.0f} s left"}
        return
    out = str(check.out / "accuracy.json")
    cmd = [sys.executable, "benchmarks/gpu/accuracy.py", out, "--budget", str(round(budget - 15))]
    if check.args.cpu_dry_run:
        cmd.append("--cpu-dry-run")
    check.run("accuracy", cmd, budget)


def _accuracy_lines(check: Check) -> list[str]:
    try:
        data = json.loads((check.out / "accuracy.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []
    sys.path.insert(0, str(ROOT / "benchmarks" / "gpu"))
    from accuracy import table

    head = f"## Accuracy ({data['steps']} steps, `benchmarks/gpu/accuracy.py`)"
    return ["", head, "", table(data["results"])]


def _probing(check: Check) -> bool:
    return getattr(check.args, "probe", True)


def probe(check: Check) -> None:
    """``benchmarks/gpu/triton_probe.py``: phases of the Triton step and a tile sweep (GPU only)."""
    if not _probing(check):
        check.result["phases"]["triton-probe"] = {"ok": True, "skipped": "--no-probe"}
        return
    budget = check.left() - REPORT_RESERVE_S - 15
    if budget < 30:
        check.result["phases"]["triton-probe"] = {"ok": False, "skipped": f"{budget:.0f} s left"}
        return
    cmd = [
        sys.executable,
        "benchmarks/gpu/triton_probe.py",
        str(check.out / "triton_probe.json"),
        "--budget",
        str(round(budget - 20)),
    ]
    env = check.env
    if check.args.cpu_dry_run:  # rehearsal: the interpreter on tiny shapes
        cmd.append("--cpu-dry-run")
        env = {**check.env, "TRITON_INTERPRET": "1"}
    check.run("triton-probe", cmd, budget, env=env)


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


def report(check: Check) -> None:
    source = check.out / "bench.json"
    if not (source.exists() and source.stat().st_size):
        source = check.out / "bench-cases.jsonl"
    if source.exists() and source.stat().st_size:
        check.run(
            "report",
            [sys.executable, "benchmarks/report.py", str(source), "-o", str(check.out / "bench-report.md")],
            60,
        )
    (check.out / "report.md").write_text(render(check), encoding="utf-8")


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
        f"- CUDA extension: {r.get('cuda_extension', '?')}",
        "- backends on the device: " + ", ".join(f"`{k}` {v}" for k, v in r.get("backends", {}).items()),
        "",
        "| phase | ok | seconds | note |",
        "|---|---|---|---|",
    ]
    for name, p in r["phases"].items():
        note = p.get("skipped") or ("timed out" if p.get("timed_out") else f"exit {p.get('rc')}") + (
            f", log `{p['log']}`" if p.get("log") else ""
        )
        lines.append(f"| {name} | {'yes' if p.get('ok') else 'no'} | {p.get('seconds', '—')} | {note} |")
    ts = r.get("test_summary", {})
    lines += ["", "## Tests", ""]
    if "missing" in ts:
        lines.append(f"No JUnit result ({ts['missing']}); see `tests.log`.")
    elif ts:
        lines.append(
            f"{ts['passed']} passed, {ts['failures']} failed, {ts['errors']} errors, "
            f"{ts['skipped']} skipped (of {ts['tests']})."
        )
        lines += [f"- {f}" for f in ts.get("failed", [])]
    bench_md = check.out / "bench-report.md"
    lines += ["", "## Benchmarks", ""]
    if bench_md.exists():
        text = bench_md.read_text(encoding="utf-8").splitlines()
        lines += ["#" + ln if ln.startswith("#") else ln for ln in text]  # one heading level down
    else:
        lines.append("No benchmark result; see `bench.log`.")
    lines += _accuracy_lines(check)
    lines += _probe_lines(check)
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("outdir", nargs="?", help="folder for report.md, gpu_check.json, logs and raw results")
    ap.add_argument("--budget", type=float, default=450.0, help="seconds for the whole check (default 450)")
    ap.add_argument(
        "--commit", default=os.environ.get("FGD_BENCH_COMMIT"), help="the commit under test, when the device has no git"
    )
    ap.add_argument("--cpu-dry-run", action="store_true", help="rehearse on a CPU: tiny shapes, a few tests")
    ap.add_argument(
        "--no-install", action="store_true", help="skip the pip installs (the package is installed already)"
    )
    ap.add_argument("--tests", help="pytest selection for the tests phase (default: tests; dry run: a few fast ones)")
    ap.add_argument("--no-probe", dest="probe", action="store_false", help="skip the Triton probe after the benchmarks")
    ap.add_argument(
        "--workers", type=int, default=8, help="pytest-xdist workers for the tests phase on a GPU (0: none)"
    )
    ap.add_argument("--digest", action="store_true", help="print this checkout's source digest and exit")
    args = ap.parse_args(argv)
    if args.digest:
        print(source_digest(ROOT))
        return 0
    if not args.outdir:
        ap.error("OUTDIR is required")
    check = Check(args)
    for phase in (build, tests, bench, accuracy, probe):
        try:
            phase(check)
        except Exception as exc:  # an orchestration bug must not lose the other phases
            check.result["phases"][phase.__name__] = {"ok": False, "error": repr(exc)}
            check.save()
    report(check)
    print((check.out / "report.md").read_text(encoding="utf-8"))
    return 0 if all(check.result["phases"].get(p, {}).get("ok") for p in ("tests", "bench")) else 1


if __name__ == "__main__":
    sys.exit(main())
