"""The CUDA extension (csrc/): compile checks that need no GPU, the graceful failure of
``backend="cuda"`` where it cannot run, and (on a GPU with the extension) kernel-specific
checks the shared backend tests do not reach: several tiles per p, split-n reduction,
both layouts, ragged layers in one launch, determinism and the launch count."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fgd_fast
from fgd_fast.backends import BackendUnavailable, compute_dtype, resolve_backend
from helpers import backend_reason

ROOT = Path(__file__).resolve().parent.parent
CSRC = ROOT / "csrc"
CU_FILES = sorted(CSRC.glob("*.cu"))


def _nvcc() -> str | None:
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if cuda_home and (Path(cuda_home) / "bin" / "nvcc").exists():
        return str(Path(cuda_home) / "bin" / "nvcc")
    return shutil.which("nvcc")


# ---------------------------------------------------------------- no GPU needed


def test_kernel_sources_exist_and_include_no_torch_headers():
    assert {p.name for p in CU_FILES} >= {"fgd_gram.cu", "fgd_update.cu"}
    for path in [*CU_FILES, *CSRC.glob("*.cuh"), *CSRC.glob("*.h")]:
        includes = re.findall(r'#include\s*[<"]([^>"]+)[>"]', path.read_text())
        assert not [i for i in includes if i.startswith(("ATen", "torch", "c10"))], (path.name, includes)


@pytest.mark.parametrize("arch", ["80", "90"])
@pytest.mark.parametrize("source", CU_FILES, ids=lambda p: p.name)
def test_cu_file_compiles_without_spills(source, arch, tmp_path):
    nvcc = _nvcc()
    if nvcc is None:
        pytest.skip("nvcc not found (set CUDA_HOME or put nvcc on PATH)")
    cmd = [
        nvcc,
        "-c",
        "-O3",
        "-std=c++17",
        f"-gencode=arch=compute_{arch},code=sm_{arch}",
        "--resource-usage",
        f"-I{CSRC}",
        str(source),
        "-o",
        str(tmp_path / "k.o"),
    ]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    report = run.stdout + run.stderr
    spills = re.findall(r"(\d+) bytes spill stores", report)
    assert spills and all(s == "0" for s in spills), report  # a spilling kernel is a performance bug


def _cuda_include() -> Path | None:
    """The CUDA toolkit's include directory (the one with ``cuda_runtime_api.h``), if any."""
    nvcc = _nvcc()
    homes = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    homes += [str(Path(nvcc).resolve().parent.parent)] if nvcc else []
    found = [Path(h) / "include" for h in homes if h and (Path(h) / "include" / "cuda_runtime_api.h").exists()]
    return found[0] if found else None


@pytest.mark.parametrize("std", ["c++17", "c++20"])
def test_the_binding_compiles_against_torchs_headers(std):
    """``fgd_binding.cpp`` (pybind11, the device guard, the current stream, TORCH_CHECK) compiles
    with g++ against this torch's headers and the CUDA runtime's, in both C++ standards torch's
    builds use (syntax only: a CPU torch has no libtorch_cuda to link against). It includes
    c10's CUDA headers only; ATen/cuda/CUDAContext.h would also need cuBLAS', cuSPARSE's and
    cuSOLVER's headers, which a toolkit with nvcc alone lacks."""
    import sysconfig

    from torch.utils.cpp_extension import include_paths

    gxx, cuda = shutil.which("g++"), _cuda_include()
    if gxx is None or cuda is None:
        pytest.skip(f"needs g++ and the CUDA runtime's headers (g++: {gxx}, CUDA include: {cuda})")
    torch_include = [Path(p) for p in include_paths()]
    # a CPU build of torch ships c10/cuda's headers without the file its CMake writes (export macros only)
    generated = any((p / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h").exists() for p in torch_include)
    cmd = [gxx, f"-std={std}", "-fsyntax-only", *[f"-I{p}" for p in torch_include]]
    cmd += [f"-I{sysconfig.get_paths()['include']}", f"-I{cuda}", f"-I{CSRC}", "-DTORCH_EXTENSION_NAME=_C"]
    cmd += ["-DTORCH_API_INCLUDE_EXTENSION_H"] + ([] if generated else ["-DC10_CUDA_NO_CMAKE_CONFIGURE_FILE"])
    run = subprocess.run([*cmd, str(CSRC / "fgd_binding.cpp")], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-6000:]


def test_a_built_extension_loads_with_the_backends_constants():
    """Where ``fgd_fast._C`` was built (``setup.py`` with ``FGD_FAST_BUILD_CUDA=1``; on a machine
    without a GPU, ``BUILD_CUDA=1 bash benchmarks/gpu/gpu_versions_on_cpu.sh`` builds it with nvcc
    under a CUDA torch): it loads without a GPU, carries these sources' hash, exports the
    binding's functions and the constants the cuda backend reads (its module checks the block
    order at import)."""
    try:
        from fgd_fast import _C
    except ImportError as exc:
        pytest.skip(f"fgd_fast._C is not built here ({exc}); BUILD_CUDA=1 gpu_versions_on_cpu.sh builds it")
    from fgd_fast import _cuda_build

    _cuda_build._result = None  # (loaded afresh)
    assert _cuda_build.load() is _C  # the sources' hash: not rebuilt just in time
    src = (CSRC / "fgd_binding.cpp").read_text()
    assert {name for name in re.findall(r'm\.def\("(\w+)"', src)} <= set(dir(_C))
    consts = _C.constants()
    assert set(re.findall(r'\bd\["(\w+)"\]', src)) == set(consts)
    assert set(re.findall(r'\bfields\["(\w+)"\]', src)) == set(consts["FIELDS"])
    from fgd_fast.backends import cuda

    assert cuda._K == consts and cuda._F["CHUNK"] == consts["META_FIELDS"] - 1


def test_import_never_needs_the_extension():
    out = subprocess.run(
        [sys.executable, "-c", "import fgd_fast, sys; print('fgd_fast._C' in sys.modules)"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"  # nothing loads or builds the extension at import


def test_cuda_backend_on_cpu_tensors_is_unavailable():
    with pytest.raises(BackendUnavailable, match="CUDA tensors"):
        resolve_backend("cuda", torch.device("cpu"))
    assert resolve_backend("auto", torch.device("cpu"))[0] == "torch"


@pytest.mark.skipif(torch.version.cuda is not None, reason="torch has CUDA: the extension may load here")
def test_cuda_backend_with_cpu_only_torch_says_why():
    with pytest.raises(BackendUnavailable, match="CPU-only build"):
        resolve_backend("cuda", torch.device("cuda"))
    from fgd_fast import _cuda_build

    with pytest.raises(ImportError, match="CPU-only build"):
        _cuda_build.load()


def test_a_rocm_torch_is_named_as_such(monkeypatch):
    """A review: a ROCm build of torch (``version.cuda`` None, devices named "cuda") was called
    a CPU-only build; the extension and setup.py name it."""
    from fgd_fast import _cuda_build

    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.version, "hip", "6.2.41133", raising=False)
    monkeypatch.setattr(_cuda_build, "_result", None)
    with pytest.raises(ImportError, match=r"ROCm \(HIP\) build.*backend='triton'"):
        _cuda_build.load()
    monkeypatch.setattr(_cuda_build, "_result", None)  # (not cached past this test)
    script = (
        "import runpy, sys, torch; torch.version.cuda, torch.version.hip = None, '6.2'; "
        "sys.argv = ['setup.py', '--version']; runpy.run_path('setup.py', run_name='__main__')"
    )
    env = {k: v for k, v in os.environ.items() if k != "FGD_FAST_BUILD_CUDA"}
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert run.returncode == 0 and "ROCm (HIP) build" in run.stdout, run.stdout + run.stderr


def test_a_prebuilt_extension_older_than_the_sources_is_not_used(monkeypatch, tmp_path):
    """A review: an editable install loaded the ``fgd_fast._C`` built by ``setup.py`` even after
    ``csrc/`` was edited (the kernels run were not the sources'). The build now carries a hash of
    the sources (``constants()["SOURCE_HASH"]``, one define for both compilers) and a ``_C``
    with another is passed over for the just-in-time build (here: no toolkit, so the message)."""
    import types

    from fgd_fast import _cuda_build

    here = _cuda_build.source_hash()
    assert isinstance(here, int) and 0 <= here < 2**60
    assert _cuda_build.hash_define() == [f"-DFGD_SOURCE_HASH={here}LL"]
    copy = tmp_path / "csrc"
    shutil.copytree(CSRC, copy)
    assert _cuda_build.source_hash(copy) == here
    (copy / "fgd_gram.cu").write_text((copy / "fgd_gram.cu").read_text() + "\n// edited\n")
    assert _cuda_build.source_hash(copy) != here
    (copy / "fgd_cuda.h").unlink()
    assert _cuda_build.source_hash(copy) is None and _cuda_build.hash_define(copy) == []

    from torch.utils import cpp_extension

    monkeypatch.setattr(torch.version, "cuda", "12.4")
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", None)
    for built, used in ((here, True), (here + 1, False), (None, False)):  # (None: built before the hash)
        fake = types.ModuleType("fgd_fast._C")
        fake.constants = lambda built=built: {} if built is None else {"SOURCE_HASH": built}
        monkeypatch.setitem(sys.modules, "fgd_fast._C", fake)
        monkeypatch.setattr(fgd_fast, "_C", fake, raising=False)
        monkeypatch.setattr(_cuda_build, "_result", None)
        if used:
            assert _cuda_build.load() is fake
            continue
        with pytest.raises(ImportError, match=r"built from other sources.*no CUDA toolkit"):
            _cuda_build.load()
    monkeypatch.setattr(_cuda_build, "_result", None)  # (not cached past this test)


def test_binding_and_build_share_the_source_hash_define():
    """The binding exports the define the build passes, and the header gives it a default."""
    assert 'd["SOURCE_HASH"] = (long long)FGD_SOURCE_HASH;' in (CSRC / "fgd_binding.cpp").read_text()
    assert "#ifndef FGD_SOURCE_HASH" in (CSRC / "fgd_cuda.h").read_text()
    setup = (ROOT / "setup.py").read_text()
    assert '"cxx": ["-O3", *cb.hash_define()]' in setup and "cb.NVCC_FLAGS + cb.hash_define()" in setup


def test_a_fused_backend_refuses_tensors_of_two_gpus():
    """A review: one launch reads every layer through one device's pointers; a direct call with
    layers on two GPUs would read the other's memory. Refused (fgd() and FGD group per device)."""
    from types import SimpleNamespace

    from fgd_fast.backends.base import needs_cuda

    on = lambda i: SimpleNamespace(device=torch.device("cuda", i))  # noqa: E731
    needs_cuda("cuda", [on(1), on(1)])
    with pytest.raises(ValueError, match="cuda:0, cuda:1; call it per device"):
        needs_cuda("cuda", [on(0), on(1)])


def _setup_py(env_value: str | None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop("FGD_FAST_BUILD_CUDA", None)
    if env_value is not None:
        env["FGD_FAST_BUILD_CUDA"] = env_value
    return subprocess.run(
        [sys.executable, "setup.py", "--version"], capture_output=True, text=True, timeout=120, cwd=ROOT, env=env
    )


def test_setup_py_skips_the_extension_when_told():
    run = _setup_py("0")
    assert run.returncode == 0, run.stderr
    assert "FGD_FAST_BUILD_CUDA=0: not building" in run.stdout


@pytest.mark.skipif(torch.version.cuda is not None, reason="torch has CUDA: setup.py would build the extension")
def test_setup_py_with_cpu_torch_skips_with_one_line_or_fails_when_forced():
    run = _setup_py(None)
    assert run.returncode == 0, run.stderr
    assert len([ln for ln in run.stdout.splitlines() if "skipping the CUDA extension" in ln]) == 1
    assert "CPU-only build" in run.stdout
    # (no just-in-time build can follow with a CPU torch: the line says what backend='cuda' needs)
    assert "needs a CUDA build of torch" in run.stdout and "on first use" not in run.stdout
    forced = _setup_py("1")
    assert forced.returncode != 0 and "cannot be built" in (forced.stdout + forced.stderr)


# setup.py run as pip runs it, with torch made to look like a CUDA build beside a toolkit on a
# machine without a GPU (a build node, a container build): torch's own build would raise while
# choosing the architectures, and an optional extension does not catch that
_FAKE_CUDA_TORCH = """
import runpy, sys
import torch, torch.utils.cpp_extension as ce
torch.version.cuda, ce.CUDA_HOME = "13.0", "/nonexistent/cuda"
torch.cuda.is_available = lambda: False
sys.argv = ["setup.py", "--version"]
runpy.run_path("setup.py", run_name="__main__")
"""


@pytest.mark.parametrize("arch_list", [None, "9.0"])
@pytest.mark.parametrize("mode", [None, "1"])
def test_setup_py_without_a_gpu_needs_an_arch_list(arch_list, mode):
    env = {k: v for k, v in os.environ.items() if k not in ("FGD_FAST_BUILD_CUDA", "TORCH_CUDA_ARCH_LIST")}
    env.update({"FGD_FAST_BUILD_CUDA": mode} if mode else {})
    env.update({"TORCH_CUDA_ARCH_LIST": arch_list} if arch_list else {})
    run = subprocess.run(
        [sys.executable, "-c", _FAKE_CUDA_TORCH], capture_output=True, text=True, timeout=120, cwd=ROOT, env=env
    )
    said = run.stdout + run.stderr
    if arch_list:  # the GPUs are named: the extension is set up to build (--version builds nothing)
        assert run.returncode == 0 and "skipping" not in said and "cannot be built" not in said, said
    elif mode == "1":  # asked for: an error that says why
        assert run.returncode != 0 and "cannot be built: no GPU visible" in said and "TORCH_CUDA_ARCH_LIST" in said
    else:  # automatic: one line saying why, and the pure-Python install goes on
        assert run.returncode == 0, said
        skipped = [ln for ln in run.stdout.splitlines() if "skipping the CUDA extension" in ln]
        assert len(skipped) == 1 and "no GPU visible" in skipped[0] and "TORCH_CUDA_ARCH_LIST" in skipped[0]
        assert "backend='cuda' builds it on first use" in skipped[0]  # (a CUDA torch: the JIT build can)


# ---------------------------------------------------------------- on a GPU with the extension

_REASON = backend_reason("cuda", "cuda") if torch.cuda.is_available() else "needs a CUDA device"
gpu = pytest.mark.skipif(_REASON is not None, reason=str(_REASON))


def _problem(shapes, dtype, seed=0, channels_last=False):
    gen = torch.Generator().manual_seed(seed)
    params, grads = [], []
    for shape in shapes:
        w = torch.randn(shape, generator=gen, dtype=torch.float64)
        fgd_fast.orthogonalize_(w)
        g = 0.1 * torch.randn(shape, generator=gen, dtype=torch.float64)
        w, g = w.to("cuda", dtype), g.to("cuda", dtype)
        if channels_last and w.dim() == 4:
            w, g = w.to(memory_format=torch.channels_last), g.to(memory_format=torch.channels_last)
        params.append(w)
        grads.append(g)
    return params, grads


def _steps(backend, params, grads, beta, steps=3):
    """Run `steps` FGD steps with `backend`'s prepare; return the new θ and Φ."""
    _, prepare = resolve_backend(backend, torch.device("cuda"))
    params = [p.clone(memory_format=torch.preserve_format) for p in params]
    bufs = [None if beta == 0 else torch.zeros(p.shape, dtype=compute_dtype(p.dtype), device="cuda") for p in params]
    count = len(params)
    for step in range(steps):
        plan = prepare(
            params,
            grads,
            bufs,
            [step == 0] * count,
            lr=[0.1] * count,
            momentum=[beta] * count,
            feedback=[0.4] * count,
            check_finite=True,
        )
        assert bool(plan.finite.all())
        plan.apply()
    return params, bufs, plan.dist


CASES = {  # shapes that exercise several 64-wide tiles, both layouts, ragged layers
    "rows-multi-tile": [(130, 300)],
    "cols-multi-tile": [(300, 130)],
    "ragged": [(130, 300), (8, 4, 3, 3), (300, 70), (1, 9), (9, 1), (65, 65), (64, 64 * 9)],
    "conv": [(160, 160, 3, 3), (20, 3, 3, 3)],
}


@gpu
@pytest.mark.parametrize("splits", [None, 5])
@pytest.mark.parametrize("beta", [0.9, 0.0])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_torch_backend(case, dtype, beta, splits, monkeypatch):
    from fgd_fast.backends import cuda as C

    monkeypatch.setattr(C, "force_splits", splits)
    params, grads = _problem(CASES[case], dtype, channels_last=case == "conv")
    ref_p, ref_b, ref_d = _steps("torch", params, grads, beta)
    new_p, new_b, new_d = _steps("cuda", params, grads, beta)
    tol = {torch.float64: 1e-12, torch.float32: 2e-5, torch.bfloat16: 1e-2}[dtype]
    for a, b in zip(new_p, ref_p):
        assert a.stride() == b.stride()  # written through the parameter's own layout
        torch.testing.assert_close(a.double(), b.double(), rtol=0, atol=tol)
    for a, b in zip(new_b, ref_b):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a.double(), b.double(), rtol=0, atol=tol)
    torch.testing.assert_close(new_d, ref_d.to(new_d.dtype), rtol=0, atol=max(tol, 1e-6))


@gpu
def test_split_reduction_is_deterministic(monkeypatch):
    from fgd_fast.backends import cuda as C

    monkeypatch.setattr(C, "force_splits", 16)
    params, grads = _problem([(96, 4000), (200, 1500)], torch.float32)
    first = _steps("cuda", params, grads, 0.9)
    for _ in range(3):
        again = _steps("cuda", params, grads, 0.9)
        for a, b in zip(first[0] + first[1], again[0] + again[1]):
            assert torch.equal(a, b)


@gpu
def test_launch_count_does_not_grow_with_layers(monkeypatch):
    from fgd_fast.backends import cuda as C

    monkeypatch.setattr(C, "force_splits", 2)  # gram + sum_splits + update

    def launches(shapes):
        params, grads = _problem(shapes, torch.float32)
        before = sum(C.launch_counts.values())
        _steps("cuda", params, grads, 0.9, steps=1)
        return sum(C.launch_counts.values()) - before

    few = launches([(16, 144), (32, 288)])
    many = launches([(16, 144), (32, 288)] * 10 + [(24, 50)] * 7)
    assert few == many == 3


@gpu
def test_non_finite_gradient_is_flagged_and_nothing_written():
    from fgd_fast.backends import cuda as C

    params, grads = _problem([(40, 90), (30, 5)], torch.float32)
    grads[1][3, 2] = float("nan")
    before = [p.clone() for p in params]
    plan = C.prepare_cuda(
        params,
        grads,
        [None, None],
        [True, True],
        lr=[0.1] * 2,
        momentum=[0.0] * 2,
        feedback=[0.4] * 2,
        check_finite=True,
    )
    assert plan.finite.tolist() == [True, False]
    for a, b in zip(params, before):
        assert torch.equal(a, b)  # prepare writes nothing
