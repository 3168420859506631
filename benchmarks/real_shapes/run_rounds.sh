#!/usr/bin/env bash
# run_baseline.sh's parts in rounds, for bars that one pass does not decide: on a shared 2-core
# machine the read bandwidth and both engines' speed move by 20-30% within minutes. ROUNDS passes,
# each into OUT/round-N (the PARTS of run_baseline.sh, llama.cpp then pagedllm, one after the
# other), then summarize_rounds.py: each round's figures and ratios, and their medians.
#
#   Decode against the floor (8B):
#   LLAMACPP_BIN=... OUT=/tmp/real-shapes/raw-floor PREFIX=llama3-8b-random QUANTS=Q4_K_M ROUNDS=4 \
#     bash benchmarks/real_shapes/run_rounds.sh
#   32 x (150 + 128), both engines:
#   LLAMACPP_BIN=... OUT=/tmp/real-shapes/raw-batched QUANTS=Q4_0 PARTS=batched ROUNDS=4 \
#     bash benchmarks/real_shapes/run_rounds.sh
set -euo pipefail
: "${OUT:?OUT: the folder for the rounds}"
ROUNDS=${ROUNDS:-4}
PARTS=${PARTS:-bandwidth decode}
for r in $(seq 1 "$ROUNDS"); do
  echo "=== round $r of $ROUNDS: $PARTS"
  OUT="$OUT/round-$r" PARTS="$PARTS" bash "$(dirname "$0")/run_baseline.sh" > /dev/null
done
python3 "$(dirname "$0")/summarize_rounds.py" "$OUT"
