#!/usr/bin/env bash
# A/B of an engine change on the default model: `pagedllm bench throughput` on the 200-request
# ShareGPT-like workload and `pagedllm bench latency` (batch size 1, its first 10 requests), the
# engine at OLD_REV against this checkout, strictly alternating (old, new, old, new, ...), each run
# under one flock so no other benchmark shares the cores. CHANGE says what differs (for the README).
# Writes results.jsonl (one RESULT line per run), then results.json + README.md via summarize.py.
#   OLD_REV=bceae99 ROUNDS=2 CHANGE="..." bash benchmarks/results/architecture_ab/run_ab.sh
# BENCHES="latency" runs only the batch-size-1 part (its noise on this VM needs more rounds).
set -euo pipefail
OLD_REV=${OLD_REV:-bceae99}
CHANGE=${CHANGE:-the engine at OLD_REV against this checkout}
ROUNDS=${ROUNDS:-1}
LOCK=${LOCK:-/tmp/pagedllm-bench.lock}
NUM_PROMPTS=${NUM_PROMPTS:-200}
BENCHES=${BENCHES:-throughput latency}
OUT=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$OUT/../../.." && pwd)
OLD=$(mktemp -d)/old
git -C "$REPO" worktree add -q --detach "$OLD" "$OLD_REV"
trap 'git -C "$REPO" worktree remove --force "$OLD"' EXIT
: > "$OUT/results.jsonl"
for round in $(seq "$ROUNDS"); do
  for side in old new; do
    dir=$REPO
    [ "$side" = old ] && dir=$OLD
    [[ " $BENCHES " == *" throughput "* ]] && (cd "$dir" && flock "$LOCK" env PYTHONPATH="$dir" python3 -m \
      pagedllm.entrypoints.cli bench throughput --workload sharegpt --num-prompts "$NUM_PROMPTS" --repeats 1 \
      --label "$side $round" --no-save) | grep '^RESULT ' | sed 's/^RESULT //' >> "$OUT/results.jsonl"
    [[ " $BENCHES " == *" latency "* ]] && (cd "$dir" && flock "$LOCK" env PYTHONPATH="$dir" python3 -m pagedllm.entrypoints.cli bench latency \
      --workload sharegpt --num-prompts 10 --repeats 1 --label "$side $round" --no-save) \
      | grep '^RESULT ' | sed 's/^RESULT //' >> "$OUT/results.jsonl"
  done
done
python3 "$OUT/summarize.py" "$OUT" "$OLD_REV" "$(git -C "$REPO" rev-parse --short HEAD)" "$CHANGE"
