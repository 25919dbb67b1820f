"""Smoke test of the benchmark suite (``benchmarks/``): every case runs once on tiny shapes,
the report renders from both of its input formats, ``benchmarks/gpu/gpu_check.py`` keeps what it
measured when a phase fails or runs out of time, and the accuracy run reports against the
reference form. The benchmarks themselves are not part of
the test run (``testpaths = tests``); this only checks that they work."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
ALWAYS = {
    "fgd-auto",
    "fgd-reference",
    "fgd-torch",
    "fgd-torch-tf32x3",
    "cayley-sgd-lowrank",
    "cayley-sgd-dense",
    "cayley-adam-lowrank",
    "torch-orthogonal",
    "sgd",
}


@pytest.fixture(scope="module")
def bench_modules():
    from benchmarks import report
    from benchmarks.gpu import gpu_check
    from benchmarks.test_optimizer_step import CASES

    return report, gpu_check, CASES


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """The suite at ``--bench-scale tiny`` (one round, 3 stability steps per case)."""
    out = tmp_path_factory.mktemp("bench")
    # not as an xdist worker: pytest-benchmark disables itself when PYTEST_XDIST_WORKER is set
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env.update(FGD_BENCH_THREADS="1", OMP_WAIT_POLICY="PASSIVE", PYTHONUNBUFFERED="1")
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "benchmarks",
        "-q",
        "-p",
        "no:cacheprovider",
        "--bench-scale",
        "tiny",
        f"--benchmark-json={out / 'run.json'}",
        f"--bench-record={out / 'run.jsonl'}",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert (out / "run.json").stat().st_size, "pytest-benchmark wrote no JSON:\n" + (proc.stdout + proc.stderr)[-4000:]
    return out


def test_every_case_runs_once_or_says_why_not(tiny_run, bench_modules):
    from benchmarks.contenders import _default_precision, contender

    _, _, cases = bench_modules
    data = json.loads((tiny_run / "run.json").read_text())
    ran = {(b["extra_info"]["workload"], b["extra_info"]["contender"]): b for b in data["benchmarks"]}
    skipped = {(s["workload"], s["contender"]): s["reason"] for s in data["fgd_bench"]["skips"]}
    assert set(ran) | set(skipped) == set(cases) and not set(ran) & set(skipped)
    assert all(reason for reason in skipped.values())
    assert {c for _, c in ran} >= ALWAYS
    if not torch.cuda.is_available():
        assert {c for _, c in skipped} <= {
            "fgd-triton",
            "fgd-triton-tf32x3",
            "fgd-triton-tf32",
            "fgd-cuda",
            "fgd-torch-tf32",
            "geoopt-qr",
            "geoopt-canonical",
        }
    for (w, c), b in ran.items():
        info = b["extra_info"]
        assert b["stats"]["median"] > 0 and b["stats"]["rounds"] == 1
        stab = info["stability"]
        assert stab.get("same_as") == "fgd-auto" if "skipped" in stab else stab["steps"] == 3, (w, c, stab)
        assert info["peak_extra_bytes"] >= 0 and info["memory_method"]
        assert (info.get("cost") is not None) == (info["family"] in ("fgd", "sgd")), (w, c)
        # FGD's host budget: its aten ops (and Triton launches) and host time per step
        assert ("ops_per_step" in info) == (info["family"] == "fgd"), (w, c)
        if info["family"] == "fgd":
            assert info["ops_per_step"] + info["launches_per_step"] > 0 and info["host_s"] > 0, (w, c)
            # the precision FGD runs at (a review found fgd-reference recorded at the default "tf32x3")
            made = contender(c).precision or _default_precision(contender(c).backend)
            assert info["precision"] == made, (w, c, info["precision"], made)
        if c != "sgd" and "max" in stab:
            assert stab["max"] < 1e-4, (w, c, stab)  # every constrained contender stays on the manifold
    session = data["fgd_bench"]
    assert session["rates"]["matmul_flops"] > 0 and session["rates"]["copy_bytes_per_s"] > 0
    assert session["environment"]["torch"] == torch.__version__ and session["environment"]["commit"]["id"]


def test_report_renders_from_json_and_from_the_case_record(tiny_run, bench_modules, capsys):
    report, _, _ = bench_modules
    for source in ("run.json", "run.jsonl"):
        md = tiny_run / f"{source}.md"
        assert report.main([str(tiny_run / source), "-o", str(md)]) == 0
        text = md.read_text()
        assert "## Step time" in text and "| fgd-auto | " in text and "(1.00×)" in text
        assert "measured rates" in text and "commit" in text and "## Stability" in text
    capsys.readouterr()


def test_gpu_check_keeps_results_of_failed_and_timed_out_phases(tmp_path, bench_modules):
    _, gpu_check, _ = bench_modules
    args = argparse.Namespace(
        outdir=str(tmp_path),
        work=str(tmp_path / "work"),
        budget=120.0,
        commit="abc",
        cpu_dry_run=True,
        no_install=True,
        tests=None,
        digest=False,
        phases=None,
        first_cases=None,
        accuracy_cases=None,
    )
    check = gpu_check.Check(args)
    slow = check.run("slow", [sys.executable, "-c", "import time; time.sleep(60)"], timeout=1)
    assert slow["timed_out"] and not slow["ok"] and slow["seconds"] < 30
    bad = check.run("bad", [sys.executable, "-c", "raise SystemExit(3)"], timeout=30)
    assert bad["rc"] == 3 and not bad["ok"]
    saved = json.loads((tmp_path / "gpu_check.json").read_text())  # published after every phase
    assert set(saved["phases"]) == {"slow", "bad"} and saved["source_digest"]
    text = (tmp_path / "report.md").read_text()
    assert "| slow | no |" in text and "timed out" in text and "No benchmark report" in text
    assert (tmp_path / "logs.tgz").stat().st_size > 0


def test_accuracy_run_reports_max_distance_against_the_reference_form(tmp_path, bench_modules):
    from benchmarks.gpu import accuracy

    out = tmp_path / "accuracy.json"
    cases = ["fgd-reference", "fgd-torch-tf32x3", "fgd-triton-tf32x3"]
    argv = [str(out), "--cpu-dry-run", "--steps", "3", "--every", "2", "--workloads", "vgg-16", "--cases", *cases]
    assert accuracy.main(argv) == 0
    data = json.loads(out.read_text())
    by_case = {r["case"]: r for r in data["results"]}
    assert data["steps"] == 3 and set(by_case) == set(cases)
    assert all(r["steps"] == 3 for r in data["results"] if "max" in r)
    ref = by_case["fgd-reference"]
    assert 0 < ref["max"] < 1e-4 and ref["final"] <= ref["max"]
    for name in cases[1:]:
        r = by_case[name]
        if "skipped" not in r:  # the Triton case runs where Triton (or its interpreter) does
            assert r["max_vs_reference"] == pytest.approx(r["max"] / ref["max"])
    assert "| vgg-16 | fgd-reference |" in data["table"]


def test_accuracy_run_does_not_run_the_code_of_fgd_auto_twice(tmp_path):
    """A review: on a GPU ``fgd-auto`` is ``fgd-triton-tf32x3``, and the accuracy phase ran both,
    the same distances at twice the time of a 55 s phase. The second is recorded as the same."""
    from benchmarks.gpu import accuracy

    out = tmp_path / "accuracy.json"
    cases = ["fgd-auto", "fgd-torch-tf32x3", "fgd-torch"]  # (a CPU: auto is torch at tf32x3)
    argv = [str(out), "--cpu-dry-run", "--steps", "2", "--every", "2", "--workloads", "vgg-16", "--cases", *cases]
    assert accuracy.main(argv) == 0
    by_case = {r["case"]: r for r in json.loads(out.read_text())["results"]}
    assert by_case["fgd-torch-tf32x3"] == dict(
        workload="vgg-16", case="fgd-torch-tf32x3", skipped="the same code as fgd-auto here", same_as="fgd-auto"
    )
    assert by_case["fgd-auto"]["steps"] == 2 and by_case["fgd-torch"]["steps"] == 2


def test_communication_model_counts_what_the_row_all_reduce_sends():
    """The distributed report's model (benchmarks/studies/dist_comm.py): per row-sharded layer
    the all-reduce carries A, C and UᵀU as triangles, E and B whole and ‖g‖² (ring: 2(R−1)/R);
    the gather (R−1)/R of θ, Φ and g; the owner path θ, g, Φ out and θ₊, Φ₊ back, (R−1)/R² of
    each on average, the busiest rank (the one owner of one matrix) receives 3np(R−1)/R; a layer no
    rank count divides is not a row shard; auto's choice, at its busiest rank, and its collectives."""
    from benchmarks.studies.dist_comm import llama_7b_blocks, volume

    ranks, p, n = 8, 64, 64 * 9
    v = volume([(p, p, 3, 3)], ranks)  # θ = W2ᵀ: n = 576, p = 64; dim 1 (64) divisible by 8
    ring = (ranks - 1) / ranks
    assert v["rows, triangles"] == v["fgd_fast auto"] == 2 * ring * (2 * p * p + 3 * p * (p + 1) / 2 + 1) * 4
    assert v["all-gather"] == ring * 3 * n * p * 4
    assert v["owner"] == pytest.approx(5 * n * p * 4 * (ranks - 1) / ranks**2)
    assert v["owner, busiest rank"] == pytest.approx(3 * n * p * 4 * ring)  # the owner gets 3np·ring (sends 2np·ring)
    assert v["auto calls"] == 2  # the agreement and the row all-reduce
    odd = volume([(16, 3, 3, 3)], ranks)  # θ = W2ᵀ, no input dimension divisible by 8: owner path
    assert odd["rows, triangles"] == odd["all-gather"]
    assert odd["fgd_fast auto"] == odd["owner, busiest rank"] == 3 * 27 * 16 * 4 * ring  # its owner receives it
    assert odd["auto calls"] == 4  # the agreement, two all-to-alls, the checks
    square = volume([(1024, 1024)] * 8, ranks)  # auto sends them to owners: less than the triangles
    assert square["fgd_fast auto"] == square["owner, busiest rank"] < square["rows, triangles"]
    for shapes in ([(64, 64, 3, 3)] * 3 + [(1024, 1024)] * 5, llama_7b_blocks()[:20]):
        v = volume(shapes, 64)  # never worse than summing every row shard
        assert v["fgd_fast auto"] <= v["rows, triangles"]
    assert len(llama_7b_blocks()) == 224


def test_middle_share_times_the_middle_inside_the_step():
    """benchmarks/studies/middle_share.py: the middle's timer sees a part of the FGD step (not
    zero, not all of it) and is taken off again."""
    from benchmarks.studies.middle_share import step_and_middle, transposed_add
    from benchmarks.workloads import workloads
    from fgd_fast.backends import algebra, torch_groups

    t = step_and_middle(workloads("tiny")[0], rounds=1)
    assert 0 < t["middle"] < t["fgd"] and t["cayley"] > 0
    assert torch_groups.middle is algebra.middle
    assert all(x > 0 for x in transposed_add(reps=2))


@pytest.mark.parametrize("name", ["fgd-torch", "cayley-sgd-lowrank"])
def test_op_time_sees_every_product_of_the_step(name):
    """benchmarks/studies/op_time.py: its timed products add up to the flops that torch_calls
    counts for the same step, and every class of op gets some time."""
    from benchmarks.studies.op_time import profile
    from benchmarks.studies.torch_calls import counts
    from benchmarks.workloads import workloads

    w = workloads("tiny")[1]
    plain, timed = profile(name, w, steps=2)
    assert plain > 0
    assert sum(timed.flops.values()) / 2 == counts(name, w)[2]  # (the same steady step, twice)
    assert all(timed.seconds[k] > 0 for k in ("small ops", "views"))
    assert all(timed.seconds[k] > 0 for k in timed.flops)


def test_step_ratio_runs_the_workloads_asked_for(capsys):
    """benchmarks/studies/step_ratio.py: ``--workloads`` runs only the workloads named, in that
    order, one line each with both contenders' ratios; an index out of range is refused."""
    from benchmarks.studies.step_ratio import main
    from benchmarks.workloads import workloads

    tiny = workloads("tiny")
    main(["--scale", "tiny", "--rounds", "1", "--contenders", "fgd-torch", "sgd", "--base", "sgd", "--workloads", "1"])
    lines = capsys.readouterr().out.strip().splitlines()[1:]
    assert [line.split(":")[0] for line in lines] == [tiny[1].description]
    assert re.search(r"fgd-torch [\d.]+ \S+ \([\d.]+×, [\d.]+×\), sgd [\d.]+ \S+ \(1\.00×, 1\.00×\)$", lines[0])
    with pytest.raises(SystemExit):
        main(["--scale", "tiny", "--workloads", str(len(tiny))])
    argv = ["--scale", "tiny", "--rounds", "1", "--contenders", "fgd-torch", "sgd", "--base", "sgd", "--workloads", "0"]
    main([*argv, "--markdown"])  # (its header names the arguments it ran with: a review found them left out)
    assert f"`python -m benchmarks.studies.step_ratio {' '.join(argv)} --markdown`" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("resolved", "precision", "twin"),
    [
        ("torch", "tf32x3", "fgd-torch-tf32x3"),
        ("triton", "tf32x3", "fgd-triton-tf32x3"),
        ("torch", "ieee", "fgd-torch"),
    ],
)
def test_the_noise_note_pairs_auto_with_the_contender_that_runs_its_code(bench_modules, resolved, precision, twin):
    """A review: the report paired ``fgd-auto`` with ``fgd-<backend>`` whatever its precision, so
    on a GPU (auto: Triton at tf32x3; ``fgd-triton``: ieee) a 2.6× precision gap was called the
    machine's noise. The note now takes the contender at auto's own backend and precision."""
    report, _, _ = bench_modules
    cases = [
        dict(workload="w", contender=name, precision=prec, stats=dict(median=ms))
        for name, prec, ms in [
            ("fgd-auto", precision, 6.9),
            (f"fgd-{resolved}", "ieee", 18.0),
            (f"fgd-{resolved}-tf32x3", "tf32x3", 7.2),
        ]
    ]
    run = dict(session=dict(settings=dict(fgd_auto_resolves_to=resolved)), cases=cases)
    assert report.same_code_as_auto(run) == twin
    assert report.same_code_as_auto(dict(session={}, cases=cases)) is None


def test_every_contender_has_its_row_and_times_change_unit_after_rounding():
    """A review: ``fgd-torch-carried`` had no place in the report's row order (it came last, after
    ``sgd``), and 0.9996 s printed as "1e+03 ms"."""
    from benchmarks.contenders import CONTENDERS
    from benchmarks.report import ORDER, _time

    assert [c.name for c in CONTENDERS if c.name not in ORDER] == []
    assert (_time(0.9996), _time(0.0009996), _time(0.0123), _time(4.2e-6)) == ("1.00 s", "1 ms", "12.3 ms", "4.2 µs")


def test_op_counts_prints_the_counted_step(capsys):
    """benchmarks/studies/op_counts.py (the README's op counts): one row per backend with the
    counter's total for the op-count test's set."""
    from benchmarks.opcount import count_wrn_style_step
    from benchmarks.studies.op_counts import main

    main(["--backends", "torch"])
    total = sum(count_wrn_style_step("torch")[0].values())
    assert re.search(rf"^\| torch \| {total} \| 0 \| {total} \| bmm \d+", capsys.readouterr().out, re.M)


def test_step_ratio_puts_every_contender_in_every_place():
    """The interleaved rounds' order (a review found the middle contenders of an order that was
    only reversed never first or last): over 2k rounds each of k contenders runs in each place
    equally often, and before each other one equally often."""
    from benchmarks.studies.step_ratio import round_order

    names = ["a", "b", "c", "d"]
    orders = [round_order(names, r) for r in range(2 * len(names))]
    assert all(sorted(o) == names for o in orders)
    for n in names:
        assert sorted(o.index(n) for o in orders) == sorted(list(range(len(names))) * 2), n
    for x in names:
        for y in names:
            if x != y:
                assert sum(o.index(x) < o.index(y) for o in orders) == len(names), (x, y)
