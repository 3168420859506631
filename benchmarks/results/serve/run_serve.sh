#!/usr/bin/env bash
# pagedllm's OpenAI server under Poisson load at 1, 4 and inf requests/s (40 sharegpt requests each),
# server and client on the same machine. Results: pagedllm-rate-R.json and stats-after.json here.
#   ANCHORS_DIR=/scratch/anchors bash benchmarks/results/serve/run_serve.sh
# ANCHORS_DIR holds the anchors' model (benchmarks/anchors/README.md, `run_anchors.sh setup`).
set -u
: "${ANCHORS_DIR:?set ANCHORS_DIR (see benchmarks/anchors/README.md)}"
M=$ANCHORS_DIR/models/smol135-random
R=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
cd "$R/../../.."
pagedllm serve "$M" --host 127.0.0.1 --port 8011 --served-model-name smol135 > "$R/server.log" 2>&1 &
SP=$!
for i in $(seq 1 120); do curl -sf http://127.0.0.1:8011/health >/dev/null && break; sleep 1; done
for rate in 1 4 inf; do
  echo "== rate $rate $(date)"
  timeout 400 pagedllm bench serve --base-url http://127.0.0.1:8011 --model smol135 --request-rate $rate \
    --num-prompts 40 --workload sharegpt --result-json "$R/pagedllm-rate-$rate.json" 2>&1 | grep -v INFO | tail -20
done
curl -s http://127.0.0.1:8011/stats > "$R/stats-after.json"
kill $SP
echo "== done $(date)"
