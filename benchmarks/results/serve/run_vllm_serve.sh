#!/usr/bin/env bash
set -u
M=/root/anchors/models/smol135-random
R=/work/main/benchmarks/results/serve
cd /work/main
# vLLM's best CPU configuration (its docs): tcmalloc + Intel OpenMP preloaded, both cores bound.
TCM=$(ldconfig -p | awk '/libtcmalloc_minimal\.so\.4 /{print $NF; exit}')
PRE="$TCM:$(readlink -f /root/anchors/venv-vllm/lib/libiomp5.so)"
LD_PRELOAD=$PRE VLLM_CPU_KVCACHE_SPACE=4 VLLM_CPU_OMP_THREADS_BIND=0-1 /root/anchors/venv-vllm/bin/python -m vllm.entrypoints.openai.api_server \
  --model $M --host 127.0.0.1 --port 8012 --served-model-name smol135 --dtype bfloat16 > /root/anchors/vllm-server.log 2>&1 &
SP=$!
for i in $(seq 1 240); do curl -sf http://127.0.0.1:8012/health >/dev/null && break; sleep 1; done
echo "ready after $i s"
for rate in 1 4 inf; do
  echo "== rate $rate $(date)"
  timeout 300 pagedllm bench serve --base-url http://127.0.0.1:8012 --model smol135 --request-rate $rate \
    --num-prompts 40 --workload sharegpt --result-json $R/vllm-rate-$rate.json 2>&1 | grep -E "Successful|Failed|Output token|TTFT|TPOT|E2E"
done
kill $SP; sleep 3; pkill -f "port 8012" || true
echo "== done $(date)"
