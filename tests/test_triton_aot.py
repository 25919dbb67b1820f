"""Every Triton kernel configuration the backend can select compiles ahead of time for real
GPUs (sm_80, sm_90) without spilling, with the Triton of this environment (3.8) and with the
GPU machine's Triton 3.6; and the backend never launches a configuration outside that set.
(In CI, sm_80 gets the smoke set with Triton 3.8: see :data:`FULL`.)"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
AOT = ROOT / "kernels" / "aot.py"
TRITON36 = ROOT / ".venv-triton36" / "bin" / "python"

triton = pytest.importorskip("triton", reason="Triton is not installed")
_spec = importlib.util.spec_from_file_location("fgd_fast_aot", AOT)  # a developer tool: not in the wheel
aot = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(aot)


def _clean_env() -> dict:
    return {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compile, not interpret


def _compile_all(python: str, tmp_path: Path, extra=(), archs=("80", "90")) -> list[dict]:
    out = tmp_path / f"aot-{'-'.join(archs)}.json"
    run = subprocess.run(
        [python, str(AOT), "--arch", *archs, "--json", str(out), *extra],
        capture_output=True,
        text=True,
        timeout=3000,
        cwd=ROOT,
        env=_clean_env(),
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    return json.loads(out.read_text())


def _check(results, archs=2, **selection):
    assert len(results) == archs * len(aot.select(aot.configurations(), **selection))
    assert all(r["stack"] == 0 and "error" not in r for r in results)
    for r in results:
        sass = r["sass"]
        if aot.expects_tensor_cores(r["config"]):
            # the products run on tensor cores: HGMMA (wgmma) on sm_90, HMMA (mma.sync) on sm_80
            # (the middle's 32-row product tiles: HMMA on both)
            assert aot.tensor_cores_ok(r), r
        elif (
            # (elementwise kernels have no products to check)
            r["kernel"] not in ("tc_split_kernel", "guard_choose_kernel", "gram_gather_kernel", "guard_blend_kernel")
            and r["kernel"] != "mid_prep_kernel"
            and r["config"].get("ACC", "fp32") == "fp32"
        ):
            assert sass["hgmma"] == sass["hmma"] == 0 and sass["ffma"] > 0, r  # "ieee": CUDA-core FMA
    # the aligned tensor-core Gram and update passes load their operands (M included) and store
    # their results 16 bytes at a time
    for kernel in ("tc_gram_kernel", "tc_update_kernel"):
        aligned = [r for r in results if r["kernel"] == kernel and r["config"]["ALIGNED"] == "True"]
        assert aligned and all(r["sass"]["loads_128"] > 0 for r in aligned), kernel
        assert all(r["sass"]["stores_128"] > 0 for r in aligned), kernel
    # hi and lo rows are 16-byte aligned in every class (padded to LD_ALIGN): the split pass stores
    # them 16 bytes at a time where they are contiguous along n (θ = W2ᵀ), aligned class or not
    split = [r for r in results if r["kernel"] == "tc_split_kernel" and r["config"]["ROWS"] == "True"]
    assert split and all(r["sass"]["stores_128"] > 0 for r in split)


#: every configuration for both architectures on a GPU machine (its session runs this file) or
#: with FGD_AOT_FULL=1; elsewhere (CI) every configuration for sm_90 — the GPU machine's
#: architecture, where the one spill this check has found was — and the smoke set for sm_80
FULL = torch.cuda.is_available() or os.environ.get("FGD_AOT_FULL") == "1"


def test_every_selectable_configuration_compiles_without_spills(tmp_path):
    if FULL:
        _check(_compile_all(sys.executable, tmp_path))
        return
    _check(_compile_all(sys.executable, tmp_path, archs=("90",)), archs=1)
    _check(_compile_all(sys.executable, tmp_path, ["--smoke"], archs=("80",)), archs=1, smoke=True)


@pytest.mark.skipif(not TRITON36.exists(), reason="no .venv-triton36 (bash .ci/setup-env creates it)")
def test_gpu_machine_triton_compiles_the_tensor_core_and_one_of_each_other_configuration(tmp_path):
    """The GPU machine's Triton (3.6) on every tensor-core configuration and one of each other
    (kernel, dtype) (API drift between versions shows there); the GPU session compiles the
    whole set with that Triton (tests/test_triton_aot.py is in its test phase)."""
    version = subprocess.run(
        [str(TRITON36), "-c", "import triton; print(triton.__version__)"],
        capture_output=True,
        text=True,
        env=_clean_env(),
    )
    assert version.stdout.strip() == "3.6.0", version.stderr
    _check(_compile_all(str(TRITON36), tmp_path, ["--smoke"]), smoke=True)


def test_sass_counts_tell_16_byte_copies_from_cache_hints():
    """The SASS counts the check reads: every product form, and 16-byte copies told from 4- and
    8-byte ones (``LTC128B`` is an L2 prefetch hint on a copy of any width)."""
    sass = """
        /*0100*/                   HGMMA.64x128x8.F32.TF32 gdesc[UR4], RZ, !UPT ;
        /*0110*/                   HMMA.1684.F32.TF32 R4, R8, R12, R4 ;
        /*0120*/                   FFMA R3, R2, R5, R3 ;
        /*0130*/                   DFMA R4, R6, R8, R4 ;
        /*0140*/                   LDGSTS.E.BYPASS.LTC128B.128 [R5], desc[UR6][R2.64] ;
        /*0150*/                   LDGSTS.E.LTC128B [R7], desc[UR6][R2.64] ;
        /*0160*/                   LDG.E.128.CONSTANT R4, desc[UR4][R2.64] ;
        /*0170*/                   LDG.E.64 R8, desc[UR4][R2.64] ;
        /*0180*/                   STG.E.128 desc[UR4][R2.64], R4 ;
        /*0190*/                   STG.E desc[UR4][R2.64], R4 ;
        /*01a0*/                   FMUL R3, R2, R5 ;
    """
    assert aot.sass_counts(sass) == dict(hgmma=1, hmma=1, ffma=1, dfma=1, loads_128=2, stores_128=1)


def test_the_check_fails_errors_spills_and_tensor_core_configurations_without_tensor_cores():
    """What makes ``kernels/aot.py`` exit non-zero, on made-up reports: a compile error, a spill,
    a tensor-core Gram or update configuration without HGMMA on sm_90 (HMMA is not enough there:
    wgmma is the point) or without HMMA on sm_80; the middle's products may take HMMA on sm_90,
    and an IEEE or float64 configuration, the split pass, need no tensor cores."""
    ops = dict(hgmma=0, hmma=0, ffma=0, dfma=0, loads_128=0, stores_128=0)
    tc = dict(kernel="tc_gram_kernel", config={"PRECISION": "tf32", "ROWS": "True"}, stack=0)
    good = [
        dict(tc, arch=90, sass=dict(ops, hgmma=4)),
        dict(tc, arch=80, sass=dict(ops, hmma=8)),
        dict(
            kernel="mid_mm_kernel",
            arch=90,
            config={"PRECISION": "tf32", "ACC": "fp32"},
            stack=0,
            sass=dict(ops, hmma=2),
        ),
        dict(
            kernel="gram_kernel", arch=90, config={"PRECISION": "ieee", "ACC": "fp32"}, stack=0, sass=dict(ops, ffma=9)
        ),
        dict(
            kernel="gram_kernel", arch=90, config={"PRECISION": "tf32", "ACC": "fp64"}, stack=0, sass=dict(ops, dfma=9)
        ),
        dict(kernel="tc_split_kernel", arch=90, config={"LO": "True"}, stack=0, sass=ops),
    ]
    bad = [
        dict(tc, arch=90, sass=dict(ops, hmma=8)),
        dict(tc, arch=80, sass=dict(ops, ffma=64)),
        dict(tc, kernel="tc_update_kernel", arch=90, sass=dict(ops, ffma=64)),
        dict(tc, arch=90, stack=16, sass=dict(ops, hgmma=4)),
        dict(kernel="gram_kernel", arch=90, config={}, error="CompilationError('…')"),
    ]
    assert aot.failures(good) == []
    assert aot.failures(good + bad) == bad


def test_backend_launches_only_checked_configurations(monkeypatch):
    if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("records launches under the CPU interpreter")
    import numpy as np

    import fgd_fast
    from fgd_fast.backends import triton_launch

    allowed = {
        (name, json.dumps({k: str(v) for k, v in consts.items()}, sort_keys=True), json.dumps(cfg, sort_keys=True))
        for name, consts, cfg in aot.configurations()
    }
    seen = []
    real = triton_launch.launch

    def record(kernel, grid, *args, **kw):
        keys = ("DTYPE", "ACC", "ROWS", "ALIGNED", "LO", "PRECISION", "BLOCK", "MODE", "HAS_PHI", "W_MODE")
        keys += ("PREDICT", "MIRROR", "UPPER", "TX", "HAS_Z", "FULL", "FEEDBACK", "HYPER", "GUARD")
        consts = {k: kw[k] for k in keys if k in kw}
        consts = {k: (str(v).removeprefix("tl.") if k in ("DTYPE", "ACC") else v) for k, v in consts.items()}
        consts = {
            k: {"fp32": "float32", "fp64": "float64", "fp16": "float16", "bf16": "bfloat16"}.get(v, v)
            for k, v in consts.items()
        }
        cfg = {
            k: v
            for k, v in kw.items()
            if k in ("BP", "BM", "BK", "BR", "BN", "BS", "BL", "BT", "num_warps", "num_stages")
        }
        seen.append(
            (
                kernel.fn.__name__,
                json.dumps({k: str(v) for k, v in consts.items()}, sort_keys=True),
                json.dumps(cfg, sort_keys=True),
            )
        )
        return real(kernel, grid, *args, **kw)

    monkeypatch.setattr(triton_launch, "launch", record)
    rng = np.random.default_rng(0)
    cases = [
        (torch.float32, 0.9, "tf32x3"),
        (torch.float32, 0.0, "tf32"),
        (torch.float32, 0.9, "ieee"),
        (torch.bfloat16, 0.0, "ieee"),
        (torch.bfloat16, 0.9, "tf32x3"),
        (torch.float64, 0.9, "tf32"),
    ]
    for dtype, momentum, precision in cases:
        params = [
            torch.nn.Parameter(fgd_fast.orthogonalize_(torch.tensor(rng.standard_normal(s), dtype=dtype)))
            for s in [(8, 4, 3, 3), (20, 6)]
        ]
        opt = fgd_fast.FGD(
            [dict(params=params, orthogonal=True)], lr=0.01, momentum=momentum, backend="triton", precision=precision
        )
        for _ in range(2):
            for p in params:
                p.grad = torch.randn_like(p)
            opt.step()
    assert seen and set(seen) <= allowed, sorted(set(seen) - allowed)[:3]
    assert {name for name, _, _ in seen} >= {"tc_split_kernel", "tc_gram_kernel", "tc_update_kernel", "gram_kernel"}
