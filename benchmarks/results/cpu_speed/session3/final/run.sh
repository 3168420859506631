#!/usr/bin/env bash
# Session 3 final re-measurement (after the next-item prefetch and the memory roofline) of offline throughput (issue 5), interleaved so that drift hits both:
# vLLM run 1, pagedllm x3 (one process, cold prefix cache each run), vLLM runs 2-3; then
# pagedllm batch size 1. Same lock, same machine, one after another.
set -u
export ANCHORS_DIR=${ANCHORS_DIR:-/root/anchors}
M=$ANCHORS_DIR/models/smol135-random
W=$ANCHORS_DIR/workload-200.json
R=$(cd "$(dirname "$0")" && pwd)
A=$(cd "$R/../../../../../../shared/anchors" && pwd)
LOCK=/tmp/pagedllm-bench.lock
VLLM_PY=$ANCHORS_DIR/venv-vllm/bin/python
TCM=$(ldconfig -p | awk '/libtcmalloc_minimal\.so\.4 /{print $NF; exit}')
PRE="$TCM:$(readlink -f "$ANCHORS_DIR/venv-vllm/lib/libiomp5.so")"
cd "$R/../../../../.."
vllm_run() {
  echo "== vllm throughput $1 $(date)"
  LD_PRELOAD=$PRE flock $LOCK $VLLM_PY $A/bench_vllm.py --model $M --workload $W --bind 0-1 --label "bind0-1+preload run$1" --results $R/anchors.jsonl > $R/vllm-200-run$1.log 2>&1
  grep RESULT $R/vllm-200-run$1.log | tail -1 | grep -o '"output_tok_s": [0-9.]*'
}
vllm_run 1
echo "== pagedllm throughput $(date)"
flock $LOCK pagedllm bench throughput --model $M --workload $W --repeats 3 --out-dir $R --label "pagedllm (median of 3)" 2>&1 | grep -E "^\|"
vllm_run 2
vllm_run 3
echo "== pagedllm bs1 $(date)"
flock $LOCK pagedllm bench latency --model $M --workload $W --num-prompts 10 --repeats 3 --out-dir $R --label "pagedllm bs1 (median of 3)" 2>&1 | grep -E "^\|"
echo "== done $(date)"
