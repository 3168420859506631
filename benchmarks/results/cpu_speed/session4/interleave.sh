#!/usr/bin/env bash
# Session 4: throughput only, strictly alternating vLLM and pagedllm runs (one timed run each per
# round) under one lock, so that this VM's drift (vLLM moved 791 -> 672 tok/s between two
# consecutive runs of run.sh) lands on both systems alike.   ./interleave.sh [ROUNDS=3] [OUT_DIR]
# (OUT_DIR relative to this directory, default this directory; session 5: ../session5)
# BEFORE_ROUND: a command run at the start of each round, with the round in $i and OUT_DIR in $R
# (session 7: the host page-aging probe, ../session7/interleave_probe.sh).
set -u
H=$(cd "$(dirname "$0")" && pwd)
source "$H/../anchors_env.sh"
R=$(mkdir -p "$H/${2:-.}" && cd "$H/${2:-.}" && pwd)
cd "$REPO_DIR"
for i in $(seq "${1:-3}"); do
  if [ -n "${BEFORE_ROUND:-}" ]; then eval "$BEFORE_ROUND"; fi
  echo "== round $i vllm $(date)"
  LD_PRELOAD=$PRE flock $LOCK $VLLM_PY $A/bench_vllm.py --model $M --workload $W --bind 0-1 --label "interleaved run$i" --results $R/interleaved-anchors.jsonl > $R/interleaved-vllm-run$i.log 2>&1
  grep RESULT $R/interleaved-vllm-run$i.log | tail -1 | grep -o '"output_tok_s": [0-9.]*'
  echo "== round $i pagedllm $(date)"
  flock $LOCK pagedllm bench throughput --model $M --workload $W --repeats 1 --out-dir $R --label "pagedllm interleaved run$i" 2>&1 | grep -E "^\| pagedllm"
done
echo "== done $(date)"
