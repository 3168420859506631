"""Alternating rounds as a chart (speed.png): output tok/s of vLLM and pagedllm per round, with the
host's page-aging tax measured just before each round (interleave_probe.sh's output).

python plot.py [DIR]   (reads results.jsonl, interleaved-anchors.jsonl and probe-run*.log in DIR,
default this directory, session 7's; writes DIR/speed.png; session 8: python plot.py ../session8)
"""

import json
import re
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

here = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent


def rows(name: str) -> list[dict]:
    return [json.loads(line) for line in (here / name).open()]


def by_round(name: str, prefix: str) -> dict[int, float]:
    return {int(r["label"].rsplit("run", 1)[1]): r["output_tok_s"] for r in rows(name) if r["label"].startswith(prefix)}


ours = by_round("results.jsonl", "pagedllm interleaved")
vllm = by_round("interleaved-anchors.jsonl", "interleaved")
rounds = sorted(ours)
tax = []
for i in rounds:
    text = (here / f"probe-run{i}.log").read_text()
    tax.append(float(re.search(r"1024 pages in use, touched every 100 ms:.*= +(\d+) us", text).group(1)))

fig, ax = plt.subplots(figsize=(7, 4))
width = 0.38
xs = range(len(rounds))
ax.bar([x - width / 2 for x in xs], [vllm[i] for i in rounds], width, label="vLLM 0.32.0 CPU (best config)")
ax.bar([x + width / 2 for x in xs], [ours[i] for i in rounds], width, label="pagedllm")
for x, i in zip(xs, rounds, strict=True):
    ax.text(x + width / 2, ours[i] + 8, f"{ours[i] / vllm[i]:.2f}x", ha="center", fontsize=9)
ax.set_xticks(list(xs), [f"round {i}\nhost tax {t:.0f} us/page/s" for i, t in zip(rounds, tax, strict=True)])
ax.set_ylabel("output tokens / s")
ax.set_title(f"200-request workload, strictly alternating ({here.resolve().name})")
ax.legend(loc="lower right")
fig.tight_layout()
fig.savefig(here / "speed.png", dpi=110)
print("wrote", here / "speed.png")
