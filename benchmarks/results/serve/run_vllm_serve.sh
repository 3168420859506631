#!/usr/bin/env bash
# vLLM's CPU build serving the same model, loaded by the same client as run_serve.sh (pagedllm bench
# serve, rates 1 / 4 / inf, 40 sharegpt requests). Results: vllm-rate-R.json here.
#   ANCHORS_DIR=/scratch/anchors bash benchmarks/results/serve/run_vllm_serve.sh
# ANCHORS_DIR holds the anchors' model and vLLM venv (benchmarks/anchors/README.md).
set -u
: "${ANCHORS_DIR:?set ANCHORS_DIR (see benchmarks/anchors/README.md)}"
M=$ANCHORS_DIR/models/smol135-random
VLLM_PY=${VLLM_PY:-$ANCHORS_DIR/venv-vllm/bin/python}
R=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
cd "$R/../../.."
# vLLM's best CPU configuration (its docs): tcmalloc + Intel OpenMP preloaded, both cores bound.
TCM=$(ldconfig -p | awk '/libtcmalloc_minimal\.so\.4 /{print $NF; exit}')
PRE="$TCM:$(readlink -f "$(dirname "$VLLM_PY")/../lib/libiomp5.so")"
LD_PRELOAD=$PRE VLLM_CPU_KVCACHE_SPACE=4 VLLM_CPU_OMP_THREADS_BIND=0-1 "$VLLM_PY" -m vllm.entrypoints.openai.api_server \
  --model "$M" --host 127.0.0.1 --port 8012 --served-model-name smol135 --dtype bfloat16 > "$R/vllm-server.log" 2>&1 &
SP=$!
for i in $(seq 1 240); do curl -sf http://127.0.0.1:8012/health >/dev/null && break; sleep 1; done
echo "ready after $i s"
for rate in 1 4 inf; do
  echo "== rate $rate $(date)"
  timeout 300 pagedllm bench serve --base-url http://127.0.0.1:8012 --model smol135 --request-rate $rate \
    --num-prompts 40 --workload sharegpt --result-json "$R/vllm-rate-$rate.json" 2>&1 | grep -E "Successful|Failed|Output token|TTFT|TPOT|E2E"
done
kill $SP
wait $SP 2>/dev/null
echo "== done $(date)"
