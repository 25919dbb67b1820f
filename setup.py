"""Build script for fgd_fast.

The Triton kernels live in the top-level ``kernels/`` folder and are installed as
``fgd_fast.kernels`` (a bare top-level ``kernels`` module belongs to another PyPI package).

The CUDA sources ``csrc/`` are installed as ``fgd_fast/csrc`` (package data), so that an
installed wheel can still build the extension just in time; the sdist carries them too
(MANIFEST.in).

The CUDA extension ``fgd_fast._C`` (``csrc/``, used by ``backend="cuda"``) is built only when
a CUDA build of torch, a CUDA toolkit and a GPU (or ``TORCH_CUDA_ARCH_LIST`` naming the
GPUs to build for) are present, or when ``FGD_FAST_BUILD_CUDA=1``
(then a failure is an error); ``FGD_FAST_BUILD_CUDA=0`` skips it. Otherwise the build prints
one line saying why it skipped, and ``backend="cuda"`` tries a just-in-time build on first use.
"""

import importlib.util
import os
import re

from setuptools import setup
from setuptools.command.build_py import build_py


def _version() -> str:
    """``__version__`` of fgd_fast/_version.py, read as text (the package is not importable yet)."""
    with open(os.path.join("fgd_fast", "_version.py"), encoding="utf-8") as f:
        return re.search(r'^__version__ = "([^"]+)"$', f.read(), re.M).group(1)


def _cuda_extension() -> dict:
    """``ext_modules``/``cmdclass`` for ``fgd_fast._C``, or ``{}`` with one printed line."""
    mode = os.environ.get("FGD_FAST_BUILD_CUDA", "")
    if mode == "0":
        print("fgd_fast: FGD_FAST_BUILD_CUDA=0: not building the CUDA extension fgd_fast._C")
        return {}
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CUDAExtension
    except ImportError as exc:
        reason, torch_cuda = f"torch is not importable ({exc}); install with --no-build-isolation", True
    else:
        reason, torch_cuda = None, torch.version.cuda is not None and not getattr(torch.version, "hip", None)
        if getattr(torch.version, "hip", None):
            reason = f"torch {torch.__version__} is a ROCm (HIP) build; the extension is for NVIDIA GPUs"
        elif torch.version.cuda is None:
            reason = f"torch {torch.__version__} is a CPU-only build"
        elif CUDA_HOME is None:
            reason = "no CUDA toolkit found (set CUDA_HOME)"
        elif not os.environ.get("TORCH_CUDA_ARCH_LIST") and not torch.cuda.is_available():
            # (torch picks the architectures from the visible GPUs; with none its build raises)
            reason = "no GPU visible to build for (set TORCH_CUDA_ARCH_LIST, e.g. '8.0;9.0', to name the GPUs)"
    if reason:
        # (a JIT build needs the CUDA build of torch and a toolkit at run time; a CPU or ROCm torch cannot)
        later = "backend='cuda' builds it on first use" if torch_cuda else "backend='cuda' needs a CUDA build of torch"
        if mode == "1":
            raise SystemExit(f"fgd_fast: FGD_FAST_BUILD_CUDA=1 but fgd_fast._C cannot be built: {reason}")
        print(f"fgd_fast: skipping the CUDA extension fgd_fast._C: {reason} ({later})")
        return {}
    # the build settings live in fgd_fast/_cuda_build.py (shared with the just-in-time build);
    # load that file alone rather than importing the package being built
    spec = importlib.util.spec_from_file_location("_fgd_cuda_build", os.path.join("fgd_fast", "_cuda_build.py"))
    cb = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cb)
    ext = CUDAExtension(
        "fgd_fast._C",
        sources=[f"csrc/{name}" for name in cb.SOURCES],
        include_dirs=cb.extra_include_dirs(CUDA_HOME),
        # (the sources' hash: a prebuilt _C older than edited csrc/ is then not used, fgd_fast/_cuda_build.py)
        extra_compile_args={"cxx": ["-O3", *cb.hash_define()], "nvcc": cb.NVCC_FLAGS + cb.hash_define()},
        optional=mode != "1",  # an automatic build that fails leaves a working pure-Python install
    )
    return dict(ext_modules=[ext], cmdclass={"build_ext": BuildExtension})


class BuildPyWithoutDevTools(build_py):
    """The wheel leaves out the developer tools that live beside the kernels (kernels/aot.py,
    the ahead-of-time compile check, runs from the source tree)."""

    DEV_TOOLS = {("fgd_fast.kernels", "aot")}

    def find_package_modules(self, package, package_dir):
        modules = super().find_package_modules(package, package_dir)
        return [m for m in modules if (m[0], m[1]) not in self.DEV_TOOLS]


def _cmdclass(extension: dict) -> dict:
    """``extension`` (from :func:`_cuda_extension`) with the wheel's build_py added."""
    extension = dict(extension)
    extension["cmdclass"] = {**extension.get("cmdclass", {}), "build_py": BuildPyWithoutDevTools}
    return extension


setup(
    name="fgd_fast",
    version=_version(),
    description="Fast Feedback Gradient Descent (orthogonality-constrained training) for PyTorch",
    long_description=open("README.md", encoding="utf-8").read() if os.path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    author="fgd_fast developers",
    license="BSD-3-Clause",
    license_files=["LICENSE"],
    python_requires=">=3.10",
    classifiers=[
        "Development Status :: 3 - Alpha",
        "Intended Audience :: Science/Research",
        "Programming Language :: Python :: 3",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
    packages=["fgd_fast", "fgd_fast.backends", "fgd_fast.baselines", "fgd_fast.kernels", "fgd_fast.csrc"],
    package_dir={"fgd_fast": "fgd_fast", "fgd_fast.kernels": "kernels", "fgd_fast.csrc": "csrc"},
    package_data={"fgd_fast.csrc": ["*.cpp", "*.cu", "*.cuh", "*.h"]},
    # 2.11 and 2.13 are the versions tested (DTensor/FSDP2 paths import torch.distributed.tensor,
    # public from 2.5 on; nothing older than 2.11 has run the suite)
    install_requires=["torch>=2.11"],
    extras_require={
        # 3.6 and 3.8 are the versions tested (the backend refuses an older one: 3.0-3.3's interpreter
        # cannot run the kernels); numpy: the CPU interpreter (TRITON_INTERPRET=1) needs it
        "triton": ["triton>=3.6", "numpy"],
        # what the test suite uses (hypothesis: the guard's fuzz test; geoopt: a contender's tests)
        "test": ["pytest", "pytest-xdist", "pytest-benchmark", "hypothesis", "geoopt", "numpy"],
        # benchmarks/training/train.py: the digits data set, the figure, the progress bars
        "examples": ["scikit-learn", "matplotlib", "tqdm"],
    },
    **_cmdclass(_cuda_extension()),
)
