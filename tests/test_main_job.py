"""The main job (``bash benchmarks/run.sh``) end to end on tiny shapes and a few cases: one
progress line per benchmark case, the training comparison, a short summary, the full report
(with the training table) in the output folder, and nothing written into benchmarks/results/."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_main_job_tiny(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env.update(
        FGD_BENCH_NO_SETUP="1",
        FGD_BENCH_OUT=str(tmp_path),
        MPLBACKEND="Agg",
        PATH=os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", ""),
    )
    status = ["git", "status", "--porcelain", "--untracked-files=all", "--", "benchmarks/results"]
    before = subprocess.run(status, cwd=ROOT, capture_output=True, text=True).stdout
    cmd = ["bash", "benchmarks/run.sh", "--tiny", "-k", "transformer and (fgd-auto or fgd-triton or sgd)"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    progress = [line for line in proc.stdout.splitlines() if line.startswith("[") and "transformer/" in line]
    assert any(line.endswith("transformer/fgd-auto PASSED") for line in progress), out[-4000:]
    assert any(line.endswith("transformer/fgd-triton SKIPPED") for line in progress), out[-4000:]
    assert "== summary" in proc.stdout and "| fgd-auto |" in proc.stdout and "cayley-sgd" in proc.stdout
    reports = list(tmp_path.glob("*-tiny.md"))
    assert len(reports) == 1, sorted(p.name for p in tmp_path.iterdir())
    text = reports[0].read_text()
    assert "## Step time" in text and "## Training comparison: digits" in text and "| fgd (torch) |" in text
    train_dir = reports[0].with_name(reports[0].stem + "-train-digits")
    assert (train_dir / "train.json").is_file() and (train_dir / "train.png").is_file()
    after = subprocess.run(status, cwd=ROOT, capture_output=True, text=True).stdout
    assert after == before  # the committed results are untouched
