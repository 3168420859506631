#!/usr/bin/env bash
# Session 7: session 4's strictly alternating vLLM / pagedllm throughput rounds, each preceded by
# page_aging.c's probe (output in probe-run$i.log), so that every ratio comes with the host's
# page-aging rate at the time (it moved 4-5x within this session and sets much of the run time).
# The hook is evaluated inside interleave.sh, where $i, $R and $LOCK are set.
#   ./interleave_probe.sh [ROUNDS=3] [OUT_DIR=../session7]   (relative to session4/; session 8: ../session8)
set -u
H=$(cd "$(dirname "$0")" && pwd)
gcc -O2 -o /tmp/page_aging "$H/page_aging.c"
BEFORE_ROUND='echo "== round $i probe $(date)"; flock $LOCK /tmp/page_aging 2 | tee "$R/probe-run$i.log"' \
  bash "$H/../session4/interleave.sh" "${1:-3}" "${2:-../session7}"
