#!/usr/bin/env bash
# The test suite under the GPU machine's library versions, on a CPU: torch 2.11.0 and Triton 3.6.0
# (the versions of the lent GPU machine; CI pins torch 2.13.0 and Triton 3.8.0). Run it before a
# GPU session, so that a version difference fails here and not in the few device minutes.
#
#   [PYTHON=python3.12] [BUILD_CUDA=1] bash benchmarks/gpu/gpu_versions_on_cpu.sh [VENV] [pytest arguments ...]
#
# VENV (default /tmp/fgd-gpu-versions) is created once, with $PYTHON (default python3; the GPU
# machine has Python 3.12): about 4.7 GB, the CUDA build of torch 2.11.0 from PyPI (the CPU
# build is not on PyPI; a CUDA build runs on a CPU). numpy stays below
# 2.4: Triton 3.6's interpreter converts one-element arrays with int(), which numpy 2.4 refuses
# ("only 0-dimensional arrays can be converted to Python scalars"); on a GPU the kernels are
# compiled and any numpy works. The tests run from a fresh clone of HEAD in a temporary folder
# (the editable install there leaves this tree alone); the clone is deleted at the end.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
venv="${1:-/tmp/fgd-gpu-versions}"
shift || true
want="torch==2.11.0 triton==3.6.0 numpy<2.4 pytest pytest-xdist pytest-benchmark hypothesis setuptools wheel geoopt scikit-learn matplotlib tqdm"
if [ ! -x "$venv/bin/python" ]; then
  "${PYTHON:-python3}" -m venv "$venv"
fi
if ! "$venv/bin/python" -c "import torch, triton, numpy; assert torch.__version__.startswith('2.11.0') and triton.__version__ == '3.6.0' and numpy.__version__ < '2.4'" 2>/dev/null; then
  "$venv/bin/pip" install -q --disable-pip-version-check $want
fi
work="$(mktemp -d /tmp/fgd-gpu-versions-clone.XXXX)"
trap 'rm -rf "$work"' EXIT
git clone -q "$root" "$work"
cd "$work"
# (no GPU is visible: setup.py skips the CUDA extension with one line)
"$venv/bin/pip" install -q --disable-pip-version-check --no-deps --no-build-isolation -e .
if [ "${BUILD_CUDA:-0}" = 1 ]; then
  # the real fgd_fast._C with nvcc (CUDA_HOME's major version must be torch's: 13 for 2.11.0+cu130),
  # for the GPU's architectures; tests/test_cuda_build.py then loads it without a GPU (~2 min)
  # (CUDA_HOME: the toolkit, not where a wrapper nvcc on PATH lies)
  CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}" FGD_FAST_BUILD_CUDA=1 TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-8.0;9.0}" MAX_JOBS="${MAX_JOBS:-2}" \
    "$venv/bin/python" setup.py -q build_ext --inplace
fi
"$venv/bin/python" -c "import torch, triton, numpy, sys; print(f'torch {torch.__version__}, triton {triton.__version__}, numpy {numpy.__version__}, Python {sys.version.split()[0]}, commit', end=' ')"
git rev-parse --short HEAD
PATH="$venv/bin:$PATH" "$venv/bin/python" -m pytest -n 2 -q -p no:cacheprovider "$@"
