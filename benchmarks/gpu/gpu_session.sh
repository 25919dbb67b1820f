#!/usr/bin/env bash
# One call on a lent GPU machine does a whole GPU session's checks, most valuable numbers first:
#
#   bash benchmarks/gpu/gpu_session.sh COMMIT [BUDGET_S]      # from the repository root
#
# installs any wheels carried in .whl/ (the machine has no network) into /tmp/site, then runs
# benchmarks/gpu/gpu_check.py with $OUT (default /tmp/gpu_out) as the folder that comes back:
# first.jsonl (the first phase, a line per result), gpu_check.json, report.md and logs.tgz are
# rewritten there after every phase, so a call killed at its limit still returns what was
# measured. BUDGET_S (default 460) bounds the whole run: with the machine's start, one device
# call of ~8 minutes leaves time in a 15-minute lease for one rerun. GPU_CHECK_ARGS adds
# options (e.g. "--cpu-dry-run --no-install" to rehearse on a CPU); GPU_WORK (default
# /tmp/gpu_check) is the folder for the logs, GPU_WORK.out gpu_check's own output. Exit status:
# gpu_check's.
set -u
commit=${1:?usage: bash benchmarks/gpu/gpu_session.sh COMMIT [BUDGET_S]}
budget=${2:-460}
out=${OUT:-/tmp/gpu_out}
work=${GPU_WORK:-/tmp/gpu_check}
log="$work.out"
cd "$(dirname "$0")/../.."
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv 2>/dev/null
# shellcheck disable=SC2086
timeout $((budget + 20)) python3 -m benchmarks.gpu.gpu_check "$out" --budget "$budget" --commit "$commit" \
  --work "$work" ${GPU_CHECK_ARGS:-} > "$log" 2>&1
rc=$?
# the phase table from the report gpu_check rewrites after every phase (also after a timeout)
sed -n '/^| phase/,/^$/p' "$out/report.md" 2>/dev/null
if [ "$rc" -ne 0 ]; then  # (a crash before the phase table: its traceback comes back in this call's output)
  tail -n 40 "$log"
fi
if [ -d "$work" ]; then  # gpu_check's own output joins the logs that come back
  cp "$log" "$work/gpu_check.out" 2>/dev/null \
    && tar -czf "$out/logs.tgz.tmp" -C "$(dirname "$work")" "$(basename "$work")" \
    && mv "$out/logs.tgz.tmp" "$out/logs.tgz"
fi
echo "gpu_check exit $rc; files in $out: $(ls "$out" | tr '\n' ' ')"
exit $rc
