"""speed.png from results.json: output tok/s of vLLM and pagedllm per alternating round (every set),
with the host's page-aging tax measured just before each round, and the median ratio per set.

    python3 plot.py   (reads and writes this folder)
"""

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

here = Path(__file__).resolve().parent
result = json.loads((here / "results.json").read_text())
rounds = [(k, r) for k, s in enumerate(result["sets"], 1) for r in s["rounds"]]

fig, ax = plt.subplots(figsize=(9, 4))
width = 0.38
xs = range(len(rounds))
vllm = [r["vllm"]["output_tok_s"] for _, r in rounds]
ours = [r["pagedllm"]["output_tok_s"] for _, r in rounds]
ax.bar([x - width / 2 for x in xs], vllm, width, label="vLLM 0.32.0 CPU (best config)")
ax.bar([x + width / 2 for x in xs], ours, width, label="pagedllm")
for x, v, o in zip(xs, vllm, ours, strict=True):
    ax.text(x + width / 2, o + 8, f"{o / v:.2f}x", ha="center", fontsize=9)


def tick(k: int, r: dict) -> str:
    tax = r["host_tax_us_per_page_s"]
    return f"set {k} round {r['round']}" + ("" if tax is None else f"\nhost tax {tax} us/page/s")


ax.set_xticks(list(xs), [tick(k, r) for k, r in rounds], fontsize=8)
ax.set_ylabel("output tokens / s")
medians = ", ".join(f"set {k}: {s['median_output_tok_s']['ratio']:.2f}x" for k, s in enumerate(result["sets"], 1))
ax.set_title(f"200-request workload, strictly alternating rounds (medians of 3: {medians})", fontsize=10)
ax.set_ylim(0, 1.25 * max(ours))
ax.legend(loc="upper left", ncol=2, fontsize=9)
fig.tight_layout()
fig.savefig(here / "speed.png", dpi=110)
print("wrote", here / "speed.png")
