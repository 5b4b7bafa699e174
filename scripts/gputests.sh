#!/usr/bin/env bash
# The tests that run kernels on the GPU, split into SHARDS pytest processes side by side. One
# process takes longer than a device call may run: Triton compiles every kernel variant a case
# asks for on the CPU, one at a time, and the GPU machine has 16 cores.
#
#   source scripts/device-env.sh; bash scripts/gputests.sh [LOGDIR [pytest args...]]
#
# Each shard takes every SHARDS-th test (default 4) of the files below, or of the pytest args
# given, and writes LOGDIR/shard-K.log (LOGDIR defaults to a new temporary folder). With LIMIT
# (seconds), a shard still running then is interrupted, so the script ends in time inside a
# device call and still says what ran.
# It prints each shard's last line, then the tests' outcomes counted (LOGDIR/outcomes: one
# "OUTCOME test-id" line per test; NOT-REACHED for one a stopped shard never ran) and the tests
# that failed or were not reached. Exits non-zero if any failed or was not reached, or nothing
# was collected.
set -euo pipefail
cd "$(dirname "$0")/.."
logs=${1:-$(mktemp -d)}
shift || true
args=("$@")
[ ${#args[@]} -gt 0 ] || args=(tests/workers/test_kernels.py tests/workers/test_gpu.py
                                tests/drafting/test_drafter_state.py)
shards=${SHARDS:-4}
py=${PYTHON:-python3}
limit=()
[ -z "${LIMIT:-}" ] || limit=(timeout -s INT -k 20 "$LIMIT")
mkdir -p "$logs"
"$py" -m pytest --collect-only -q "${args[@]}" > "$logs/collected" 2>&1 || true
grep '::' "$logs/collected" > "$logs/ids" || { tail -n 20 "$logs/collected"; echo "no tests"; exit 1; }
echo "$(wc -l < "$logs/ids") tests in $shards shards, logs in $logs"
pids=()
for ((k = 0; k < shards; k++)); do
    mapfile -t ids < <(awk -v n="$shards" -v k="$k" '(NR - 1) % n == k' "$logs/ids")
    if [ ${#ids[@]} -eq 0 ]; then continue; fi
    # -v: one "id OUTCOME" line per test as it ends, so an interrupted shard's log says what ran
    "${limit[@]}" "$py" -m pytest -v -p no:cacheprovider "${ids[@]}" > "$logs/shard-$k.log" 2>&1 &
    pids+=("$!")
done
for pid in "${pids[@]}"; do wait "$pid" || true; done
for log in "$logs"/shard-*.log; do echo "$(basename "$log"): $(grep -v "^$" "$log" | tail -n 1)"; done
"$py" - "$logs" <<'PY'
import pathlib, re, sys
logs = pathlib.Path(sys.argv[1])
line = re.compile(r"^(\S+::.*?) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b")
seen = {}
for log in sorted(logs.glob("shard-*.log")):
    for text in log.read_text(errors="replace").splitlines():
        if m := line.match(text):
            seen[m[1]] = "FAILED" if m[2] == "ERROR" else m[2]
ids = logs.joinpath("ids").read_text().split("\n")
ids = [i for i in ids if i]
outcomes = [(seen.get(i, "NOT-REACHED"), i) for i in ids]
logs.joinpath("outcomes").write_text("".join(f"{o} {i}\n" for o, i in outcomes))
count = {o: sum(1 for x, _ in outcomes if x == o) for o in ("PASSED", "FAILED", "SKIPPED", "NOT-REACHED")}
print(f"{count['PASSED']} passed, {count['FAILED']} failed, {count['SKIPPED']} skipped, "
      f"{count['NOT-REACHED']} not reached (of {len(ids)})")
for o, i in outcomes:
    if o in ("FAILED", "NOT-REACHED"):
        print(f"  {o} {i}")
sys.exit(1 if count["FAILED"] or count["NOT-REACHED"] else 0)
PY
