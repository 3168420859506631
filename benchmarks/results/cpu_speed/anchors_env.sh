# Shared set-up of the CPU speed scripts (sourced): the anchors' model, workload, scripts and venvs,
# the benchmark lock, and vLLM's best configuration (its CPU docs: tcmalloc + Intel OpenMP preloaded).
# Needs the anchors set up (../shared/anchors/README.md).
export ANCHORS_DIR=${ANCHORS_DIR:-/root/anchors}
M=$ANCHORS_DIR/models/smol135-random
W=$ANCHORS_DIR/workload-200.json
CPU_SPEED_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO_DIR=$(cd "$CPU_SPEED_DIR/../../.." && pwd)
A=$(cd "$REPO_DIR/../shared/anchors" && pwd)
LOCK=/tmp/pagedllm-bench.lock
VLLM_PY=$ANCHORS_DIR/venv-vllm/bin/python
HF_PY=$ANCHORS_DIR/venv-hf/bin/python
TCM=$(ldconfig -p | awk '/libtcmalloc_minimal\.so\.4 /{print $NF; exit}')
PRE="$TCM:$(readlink -f "$ANCHORS_DIR/venv-vllm/lib/libiomp5.so")"
