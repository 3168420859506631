#!/usr/bin/env bash
# The decode floor bar in rounds: the machine's read bandwidth and both engines' decode speed move
# by 20-30% within minutes on a shared 2-core machine, so one pass of run_baseline.sh's
# "bandwidth decode" parts does not decide a 15% bar. ROUNDS passes, each into OUT/round-N
# (bandwidth probe, llama.cpp tg128, pagedllm 16 in / 129 and / 1 out, one after the other), then
# summarize_rounds.py: each round's floor and ratios, and their medians.
#
#   LLAMACPP_BIN=... OUT=/tmp/real-shapes/raw-floor PREFIX=llama3-8b-random QUANTS=Q4_K_M ROUNDS=4 \
#     bash benchmarks/real_shapes/decode_floor_rounds.sh
set -euo pipefail
: "${OUT:?OUT: the folder for the rounds}"
ROUNDS=${ROUNDS:-4}
for r in $(seq 1 "$ROUNDS"); do
  echo "=== round $r of $ROUNDS"
  OUT="$OUT/round-$r" PARTS="bandwidth decode" bash "$(dirname "$0")/run_baseline.sh" > /dev/null
done
python3 "$(dirname "$0")/summarize_rounds.py" "$OUT"
