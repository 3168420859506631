#!/usr/bin/env bash
# CPU speed side by side: pagedllm vs vLLM's CPU build vs HF transformers, on the anchors' random
# SmolLM2-135M-shaped model and 200-request workload, every timed run under one lock (on 2 cores
# nothing else may run). What it runs, in this order:
#   1. ROUNDS strictly alternating throughput rounds, vLLM first, each preceded by the host
#      page-aging probe (benchmarks/probes/page_aging.c), so that drift hits both systems alike;
#   2. pagedllm at batch size 1 (first 10 requests, median of 3), then vLLM with max_num_seqs=1 x3;
#   3. HF transformers static batches of 8, then of 32 (first 150 s of batches each).
# SKIP_SIDE=1 runs step 1 only (a second set of rounds).
#
#   ANCHORS_DIR=/scratch bash benchmarks/results/cpu_speed/run_speed.sh [ROUNDS=3] [RAW_DIR]
#   python3 benchmarks/results/cpu_speed/collect.py RAW_DIR [RAW_DIR2 ...]   # -> results.json
#   python3 benchmarks/results/cpu_speed/plot.py                             # -> speed.png
#
# ANCHORS_DIR holds the venvs, model and workload of benchmarks/anchors/README.md
# (`ANCHORS_DIR=... bash benchmarks/anchors/run_anchors.sh setup` makes the model and workload).
# Raw JSONL and logs go to RAW_DIR (default: a new folder under /tmp). vLLM runs in its
# documented fast configuration: tcmalloc + Intel OpenMP preloaded, both cores bound.
set -u
: "${ANCHORS_DIR:?set ANCHORS_DIR (see benchmarks/anchors/README.md)}"
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO_DIR=$(cd "$HERE/../../.." && pwd)
A=$REPO_DIR/benchmarks/anchors
M=$ANCHORS_DIR/models/smol135-random
W=$ANCHORS_DIR/workload-200.json
LOCK=${LOCK:-/tmp/pagedllm-bench.lock}
VLLM_PY=${VLLM_PY:-$ANCHORS_DIR/venv-vllm/bin/python}
HF_PY=${HF_PY:-$ANCHORS_DIR/venv-hf/bin/python}
TCM=$(ldconfig -p | awk '/libtcmalloc_minimal\.so\.4 /{print $NF; exit}')
PRE="$TCM:$(readlink -f "$(dirname "$VLLM_PY")/../lib/libiomp5.so")"
ROUNDS=${1:-3}
O=${2:-$(mktemp -d /tmp/cpu_speed.XXXXXX)}
mkdir -p "$O" && O=$(cd "$O" && pwd)
echo "raw output: $O"
cd "$REPO_DIR"
gcc -O2 -o /tmp/page_aging benchmarks/probes/page_aging.c

for i in $(seq "$ROUNDS"); do
  echo "== round $i probe $(date)"
  flock "$LOCK" /tmp/page_aging 2 | tee "$O/probe-run$i.log"
  echo "== round $i vllm $(date)"
  LD_PRELOAD=$PRE flock "$LOCK" "$VLLM_PY" "$A/bench_vllm.py" --model "$M" --workload "$W" --bind 0-1 \
    --label "interleaved run$i" --results "$O/interleaved-anchors.jsonl" > "$O/interleaved-vllm-run$i.log" 2>&1
  grep RESULT "$O/interleaved-vllm-run$i.log" | tail -1 | grep -o '"output_tok_s": [0-9.]*'
  echo "== round $i pagedllm $(date)"
  flock "$LOCK" pagedllm bench throughput --model "$M" --workload "$W" --repeats 1 --out-dir "$O" \
    --label "pagedllm interleaved run$i" 2>&1 | grep -E "^\| pagedllm"
done
if [ -n "${SKIP_SIDE:-}" ]; then echo "== done $(date)"; exit 0; fi

echo "== pagedllm bs1 $(date)"
flock "$LOCK" pagedllm bench latency --model "$M" --workload "$W" --num-prompts 10 --repeats 3 --out-dir "$O" \
  --label "pagedllm bs1 (median of 3)" 2>&1 | grep -E "^\|"
for i in 1 2 3; do
  echo "== vllm bs1 $i $(date)"
  LD_PRELOAD=$PRE flock "$LOCK" "$VLLM_PY" "$A/bench_vllm.py" --model "$M" --workload "$W" --num-requests 10 \
    --max-num-seqs 1 --bind 0-1 --label "bs1-bind0-1+preload run$i" --results "$O/anchors.jsonl" > "$O/vllm-bs1-run$i.log" 2>&1
  grep RESULT "$O/vllm-bs1-run$i.log" | tail -1 | grep -o '"ms_per_output_token": [0-9.]*'
done
for b in 8 32; do
  echo "== hf static batch $b (first 150 s of batches) $(date)"
  flock "$LOCK" "$HF_PY" "$A/bench_hf.py" --model "$M" --workload "$W" --dtype bfloat16 --batch-size $b \
    --max-seconds 150 --label "hf bs$b" --results "$O/anchors.jsonl" > "$O/hf-bs$b.log" 2>&1
  tail -1 "$O/hf-bs$b.log"
done
echo "== done $(date)"
