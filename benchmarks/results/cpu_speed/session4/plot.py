"""A session's side by side as bar charts (speed.png): offline throughput and batch-size-1 latency.

python plot.py [RUN_DIR [ALT_DIR]]: run.sh's JSON in RUN_DIR (default: this folder, session 4),
interleave.sh's in ALT_DIR (default RUN_DIR); speed.png goes to RUN_DIR.
Session 5: python plot.py ../session5 ../session5/final
"""

import json
import statistics
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

here = Path(__file__).parent
run_dir = here / sys.argv[1] if len(sys.argv) > 1 else here
alt_dir = here / sys.argv[2] if len(sys.argv) > 2 else run_dir


def rows(folder: Path, name: str) -> list[dict]:
    return [json.loads(line) for line in (folder / name).open()]


ours, anchors = rows(run_dir, "results.jsonl"), rows(run_dir, "anchors.jsonl")
alternating = rows(alt_dir, "interleaved-anchors.jsonl")
paged = next(r for r in ours if r["label"] == "pagedllm (median of 3)")
paged_alt = [r for r in rows(alt_dir, "results.jsonl") if r["label"].startswith("pagedllm interleaved")]
paged_bs1 = next(r for r in ours if r["bench"] == "latency")
vllm = [r["output_tok_s"] for r in anchors if r["label"].startswith("bind0-1+preload run")]
vllm_bs1 = [r["ms_per_output_token"] for r in anchors if r["label"].startswith("bs1-bind0-1+preload")]
hf8 = next(r for r in anchors if r["label"] == "hf bs8")

fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
names = [
    "pagedllm\nrun.sh",
    "vLLM CPU\nrun.sh",
    "pagedllm\nalternating",
    "vLLM CPU\nalternating",
    "HF generate\nbatch 8",
]
vals = [
    paged["output_tok_s"],
    statistics.median(vllm),
    statistics.median(r["output_tok_s"] for r in paged_alt),
    statistics.median(r["output_tok_s"] for r in alternating),
    hf8["output_tok_s"],
]
a.bar(names, vals, color=["tab:blue", "tab:gray", "tab:blue", "tab:gray", "tab:orange"])
for i, v in enumerate(vals):
    a.text(i, v, f"{v:.0f}", ha="center", va="bottom")
a.set_ylabel("output tok/s (median of 3)")
a.set_title("200 ShareGPT requests, SmolLM2-135M bf16, 2 cores")
b.bar(
    ["pagedllm", "vLLM CPU\nmax_num_seqs=1"],
    [paged_bs1["ms_per_output_token"], statistics.median(vllm_bs1)],
    color=["tab:blue", "tab:gray"],
)
b.set_ylabel("ms per output token (lower is better)")
b.set_title("batch size 1, first 10 requests")
fig.tight_layout()
fig.savefig(run_dir / "speed.png", dpi=100)
