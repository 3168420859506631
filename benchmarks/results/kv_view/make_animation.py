"""compare_kv_animation.gif: `pagedllm bench compare`'s animation of the KV cache, paged beside
each contiguous policy, on a tiny random-weight Llama (tests/tiny_models.py).

Which blocks each layout holds depends only on the scheduler and on the requests' lengths (greedy,
ignore_eos, every request to its max_tokens), not on the weights: a real model gives the same
picture, only its time axis is longer. The alpaca-like workload keeps every request within the tiny
model's 512-token context; 4096 KV slots for every layout.

    flock /tmp/pagedllm-bench.lock python3 benchmarks/results/kv_view/make_animation.py
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(HERE))))

from pagedllm.bench import compare  # noqa: E402
from tests.tiny_models import build_model  # noqa: E402


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        model = build_model("llama", os.path.join(tmp, "llama"))
        parser = argparse.ArgumentParser()
        compare.add_args(parser)
        out = os.path.join(tmp, "out")
        flags = ["--model", model, "--dtype", "float32", "--workload", "alpaca", "--num-prompts", "80"]
        flags += ["--num-kv-tokens", "4096", "--max-model-len", "512", "--num-threads", "1", "--out-dir", out]
        compare.run(parser.parse_args(flags))
        shutil.copy(os.path.join(out, "compare_kv_animation.gif"), os.path.join(HERE, "compare_kv_animation.gif"))


if __name__ == "__main__":
    main()
