#!/usr/bin/env bash
# vLLM at batch size 1 (max_num_seqs=1), first 10 requests, x3, same configuration as run.sh.
set -u
export ANCHORS_DIR=${ANCHORS_DIR:-/root/anchors}
M=$ANCHORS_DIR/models/smol135-random
W=$ANCHORS_DIR/workload-200.json
R=$(cd "$(dirname "$0")" && pwd)
A=$(cd "$R/../../../../../../shared/anchors" && pwd)
VLLM_PY=$ANCHORS_DIR/venv-vllm/bin/python
TCM=$(ldconfig -p | awk '/libtcmalloc_minimal\.so\.4 /{print $NF; exit}')
PRE="$TCM:$(readlink -f "$ANCHORS_DIR/venv-vllm/lib/libiomp5.so")"
for i in 1 2 3; do
  echo "== vllm bs1 $i $(date)"
  LD_PRELOAD=$PRE flock /tmp/pagedllm-bench.lock $VLLM_PY $A/bench_vllm.py --model $M --workload $W --num-requests 10 --max-num-seqs 1 --bind 0-1 --label "bs1-bind0-1+preload run$i" --results $R/anchors.jsonl > $R/vllm-bs1-run$i.log 2>&1
  grep RESULT $R/vllm-bs1-run$i.log | tail -1 | grep -o '"ms_per_output_token": [0-9.]*'
done
