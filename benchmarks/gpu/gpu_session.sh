#!/usr/bin/env bash
# One call on a lent GPU machine does a whole GPU session's checks:
#
#   bash benchmarks/gpu/gpu_session.sh COMMIT [BUDGET_S]      # from the repository root
#
# installs any wheels carried in .whl/ (e.g. geoopt; the machine has no network) into
# /tmp/site, runs benchmarks/gpu/gpu_check.py into /tmp/gpu_check (build, tests, benchmarks,
# 2,000-step accuracy run, Triton tile sweep, report; COMMIT is recorded because a copied .git may be stale), then the
# WRN-28-10 training comparison (benchmarks/train.py: synthetic CIFAR-shaped data, bf16 autocast,
# channels_last, sgd/fgd/cayley-sgd; at most TRAIN_S=100 s; TRAIN_ARGS replaces its size
# options, e.g. "--depth 10 --width 0.5 --batch-size 16 --epochs 1 --steps-per-epoch 3" to
# rehearse on a CPU), then copies the reports and raw JSON into $OUT (default /tmp/gpu_out)
# with everything, logs included, in one all.tgz: few files, since a device call returns only
# a handful. Exit status: gpu_check's.
set -u
commit=${1:?usage: bash benchmarks/gpu/gpu_session.sh COMMIT [BUDGET_S]}
budget=${2:-450}  # + 30 s of slack + TRAIN_S: under the 10 minutes of a device call
out=${OUT:-/tmp/gpu_out}
cd "$(dirname "$0")/../.."
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv 2>/dev/null
# GPU_CHECK_ARGS: more options for gpu_check.py (e.g. "--cpu-dry-run --no-install" to rehearse)
# shellcheck disable=SC2086
timeout $((budget + 30)) python3 benchmarks/gpu/gpu_check.py /tmp/gpu_check --budget "$budget" --commit "$commit" ${GPU_CHECK_ARGS:-} > /tmp/gpu_check.out 2>&1
rc=$?
sed -n '/^| phase/,/^$/p' /tmp/gpu_check.out
grep -m1 -A2 "^## Tests" /tmp/gpu_check.out
train_out=/tmp/gpu_check/train-wrn
mkdir -p "$train_out"
# shellcheck disable=SC2086
FGD_BENCH_COMMIT="$commit" PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} timeout "${TRAIN_S:-100}" python3 benchmarks/train.py --dataset synthetic \
  --model wrn --optimizers sgd,fgd,cayley-sgd --amp bf16 --channels-last on --no-progress --out "$train_out" \
  ${TRAIN_ARGS:---depth 28 --width 10 --epochs 2 --steps-per-epoch 40} > /tmp/gpu_check/train-wrn.log 2>&1
echo "train.py exit $?"; tail -n 6 /tmp/gpu_check/train-wrn.log
mkdir -p "$out"
[ -f "$train_out/train.json" ] && cp "$train_out/train.json" "$out/train-wrn.json"
[ -f "$train_out/train.png" ] && cp "$train_out/train.png" "$out/train-wrn.png"
for f in report.md gpu_check.json bench.json tests-junit.xml accuracy.json triton_probe.json; do
  [ -f "/tmp/gpu_check/$f" ] && cp "/tmp/gpu_check/$f" "$out/"
done
tar czf "$out/all.tgz" -C /tmp gpu_check gpu_check.out
echo "gpu_check exit $rc; files in $out"
exit $rc
