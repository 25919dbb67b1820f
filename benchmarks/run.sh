#!/usr/bin/env bash
# The main job: set up the pinned environment, run the optimizer-step benchmark
# (benchmarks/test_optimizer_step.py, pytest-benchmark) and print the report.
#
#   bash benchmarks/run.sh            # CPU: the scaled-down workloads; GPU: the full ones
#   bash benchmarks/run.sh --full     # the full-size workloads on any device
#   bash benchmarks/run.sh --tiny     # a few channels per layer (pipeline check, seconds)
#   bash benchmarks/run.sh -k wrn     # further arguments go to pytest
#
# Writes benchmarks/results/<cpu|gpu>-<UTC date>.json (pytest-benchmark JSON) and .md (the
# report), or into $FGD_BENCH_OUT. On a CPU the run uses one torch thread
# (FGD_BENCH_THREADS=1; set it to the core count on a dedicated machine) and passive OpenMP
# waiting (OMP_WAIT_POLICY=PASSIVE): on a shared machine, threads that must all be scheduled
# at once slow some contenders down many times more than others, which distorts the ratios.
set -euo pipefail
cd "$(dirname "$0")/.."
export FGD_FAST_SKIP_TRITON36="${FGD_FAST_SKIP_TRITON36:-1}"  # the AOT-check venv is not needed here
if [ "${FGD_BENCH_NO_SETUP:-0}" != 1 ]; then  # =1: use the current Python as it is (e.g. a GPU box
  . .ci/setup-env                              # without network, whose torch is not the pinned one)
fi

args=()
for a in "$@"; do
  case "$a" in
    --full) export FGD_BENCH_SCALE=full ;;
    --tiny) export FGD_BENCH_SCALE=tiny ;;
    *) args+=("$a") ;;
  esac
done

device=$(python -c "import torch; print('gpu' if torch.cuda.is_available() else 'cpu')")
if [ "$device" = cpu ]; then
  export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}" FGD_BENCH_THREADS="${FGD_BENCH_THREADS:-1}"
fi
out="${FGD_BENCH_OUT:-benchmarks/results}"
mkdir -p "$out"
stem="$out/$device-$(date -u +%Y-%m-%d)${FGD_BENCH_SCALE:+-$FGD_BENCH_SCALE}"
rm -f "$stem.json" "$stem.jsonl" "$stem.md"

rc=0
python -m pytest benchmarks -q --benchmark-json="$stem.json" --bench-record="$stem.jsonl" \
  --benchmark-columns=min,median,max,rounds --benchmark-sort=name \
  ${args[@]+"${args[@]}"} > "$stem.log" 2>&1 || rc=$?
tail -n 1 "$stem.log"
if [ -s "$stem.json" ]; then
  python benchmarks/report.py "$stem.json" -o "$stem.md"
elif [ -s "$stem.jsonl" ]; then
  python benchmarks/report.py "$stem.jsonl" -o "$stem.md"
fi
if [ "$rc" -ne 0 ]; then
  tail -n 40 "$stem.log"
  echo "pytest failed (exit $rc); full log: $stem.log" >&2
  exit "$rc"
fi
rm -f "$stem.jsonl" "$stem.log"
echo "report: $stem.md (raw pytest-benchmark JSON: $stem.json)"
