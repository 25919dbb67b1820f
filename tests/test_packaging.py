"""Packaging: the sdist and the wheel carry what a just-in-time CUDA build needs (the csrc/
sources), the licence and one version. Both are built offline, without build isolation and
without the CUDA extension (FGD_FAST_BUILD_CUDA=0); the wheel is built from the unpacked sdist,
which shows the sdist is complete and leaves no build/ folder in the checkout."""

from __future__ import annotations

import fcntl
import hashlib
import os
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

import pytest

import fgd_fast
from fgd_fast import _cuda_build

ROOT = Path(__file__).resolve().parent.parent
CSRC_FILES = sorted(p.name for p in (ROOT / "csrc").iterdir() if p.suffix in (".cpp", ".cu", ".cuh", ".h"))
ENV = dict(os.environ, FGD_FAST_BUILD_CUDA="0", PIP_DISABLE_PIP_VERSION_CHECK="1")


def _run(args, **kw):
    out = subprocess.run(args, env=ENV, capture_output=True, text=True, timeout=240, **kw)
    assert out.returncode == 0, f"{' '.join(map(str, args))} failed:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}"
    return out.stdout


@pytest.fixture(scope="module")
def dists(tmp_path_factory):
    """``(sdist path, wheel path)``."""
    out = tmp_path_factory.mktemp("dist")
    build_sdist = "import sys; from setuptools import build_meta; print(build_meta.build_sdist(sys.argv[1]))"
    # setuptools assembles the sdist in a folder of the checkout (fgd_fast-<version>/) and deletes it:
    # one build at a time (pytest-xdist workers each build theirs)
    lock = Path(tempfile.gettempdir()) / f"fgd_fast-sdist-{hashlib.sha256(str(ROOT).encode()).hexdigest()[:12]}.lock"
    with open(lock, "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        sdist = out / _run([sys.executable, "-c", build_sdist, str(out)], cwd=ROOT).strip().splitlines()[-1]
    src = out / "src"
    with tarfile.open(sdist) as tar:
        tar.extractall(src, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
    (unpacked,) = src.iterdir()
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "-q",
            "-w",
            str(out),
            str(unpacked),
        ]
    )
    (wheel,) = out.glob("*.whl")
    return sdist, wheel


def _sdist_names(sdist: Path) -> set[str]:
    with tarfile.open(sdist) as tar:
        return {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}


def _wheel_names(wheel: Path) -> set[str]:
    with zipfile.ZipFile(wheel) as whl:
        return set(whl.namelist())


def test_csrc_has_the_sources_the_build_compiles():
    assert set(_cuda_build.SOURCES) <= set(CSRC_FILES)
    assert _cuda_build.CSRC == ROOT / "csrc"  # a source checkout / editable install


def test_sdist_carries_the_cuda_sources_kernels_tests_licence_and_docs(dists):
    names = _sdist_names(dists[0])
    expected = {f"csrc/{f}" for f in CSRC_FILES} | {
        "setup.py",
        "pyproject.toml",
        "MANIFEST.in",
        "LICENSE",
        "CHANGELOG.md",
        "README.md",
        "docs/algorithm.md",
        "fgd_fast/_version.py",
        "fgd_fast/_cuda_build.py",
        "kernels/fgd_step.py",
        "pytest.ini",
        "tests/helpers.py",
        "tests/oracle.py",
        "tests/cuda_emulation/emu.h",
        "benchmarks/__init__.py",  # (modules some tests import)
        "benchmarks/opcount.py",
    }
    assert expected <= names, f"missing from the sdist: {sorted(expected - names)}"
    assert not any(n.startswith("benchmarks/results/") for n in names)
    assert not any("__pycache__" in n or n.endswith(".pyc") for n in names)


def test_wheel_installs_the_cuda_sources_as_package_data(dists):
    names = _wheel_names(dists[1])
    version = fgd_fast.__version__
    expected = {f"fgd_fast/csrc/{f}" for f in CSRC_FILES} | {
        "fgd_fast/_version.py",
        "fgd_fast/_cuda_build.py",
        "fgd_fast/kernels/fgd_step.py",
        "fgd_fast/backends/cuda.py",
    }
    assert expected <= names, f"missing from the wheel: {sorted(expected - names)}"
    # the license: dist-info/licenses/ (PEP 639, setuptools >= 77) or dist-info/ (older setuptools)
    assert {f"fgd_fast-{version}.dist-info/licenses/LICENSE", f"fgd_fast-{version}.dist-info/LICENSE"} & names
    assert not {n.split("/")[0] for n in names} - {"fgd_fast", f"fgd_fast-{version}.dist-info"}  # no top-level strays
    assert "fgd_fast/kernels/aot.py" not in names  # a developer tool, run from the source tree


def test_version_is_one_value_in_the_package_and_both_distributions(dists):
    sdist, wheel = dists
    version = fgd_fast.__version__
    text = (ROOT / "fgd_fast" / "_version.py").read_text()
    assert f'__version__ = "{version}"' in text
    assert sdist.name == f"fgd_fast-{version}.tar.gz"
    assert wheel.name.startswith(f"fgd_fast-{version}-")
    with zipfile.ZipFile(wheel) as whl:
        metadata = whl.read(f"fgd_fast-{version}.dist-info/METADATA").decode()
    assert f"\nVersion: {version}\n" in metadata
    assert "License-Expression: BSD-3-Clause" in metadata or "License: BSD-3-Clause" in metadata


def test_unpacked_wheel_finds_its_cuda_sources(dists, tmp_path):
    """The just-in-time build of an installed wheel reads fgd_fast/csrc (no checkout around)."""
    site = tmp_path / "site"
    with zipfile.ZipFile(dists[1]) as whl:
        whl.extractall(site)
    probe = (
        "import fgd_fast, fgd_fast._cuda_build as cb; "
        "print(fgd_fast.__file__); print(cb.CSRC); print(all((cb.CSRC / s).is_file() for s in cb.SOURCES))"
    )
    env_path = os.pathsep.join([str(site), ENV.get("PYTHONPATH", "")])
    out = subprocess.run(
        [sys.executable, "-c", probe],
        env=dict(ENV, PYTHONPATH=env_path),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    package_file, csrc, complete = out.stdout.split("\n")[:3]
    assert Path(package_file).is_relative_to(site), "the probe imported another fgd_fast"
    assert Path(csrc) == site / "fgd_fast" / "csrc" and complete == "True"


def test_a_source_tree_imports_its_kernels_without_an_editable_install(tmp_path):
    """A review: Python started in a source tree (a clone, an unpacked sdist) with fgd_fast installed
    elsewhere imports the tree's ``fgd_fast/``, which has no ``kernels/`` (setup.py maps the
    top-level folder in): ``fgd_fast.kernels`` was missing, and the sdist's own tests failed on it.
    Here the tree is imported with no site processing (so no editable install's finder), torch
    from its folder: ``fgd_fast.kernels`` is the tree's ``kernels/``."""
    import torch

    site = Path(torch.__file__).resolve().parent.parent
    code = (
        "import sys, fgd_fast, fgd_fast.kernels.meta as m; "
        "assert not any('editable' in type(f).__name__.lower() for f in sys.meta_path), sys.meta_path; "
        "print(m.__file__)"
    )
    env = {k: v for k, v in ENV.items() if k != "PYTHONPATH"} | {"PYTHONPATH": f"{ROOT}{os.pathsep}{site}"}
    out = subprocess.run([sys.executable, "-S", "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    assert Path(out.stdout.strip()) == ROOT / "kernels" / "meta.py"


def test_importing_the_package_imports_neither_dynamo_nor_triton():
    """A review: module-level ``torch.compiler.disable`` marks imported ``torch._dynamo`` (and Triton
    with it) with the package, about a second more than torch alone; they are applied at the
    marked functions' first call now (``fgd_fast._compile.eager``)."""
    code = "import sys, fgd_fast; print(sorted(m for m in ('torch._dynamo', 'triton') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], env=ENV, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "[]"
