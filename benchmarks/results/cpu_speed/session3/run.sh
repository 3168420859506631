#!/usr/bin/env bash
# Session 3 side-by-side (issue 5), one after another under one lock, interleaved so that drift
# hits both systems: vLLM run 1, pagedllm x3 (one process, cold prefix cache each run), vLLM runs
# 2-3, pagedllm at batch size 1, vLLM at batch size 1 (max_num_seqs=1) x3, HF static batches of 8.
#   ./run.sh [OUT_DIR]   (default: this directory; `./run.sh final` made final/)
# SKIP_THROUGHPUT=1: only the batch-size-1 and HF steps (session 7, whose throughput rounds came
# from ../session7/interleave_probe.sh).
# The first run of the day (this directory) stopped after the pagedllm batch-size-1 step.
set -u
R=$(cd "$(dirname "$0")" && pwd)
source "$R/../anchors_env.sh"
O=$(mkdir -p "$R/${1:-.}" && cd "$R/${1:-.}" && pwd)
cd "$REPO_DIR"
vllm_run() {
  echo "== vllm throughput $1 $(date)"
  LD_PRELOAD=$PRE flock $LOCK $VLLM_PY $A/bench_vllm.py --model $M --workload $W --bind 0-1 --label "bind0-1+preload run$1" --results $O/anchors.jsonl > $O/vllm-200-run$1.log 2>&1
  grep RESULT $O/vllm-200-run$1.log | tail -1 | grep -o '"output_tok_s": [0-9.]*'
}
if [ -z "${SKIP_THROUGHPUT:-}" ]; then
  vllm_run 1
  echo "== pagedllm throughput $(date)"
  flock $LOCK pagedllm bench throughput --model $M --workload $W --repeats 3 --out-dir $O --label "pagedllm (median of 3)" 2>&1 | grep -E "^\|"
  vllm_run 2
  vllm_run 3
fi
echo "== pagedllm bs1 $(date)"
flock $LOCK pagedllm bench latency --model $M --workload $W --num-prompts 10 --repeats 3 --out-dir $O --label "pagedllm bs1 (median of 3)" 2>&1 | grep -E "^\|"
for i in 1 2 3; do
  echo "== vllm bs1 $i $(date)"
  LD_PRELOAD=$PRE flock $LOCK $VLLM_PY $A/bench_vllm.py --model $M --workload $W --num-requests 10 --max-num-seqs 1 --bind 0-1 --label "bs1-bind0-1+preload run$i" --results $O/anchors.jsonl > $O/vllm-bs1-run$i.log 2>&1
  grep RESULT $O/vllm-bs1-run$i.log | tail -1 | grep -o '"ms_per_output_token": [0-9.]*'
done
echo "== hf static batch 8 (first 150 s of batches) $(date)"
flock $LOCK $HF_PY $A/bench_hf.py --model $M --workload $W --dtype bfloat16 --batch-size 8 --max-seconds 150 --label "hf bs8" --results $O/anchors.jsonl > $O/hf-bs8.log 2>&1; tail -1 $O/hf-bs8.log
echo "== done $(date)"
