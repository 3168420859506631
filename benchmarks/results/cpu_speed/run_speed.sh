#!/usr/bin/env bash
# Side-by-side CPU speed runs (issue 5), one after another under one lock, same session.
# Needs the anchors set up (../shared/anchors/README.md): venvs, model, workload, tcmalloc.
set -u
R=$(cd "$(dirname "$0")" && pwd)
source "$R/anchors_env.sh"
cd "$REPO_DIR"
echo "== pagedllm throughput $(date)"
flock $LOCK pagedllm bench throughput --model $M --workload $W --repeats 3 --out-dir $R --label "pagedllm (median of 3)" 2>&1 | grep -E "^\|"
echo "== pagedllm bs1 $(date)"
flock $LOCK pagedllm bench latency --model $M --workload $W --num-prompts 10 --repeats 3 --out-dir $R --label "pagedllm bs1 (median of 3)" 2>&1 | grep -E "^\|"
for i in 1 2 3; do
  echo "== vllm throughput $i $(date)"
  LD_PRELOAD=$PRE flock $LOCK $VLLM_PY $A/bench_vllm.py --model $M --workload $W --bind 0-1 --label "bind0-1+preload run$i" --results $R/anchors.jsonl > $R/vllm-200-run$i.log 2>&1
  grep RESULT $R/vllm-200-run$i.log | tail -1 | grep -o '"output_tok_s": [0-9.]*'
done
for i in 1 2 3; do
  echo "== vllm bs1 $i $(date)"
  LD_PRELOAD=$PRE flock $LOCK $VLLM_PY $A/bench_vllm.py --model $M --workload $W --num-requests 10 --max-num-seqs 1 --bind 0-1 --label "bs1-bind0-1+preload run$i" --results $R/anchors.jsonl > $R/vllm-bs1-run$i.log 2>&1
  grep RESULT $R/vllm-bs1-run$i.log | tail -1 | grep -o '"ms_per_output_token": [0-9.]*'
done
echo "== hf bs1 $(date)"
flock $LOCK $HF_PY $A/bench_hf.py --model $M --workload $W --dtype bfloat16 --batch-size 1 --num-requests 10 --label "hf bs1" --results $R/anchors.jsonl > $R/hf-bs1.log 2>&1; tail -1 $R/hf-bs1.log
echo "== hf static batch 8 (first 150 s of batches) $(date)"
flock $LOCK $HF_PY $A/bench_hf.py --model $M --workload $W --dtype bfloat16 --batch-size 8 --max-seconds 150 --label "hf bs8" --results $R/anchors.jsonl > $R/hf-bs8.log 2>&1; tail -1 $R/hf-bs8.log
echo "== done $(date)"
