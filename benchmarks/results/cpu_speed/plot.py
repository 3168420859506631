"""Bar charts of this folder's side-by-side runs: offline throughput and batch-size-1 latency."""

import json
import statistics
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

here = Path(__file__).parent
ours = [json.loads(line) for line in (here / "results.jsonl").open()]
anchors = [json.loads(line) for line in (here / "anchors.jsonl").open()]
thr = [r for r in ours if r["bench"] == "throughput"][-1]  # the newest: with tcmalloc
lat = next(r for r in ours if r["bench"] == "latency")
vllm = [r for r in anchors if r["label"].startswith("bind0-1+preload run") and "drift" not in r["label"]]
vllm_bs1 = [r for r in anchors if r["label"].startswith("bs1-bind0-1+preload")]
hf8 = next(r for r in anchors if r["label"] == "hf bs8")
hf1 = next(r for r in anchors if r["label"] == "hf bs1")

fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
drift = next(r for r in anchors if "drift" in r["label"])
names = [
    "pagedllm\n(+tcmalloc)",
    "vLLM CPU 0.32.0\nruns 1-3",
    "vLLM run 4\n(right after)",
    "HF generate\nstatic batch 8",
]
vals = [
    thr["output_tok_s"],
    statistics.median(r["output_tok_s"] for r in vllm),
    drift["output_tok_s"],
    hf8["output_tok_s"],
]
a.bar(names, vals, color=["tab:blue", "tab:orange", "tab:orange", "tab:gray"])
a.set_ylabel("output tokens / s (median of 3; HF: first 32 requests)")
a.set_title("200 ShareGPT requests, SmolLM2-135M bf16, 2 cores")
for i, v in enumerate(vals):
    a.text(i, v, f"{v:.0f}", ha="center", va="bottom")
names = ["pagedllm", "vLLM CPU\nmax_num_seqs=1", "HF generate\neager bf16"]
vals = [
    lat["ms_per_output_token"],
    statistics.median(r["ms_per_output_token"] for r in vllm_bs1),
    hf1["ms_per_output_token"],
]
b.bar(names, vals, color=["tab:blue", "tab:orange", "tab:gray"])
b.set_ylabel("ms per output token (lower is better)")
b.set_title("batch size 1, first 10 requests")
for i, v in enumerate(vals):
    b.text(i, v, f"{v:.1f}", ha="center", va="bottom")
fig.tight_layout()
fig.savefig(here / "speed.png", dpi=110)
print("wrote", here / "speed.png")
