#!/usr/bin/env bash
# Everything the test suite needs on a fresh machine: what setup.sh installs, the browser the /kv
# page test drives, and the kernels of every instruction-set level this CPU can run (the tests run
# each level's paths). Idempotent: re-running it is quick when everything is already there.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
bash scripts/setup.sh
# pytest, hypothesis, ruff, the official clients, matplotlib and ray: the tests' tools
$PY -m pip install -q -e '.[dev]'
# The browser test (tests/test_kv_view_page.py) drives Debian's chromium through Playwright (its
# own browser download needs more than the package registries). Installed once, as root.
if ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    apt-get update -q
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium
fi
$PY -m pagedllm.kernels.build --isa all
