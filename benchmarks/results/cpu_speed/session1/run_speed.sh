#!/usr/bin/env bash
# Side-by-side CPU speed runs (issue 5), one after another, same session.
set -u
export ANCHORS_DIR=/root/anchors
M=$ANCHORS_DIR/models/smol135-random
W=$ANCHORS_DIR/workload-200.json
R=/work/main/benchmarks/results/cpu_speed
A=/work/shared/anchors
cd /work/main
echo "== pagedllm throughput $(date)"
flock /tmp/pagedllm-bench.lock pagedllm bench throughput --model $M --workload $W --repeats 2 --out-dir $R --label "pagedllm paged bs16 (2 threads)" 2>&1 | grep -E "RESULT|^\|"
echo "== pagedllm latency $(date)"
flock /tmp/pagedllm-bench.lock pagedllm bench latency --model $M --workload $W --num-prompts 10 --repeats 1 --out-dir $R --label "pagedllm bs1" 2>&1 | grep -E "RESULT|^\|"
echo "== vllm throughput $(date)"
flock /tmp/pagedllm-bench.lock $ANCHORS_DIR/venv-vllm/bin/python $A/bench_vllm.py --model $M --workload $W --bind 0-1 --label bind0-1 --results $R/anchors.jsonl > $R/vllm-200.log 2>&1; grep RESULT $R/vllm-200.log | tail -1
echo "== vllm bs1 $(date)"
flock /tmp/pagedllm-bench.lock $ANCHORS_DIR/venv-vllm/bin/python $A/bench_vllm.py --model $M --workload $W --num-requests 10 --max-num-seqs 1 --bind 0-1 --label bs1-bind0-1 --results $R/anchors.jsonl > $R/vllm-bs1.log 2>&1; grep RESULT $R/vllm-bs1.log | tail -1
echo "== hf bs1 $(date)"
flock /tmp/pagedllm-bench.lock $ANCHORS_DIR/venv-hf/bin/python $A/bench_hf.py --model $M --workload $W --dtype bfloat16 --batch-size 1 --num-requests 10 --label bs1 --results $R/anchors.jsonl 2> $R/hf-bs1.log | tail -1
echo "== done $(date)"
