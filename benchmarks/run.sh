#!/usr/bin/env bash
# The main job: set up the pinned environment, then
#   1. the optimizer-step benchmark (benchmarks/test_optimizer_step.py, pytest-benchmark), one
#      progress line per case, and its report (benchmarks/report.py), with the interleaved
#      ratios of benchmarks/studies/step_ratio.py appended;
#   2. a training comparison on scikit-learn's digits (benchmarks/training/train.py: sgd, fgd,
#      cayley-sgd, cayley-adam, landing, 3 epochs), with a progress bar per optimizer;
# and print a short summary (the full report is in a file, which ends with the job's wall time).
# FGD_BENCH_DEVICE=cpu benchmarks the CPU of a GPU machine (at the CPU sizes).
#
#   bash benchmarks/run.sh                   # CPU: the scaled-down workloads; GPU: the full ones
#   bash benchmarks/run.sh --full            # the full-size workloads on any device
#   bash benchmarks/run.sh --tiny            # a few channels per layer, a few training steps (seconds)
#   bash benchmarks/run.sh --no-train        # the step benchmark only
#   bash benchmarks/run.sh --update-results  # write into benchmarks/results/ (the committed reports)
#   bash benchmarks/run.sh --no-interleaved  # without the interleaved ratios (below)
#   bash benchmarks/run.sh -k wrn            # further arguments go to pytest
#
# The benchmark runs case after case (a shared machine's speed drifts between them); the report
# then gets the ratios to quote from benchmarks/studies/step_ratio.py: FGD and its peers stepped
# in turn, round after round, on every workload.
#
# Writes <device>-<UTC date>.md (the report, with the training table), .json (pytest-benchmark's
# raw data) and -train-digits/ (train.json, train.png) into out/results/, which git ignores, so
# a run never overwrites the committed results; --update-results writes into benchmarks/results/
# instead, and $FGD_BENCH_OUT into any folder. On a CPU both parts use one torch thread
# (FGD_BENCH_THREADS=1; set it to the core count on a dedicated machine) and passive OpenMP
# waiting (OMP_WAIT_POLICY=PASSIVE): on a shared machine, threads that must all be scheduled at
# once slow some contenders down many times more than others, which distorts the ratios.
set -euo pipefail
cd "$(dirname "$0")/.."
for a in "$@"; do  # (before the set-up: help changes nothing)
  case "$a" in -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;; esac
done
export FGD_FAST_SKIP_TRITON36="${FGD_FAST_SKIP_TRITON36:-1}"  # the AOT-check venv is not needed here
if [ "${FGD_BENCH_NO_SETUP:-0}" != 1 ]; then  # =1: use the current Python as it is (e.g. a GPU box
  echo "== set-up (.ci/setup-env: the pinned .venv; about a minute the first time)"
  . .ci/setup-env                              # without network, whose torch is not the pinned one)
fi

args=() out="" train=1 interleaved=1 train_args=(--epochs 3)
for a in "$@"; do
  case "$a" in
    --full) export FGD_BENCH_SCALE=full ;;
    --tiny) export FGD_BENCH_SCALE=tiny; train_args=(--epochs 1 --steps-per-epoch 4) ;;
    --no-train) train=0 ;;
    --no-interleaved) interleaved=0 ;;
    --update-results) out=benchmarks/results ;;
    *) args+=("$a") ;;
  esac
done

# (FGD_BENCH_DEVICE=cpu benchmarks the CPU of a GPU machine, at the CPU sizes)
device=$(python -c "from benchmarks.machine import bench_device; print('gpu' if bench_device().type == 'cuda' else 'cpu')")
if [ "$device" = cpu ]; then
  export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}" FGD_BENCH_THREADS="${FGD_BENCH_THREADS:-1}"
fi
out="${FGD_BENCH_OUT:-${out:-out/results}}"
mkdir -p "$out"
stem="$out/$device-$(date -u +%Y-%m-%d)${FGD_BENCH_SCALE:+-$FGD_BENCH_SCALE}"
train_out="$stem-train-digits"
rm -rf "$stem.json" "$stem.jsonl" "$stem.md" "$train_out"  # (an earlier run's, training folder included)
# a run stopped before its end says so at the end of its report
trap 'rc=$?; if [ "$rc" -ne 0 ] && [ -s "$stem.md" ]; then printf "\n**Interrupted or failed (exit %s): this report is partial.**\n" "$rc" >> "$stem.md"; fi' EXIT
export PYTHONUNBUFFERED=1

echo "== 1/2 optimizer-step benchmark (log: $stem.log)"
rc=0
# one line per finished case: "[ 12%] 0:41 wrn-28-10/fgd-auto PASSED"
python -m pytest benchmarks -v --benchmark-json="$stem.json" --bench-record="$stem.jsonl" \
  --benchmark-columns=min,median,max,rounds --benchmark-sort=name ${args[@]+"${args[@]}"} 2>&1 \
  | tee "$stem.log" \
  | while IFS= read -r line; do
      if [[ $line =~ test_step\[(.*)\]\ (PASSED|SKIPPED|FAILED|ERROR).*\[\ *([0-9]+%)\] ]]; then
        printf '[%4s] %d:%02d %s %s\n' "${BASH_REMATCH[3]}" $((SECONDS / 60)) $((SECONDS % 60)) \
          "${BASH_REMATCH[1]}" "${BASH_REMATCH[2]}"
      fi
    done || rc=$?
tail -n 1 "$stem.log"
if [ -s "$stem.json" ]; then
  python -m benchmarks.report "$stem.json" -o "$stem.md" > /dev/null
elif [ -s "$stem.jsonl" ]; then
  python -m benchmarks.report "$stem.jsonl" -o "$stem.md" > /dev/null
fi
if [ "$rc" -ne 0 ]; then
  tail -n 40 "$stem.log"
  echo "pytest failed (exit $rc); full log: $stem.log" >&2
  exit "$rc"
fi
rm -f "$stem.jsonl" "$stem.log"
if [ ! -s "$stem.json" ]; then
  echo "the benchmark measured no case (pytest arguments: ${args[*]-none}); nothing to report" >&2
  exit 1
fi

if [ "$interleaved" = 1 ]; then
  echo "== interleaved ratios (benchmarks/studies/step_ratio.py, appended to the report)"
  contenders=(fgd-auto fgd-torch-carried cayley-sgd-lowrank cayley-adam-lowrank landing-sgd geoopt-qr sgd)
  python -m benchmarks.studies.step_ratio --markdown --threads "${FGD_BENCH_THREADS:-1}" \
    --contenders "${contenders[@]}" >> "$stem.md"
fi

if [ "$train" = 1 ]; then
  echo "== 2/2 training comparison on scikit-learn's digits (benchmarks/training/train.py ${train_args[*]})"
  mkdir -p "$train_out"
  if ! python -m benchmarks.training --dataset digits "${train_args[@]}" --out "$train_out" > "$train_out/train.log"; then
    tail -n 40 "$train_out/train.log"
    echo "benchmarks/training/train.py failed; the step benchmark's report: $stem.md" >&2
    exit 1
  fi
  {
    printf '\n## Training comparison: digits\n\n'
    printf '`python -m benchmarks.training --dataset digits %s` (see `%s/train.json`):\n\n' \
      "${train_args[*]}" "${train_out##*/}"
    python -m benchmarks.training.report "$train_out/train.json" --markdown
    printf '\n![training curves and time per step](%s/train.png)\n' "${train_out##*/}"
  } >> "$stem.md"
fi

echo
echo "== summary: median optimizer-step time and ratio to fgd-auto"
python -m benchmarks.report "$stem.json" --summary
if [ "$train" = 1 ]; then
  python -m benchmarks.training.report "$train_out/train.json"
fi
echo
echo "full report: $stem.md (raw pytest-benchmark JSON: $stem.json)"
if [ "$train" = 1 ]; then
  echo "training: $train_out/train.json, $train_out/train.png"
fi
if [ "$out" = out/results ]; then
  echo "(out/ is ignored by git; --update-results writes into benchmarks/results/ instead)"
fi
took=$(printf '%d min %02d s' $((SECONDS / 60)) $((SECONDS % 60)))
printf '\nMain job (`bash benchmarks/run.sh %s`): %s in all, load average at the end %s.\n' \
  "$*" "$took" "$(cut -d' ' -f1-3 /proc/loadavg 2>/dev/null || echo unknown)" >> "$stem.md"
echo "main job: $took"
