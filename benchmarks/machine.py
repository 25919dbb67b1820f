"""What a benchmark ran on, and what that machine can do (one concern: the machine).

:func:`environment` records the device, its name and driver, the library versions and the git
commit; :func:`device_rates` measures, in the same run as the benchmarks, the two rates the
cost model divides by: the fp32 matmul rate (TF32 off) and the copy bandwidth (bytes read +
written per second).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.sources import SOURCE_DIRS, TOP_FILES, source_digest

__all__ = ["environment", "describe", "bench_device", "device_rates", "git_commit"]

ROOT = Path(__file__).resolve().parent.parent
#: where the code that a benchmark runs lives (an untracked file there makes the checkout dirty)
SOURCES = (*SOURCE_DIRS, *TOP_FILES, "pyproject.toml")  # (the source digest's, so both see a new test file)


def _run(cmd: list[str], cwd: Path | None = None) -> str | None:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=20, cwd=cwd)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def git_commit() -> dict[str, object]:
    """``{"id", "dirty", "source"}``: ``FGD_BENCH_COMMIT`` when set, else the checkout's HEAD.

    The explicit value wins: a copied working tree (the GPU machine's) can carry a ``.git``
    whose HEAD is older than the files; the source digest identifies the files either way.
    ``dirty`` counts changes to tracked files outside ``benchmarks/results/``: the results a
    run writes there (``run.sh --update-results``) are its output, not a change to what ran.
    """
    given = os.environ.get("FGD_BENCH_COMMIT")
    if given:
        return {"id": given, "dirty": None, "source": "FGD_BENCH_COMMIT"}
    commit = _run(["git", "rev-parse", "HEAD"], ROOT)
    if commit:
        outputs = ":(exclude)benchmarks/results"
        status = _run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".", outputs], ROOT)
        # and new source files git does not know yet (a new module changes what runs)
        new = _run(["git", "ls-files", "--others", "--exclude-standard", "--", *SOURCES, outputs], ROOT)
        return {"id": commit, "dirty": bool(status) or bool(new), "source": "git"}
    return {"id": "unknown", "dirty": None, "source": "no git checkout and FGD_BENCH_COMMIT unset"}


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def version_of(module: str) -> str:
    """``module.__version__``, or "not installed" (also where importing it fails)."""
    try:
        return __import__(module).__version__
    except Exception:  # not installed, or broken
        return "not installed"


def bench_device() -> torch.device:
    """The device the benchmarks run on: ``FGD_BENCH_DEVICE`` if set (``cpu`` benchmarks the CPU
    of a GPU machine), else the GPU where there is one, else the CPU."""
    return torch.device(os.environ.get("FGD_BENCH_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu"))


def describe(env: dict) -> str:
    """One header line for a study's output: where it ran and on which code (device name,
    threads, load, versions, commit with its state, source digest)."""
    commit = env.get("commit", {})
    state = {True: " with uncommitted changes", False: "", None: " (uncommitted changes unknown)"}
    where, threads = env.get("gpu") or env.get("cpu"), env.get("torch_threads")
    return (
        f"{where} | {threads} thread{'' if threads == 1 else 's'} | load {env.get('load_average')} | "
        f"torch {env.get('torch')} | "
        f"triton {env.get('triton')} | commit {str(commit.get('id', '?'))[:7]}{state.get(commit.get('dirty'), '')} | "
        f"source digest {env.get('source_digest', '?')}"
    )


def environment(device: torch.device) -> dict[str, object]:
    """Device, names, driver, versions, threads, load and commit, as plain JSON values."""
    env: dict[str, object] = {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S"),
        "device": device.type,
        "cpu": _cpu_name(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "unset"),
        "load_average": [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None,
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "triton": version_of("triton"),
        "numpy": version_of("numpy"),
        "geoopt": version_of("geoopt"),
        "commit": git_commit(),
        "source_digest": source_digest(ROOT),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        smi = _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
        env.update(
            gpu=props.name,
            gpu_memory_gib=round(props.total_memory / 2**30, 1),
            compute_capability=f"{props.major}.{props.minor}",
            cuda=torch.version.cuda,
            driver=smi.splitlines()[0] if smi else "unknown (nvidia-smi unavailable)",
        )
    return env


def median_seconds(fn: Callable[[], None], device: torch.device, repeat: int) -> float:
    """The median time of ``fn()`` over ``repeat`` calls after a warm-up (on a GPU, by CUDA events
    around each call; on a CPU, by the wall clock)."""
    fn()  # warm-up
    if device.type == "cuda":
        fn()
        times = []
        for _ in range(repeat):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        return statistics.median(times)
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


@contextlib.contextmanager
def _ieee_fp32_matmul():
    """CUDA fp32 matmuls in full fp32 (no TF32) inside the block, with either torch API."""
    matmul = torch.backends.cuda.matmul
    if hasattr(matmul, "fp32_precision"):  # torch >= 2.9
        before = matmul.fp32_precision
        matmul.fp32_precision = "ieee"
        try:
            yield
        finally:
            matmul.fp32_precision = before
    else:
        before = matmul.allow_tf32
        matmul.allow_tf32 = False
        try:
            yield
        finally:
            matmul.allow_tf32 = before


def _matmul_seconds(n: int, device: torch.device, gen: torch.Generator, reps: int) -> float:
    """Median time of an ``n³`` fp32 matmul; its operands are freed on return."""
    a = torch.randn(n, n, device=device, generator=gen)
    b = torch.randn(n, n, device=device, generator=gen)
    c = torch.empty(n, n, device=device)
    return median_seconds(lambda: torch.mm(a, b, out=c), device, reps)


def device_rates(device: torch.device, *, small: bool = False) -> dict[str, object]:
    """Measured fp32 matmul rate (flop/s, TF32 off) and copy bandwidth (bytes/s) of ``device``.

    GPU: an 8192³ matmul and a 1 GiB copy; CPU: a 2048³ matmul and a 256 MiB copy (larger
    than any cache); ``small`` shrinks both for smoke tests. Median of several runs.
    """
    gpu = device.type == "cuda"
    n = 256 if small else (8192 if gpu else 2048)
    copy_bytes = (4 if small else (1024 if gpu else 256)) * 2**20
    with _ieee_fp32_matmul():
        gen = torch.Generator(device=device).manual_seed(0)
        t_mm = _matmul_seconds(n, device, gen, 3 if small else (10 if gpu else 5))
        src = torch.randn(copy_bytes // 4, device=device, generator=gen)
        dst = torch.empty_like(src)
        t_copy = median_seconds(lambda: dst.copy_(src), device, 3 if small else 10)
    return {
        "matmul_flops": 2.0 * n**3 / t_mm,
        "matmul": f"fp32 {n}x{n}x{n} (TF32 off)",
        "copy_bytes_per_s": 2.0 * copy_bytes / t_copy,  # read + write
        "copy": f"{copy_bytes // 2**20} MiB copy_, read + write",
    }
