#!/usr/bin/env bash
# llama.cpp vs pagedllm on the random-weight real-shape GGUFs of make_gguf.py (SmolLM2-1.7B or
# Llama-3-8B shape, quantized by llama-quantize). 2 threads both. Every timed command runs under
# `flock $LOCK`, one at a time, so no two benchmarks share the cores.
#
#   LLAMACPP_BIN  folder with llama-bench (benchmarks/anchors/build_llamacpp.sh: $ANCHORS_DIR/llamacpp/bin)
#   FILE_DIR      folder with smollm2-1.7b-random-{Q4_K_M,Q4_0,Q8_0}.gguf (default /tmp/real-shapes)
#   OUT           raw results folder (default $FILE_DIR/raw); never inside the repository
#   QUANTS        which files (default "Q4_K_M Q4_0 Q8_0")
#   PREFIX        file name prefix (default smollm2-1.7b-random)
#   THREADS       (default 2)   LOCK (default /tmp/pagedllm-bench.lock)
#   PARTS         which measurements (default "bs1 decode batched bandwidth"; bs1 includes prefill 512)
#   BATCHED_QUANTS  files of the batched part (default "Q4_K_M Q4_0")
#   BATCH         concurrent sequences of the batched part (default 32)
#   PAGEDLLM_SRC  pagedllm source tree put first on PYTHONPATH (default: this repository). To measure
#                 a commit while the working tree is being edited, export it once:
#                 git archive HEAD | tar -x -C /tmp/real-shapes/pagedllm-$(git rev-parse --short HEAD)
#
# Measurements (per file):
#   llama.cpp  pg150,128: prompt 150 + 128 generated tokens, 3 repetitions; ms per output token
#              (prefill included) = avg_ns / 1e6 / 128, the same quantity as pagedllm's
#              ms_per_output_token below.
#   llama.cpp  pp512: prefill tok/s (avg_ts).
#   llama.cpp  tg128: pure decode tok/s (extra, for reading the pg figure).
#   pagedllm   bench latency, fixed workload 150 in / 128 out, 3 prompts one after the other, one
#              timed pass (--repeats 1: the 3 prompts are the 3 samples; ~1.5 min at 200 ms/token);
#              reports ms_per_output_token = wall / 384 output tokens, prefill included.
#   pagedllm   prefill: bench latency, 512 in / 1 out (the one token comes from the prefill step's
#              logits, so each request is one 512-token forward + sampling), 1 prompt, 3 timed
#              passes, median: prefill tok/s = 512 / wall_s.
#   pagedllm   decode alone: bench latency 16 in / 129 out and 16 in / 1 out, 1 prompt, 3 passes
#              each: (median wall 129 - median wall 1) / 128 ms per decode step (llama.cpp: tg128).
#   batched    $BATCH x (150 + 128): llama-batched-bench -npp 150 -ntg 128 -npl $BATCH -fa on (its
#              total S t/s) vs pagedllm bench throughput --workload fixed (one timed pass: each is
#              minutes at this size), total tok/s = (prompt + output tokens) / wall.
#   bandwidth  benchmarks/probes/read_bandwidth.py: memory read GB/s at $THREADS threads, for the
#              decode floor (weight bytes per token / bandwidth; summarize.py reads the bytes).
# Then: python3 summarize.py $OUT [RESULTS_DIR] (markdown table, results.json/md and a plot).
set -euo pipefail
: "${LLAMACPP_BIN:?set LLAMACPP_BIN (folder with llama-bench)}"
FILE_DIR=${FILE_DIR:-/tmp/real-shapes}
OUT=${OUT:-$FILE_DIR/raw}
QUANTS=${QUANTS:-Q4_K_M Q4_0 Q8_0}
PREFIX=${PREFIX:-smollm2-1.7b-random}
THREADS=${THREADS:-2}
LOCK=${LOCK:-/tmp/pagedllm-bench.lock}
PARTS=${PARTS:-bs1 decode batched bandwidth}
BATCHED_QUANTS=${BATCHED_QUANTS:-Q4_K_M Q4_0}
BATCH=${BATCH:-32}
REPO=$(cd "$(dirname "$0")/../.." && pwd)
PAGEDLLM_SRC=$(cd "${PAGEDLLM_SRC:-$REPO}" && pwd)
export PYTHONPATH=$PAGEDLLM_SRC${PYTHONPATH:+:$PYTHONPATH}
mkdir -p "$OUT/llamacpp" "$OUT/latency" "$OUT/batched"

{
  lscpu | grep 'Model name'
  grep -m1 -E '^cpu family' /proc/cpuinfo
  grep -m1 -E '^model\s' /proc/cpuinfo
  echo "flags: $(grep -o -w 'avx2\|avx512[a-z_0-9]*\|amx[a-z_0-9]*\|avx_vnni' /proc/cpuinfo | sort -u | tr '\n' ' ')"
  echo "nproc: $(nproc)"
  echo "llama.cpp: $("$LLAMACPP_BIN/llama-bench" --version 2>&1 | head -2 | tr '\n' ' ')"
  if git -C "$PAGEDLLM_SRC" rev-parse --show-toplevel 2>/dev/null | grep -qx "$PAGEDLLM_SRC"; then
    echo "pagedllm: $PAGEDLLM_SRC at $(git -C "$PAGEDLLM_SRC" rev-parse --short HEAD) ($(git -C "$PAGEDLLM_SRC" rev-parse --abbrev-ref HEAD)), $(git -C "$PAGEDLLM_SRC" status --short -uno | wc -l) files modified"
  else
    echo "pagedllm: $PAGEDLLM_SRC (not a git checkout)"
  fi
  date -Is
} > "$OUT/machine.txt"
cat "$OUT/machine.txt"

paged() { flock "$LOCK" python3 -m pagedllm.entrypoints.cli bench "$@" --no-enable-prefix-caching --num-threads "$THREADS"; }
has() { [[ " $PARTS " == *" $1 "* ]]; }

if has bandwidth; then
  flock "$LOCK" python3 "$REPO/benchmarks/probes/read_bandwidth.py" "$THREADS" 2 > "$OUT/bandwidth.json"
  cat "$OUT/bandwidth.json"
fi

for q in $QUANTS; do
  F="$FILE_DIR/$PREFIX-$q.gguf"
  [ -f "$F" ] || { echo "missing $F" >&2; exit 1; }
  python3 "$(dirname "$0")/weight_bytes.py" "$F" > "$OUT/$q-weight-bytes.json"
  if has bs1; then
    echo "== $q: llama.cpp pg150,128"
    flock "$LOCK" "$LLAMACPP_BIN/llama-bench" -m "$F" -pg 150,128 -p 0 -n 0 -t "$THREADS" -r 3 -o json \
      > "$OUT/llamacpp/$q-pg150_128.json"
    echo "== $q: llama.cpp pp512"
    flock "$LOCK" "$LLAMACPP_BIN/llama-bench" -m "$F" -p 512 -n 0 -t "$THREADS" -r 3 -o json \
      > "$OUT/llamacpp/$q-pp512.json"
    echo "== $q: pagedllm 150/128"
    paged latency --model "$F" --workload fixed --input-len 150 --output-len 128 --num-prompts 3 --repeats 1 \
      --kv-cache-memory-gib 1 --label "pagedllm $q pg150,128" --out-dir "$OUT/latency"
    echo "== $q: pagedllm prefill 512"
    paged latency --model "$F" --workload fixed --input-len 512 --output-len 1 --num-prompts 1 --repeats 3 \
      --kv-cache-memory-gib 1 --label "pagedllm $q pp512" --out-dir "$OUT/latency"
  fi
  if has decode; then
    echo "== $q: llama.cpp tg128"
    flock "$LOCK" "$LLAMACPP_BIN/llama-bench" -m "$F" -p 0 -n 128 -t "$THREADS" -r 3 -o json \
      > "$OUT/llamacpp/$q-tg128.json"
    for n in 129 1; do
      echo "== $q: pagedllm 16 in / $n out"
      paged latency --model "$F" --workload fixed --input-len 16 --output-len $n --num-prompts 1 --repeats 3 \
        --kv-cache-memory-gib 1 --label "pagedllm $q decode16+$n" --out-dir "$OUT/latency"
    done
  fi
  if has batched && [[ " $BATCHED_QUANTS " == *" $q "* ]]; then
    echo "== $q: llama-batched-bench $BATCH x (150 + 128)"
    flock "$LOCK" "$LLAMACPP_BIN/llama-batched-bench" -m "$F" -c $((BATCH * 288)) -b 2048 -ub 512 -npp 150 -ntg 128 \
      -npl "$BATCH" -fa on -t "$THREADS" --output-format jsonl > "$OUT/batched/$q-llama-batched-bench.jsonl" 2>/dev/null
    echo "== $q: pagedllm $BATCH x (150 + 128)"
    # KV: float32 at the 1.7B shape is 384 KiB per token; BATCH x 278 tokens
    paged throughput --model "$F" --workload fixed --num-prompts "$BATCH" --input-len 150 --output-len 128 \
      --repeats 1 --kv-cache-memory-gib $(( (BATCH * 278 * 384 / 1048576) + 1 )) --max-num-seqs "$BATCH" \
      --label "pagedllm $q batched$BATCH" --out-dir "$OUT/batched"
  fi
done
python3 "$(dirname "$0")/summarize.py" "$OUT"
