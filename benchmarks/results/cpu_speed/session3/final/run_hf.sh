#!/usr/bin/env bash
# HF transformers static batches of 8 (bf16), first 150 s of batches, as session 2's run_speed.sh.
set -u
export ANCHORS_DIR=${ANCHORS_DIR:-/root/anchors}
R=$(cd "$(dirname "$0")" && pwd)
A=$(cd "$R/../../../../../../shared/anchors" && pwd)
flock /tmp/pagedllm-bench.lock $ANCHORS_DIR/venv-hf/bin/python $A/bench_hf.py --model $ANCHORS_DIR/models/smol135-random \
  --workload $ANCHORS_DIR/workload-200.json --dtype bfloat16 --batch-size 8 --max-seconds 150 --label "hf bs8" \
  --results $R/anchors.jsonl > $R/hf-bs8.log 2>&1
tail -1 $R/hf-bs8.log
