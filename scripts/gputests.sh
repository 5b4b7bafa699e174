#!/usr/bin/env bash
# The tests that run kernels on the GPU, split into SHARDS pytest processes side by side. One
# process takes longer than a device call may run: Triton compiles every kernel variant a case
# asks for on the CPU, one at a time, and the GPU machine has 16 cores.
#
#   source scripts/device-env.sh; bash scripts/gputests.sh [LOGDIR [pytest args...]]
#
# Each shard takes every SHARDS-th test (default 4) of the files below, or of the pytest args
# given, and writes LOGDIR/shard-K.log (LOGDIR defaults to a new temporary folder). Prints each
# shard's summary line; exits non-zero if any shard failed.
set -euo pipefail
cd "$(dirname "$0")/.."
logs=${1:-$(mktemp -d)}
shift || true
args=("$@")
[ ${#args[@]} -gt 0 ] || args=(tests/workers/test_kernels.py tests/workers/test_gpu.py
                                tests/drafting/test_drafter_state.py)
shards=${SHARDS:-4}
mkdir -p "$logs"
python3 -m pytest --collect-only -q "${args[@]}" > "$logs/collected" 2>&1 || true
grep '::' "$logs/collected" > "$logs/ids" || { tail -n 20 "$logs/collected"; echo "no tests"; exit 1; }
echo "$(wc -l < "$logs/ids") tests in $shards shards, logs in $logs"
pids=()
for ((k = 0; k < shards; k++)); do
    mapfile -t ids < <(awk -v n="$shards" -v k="$k" '(NR - 1) % n == k' "$logs/ids")
    if [ ${#ids[@]} -eq 0 ]; then continue; fi
    python3 -m pytest -q -p no:cacheprovider "${ids[@]}" > "$logs/shard-$k.log" 2>&1 &
    pids+=("$!")
done
failed=0
for pid in "${pids[@]}"; do wait "$pid" || failed=1; done
for log in "$logs"/shard-*.log; do echo "$(basename "$log"): $(grep -v "^$" "$log" | tail -n 1)"; done
exit $failed
