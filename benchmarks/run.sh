#!/usr/bin/env bash
# The main job: set up the pinned environment, then run the demo.
set -euo pipefail
cd "$(dirname "$0")/.."
. .ci/setup-env
python benchmarks/demo.py "$@"
