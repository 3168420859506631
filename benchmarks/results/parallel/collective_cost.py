"""What each collective would cost per step at 7B-8B and 70B sizes, on paper (no measurement).

    python3 benchmarks/results/parallel/collective_cost.py

writes collective_cost.json and collective_cost.md beside this script, from the formulas and the
parameters below (every assumption is one of them; change one and rerun):

- Tensor parallel over N ranks, ring all-reduce of B bytes over a link of bandwidth W and per-hop
  latency a:  2(N-1)/N * B / W + 2(N-1) * a.  A Llama layer all-reduces twice (after o_proj and
  after down_proj), the vocabulary-parallel embedding once per step, and the head all-gathers the
  logits of the rows it samples ((N-1)/N * B / W + (N-1) * a; every decode row, a prefill
  chunk's last position).  Activations are bf16: B = tokens x hidden x 2.
- Pipeline parallel: one send of the activations (tokens x hidden x 2 bytes) per stage boundary
  per micro-batch:  B / W + a.
- Data parallel: no collective inside a step; the router forwards each request once.
- What the collectives are compared with: a decode step reads every weight once (memory-bandwidth
  bound): weight bytes / (N x HBM bandwidth); a prefill chunk is compute bound:
  2 x parameters x tokens / (N x peak FLOP/s x utilisation).
"""

from __future__ import annotations

import json
import os

HERE = os.path.dirname(os.path.abspath(__file__))

BYTES_PER_ACTIVATION = 2  # bf16
TP = 8  # ranks: one node of 8 accelerators, or 8 nodes of one each (the network rows)
PP_STAGES = 8  # one stage per node across 8 nodes: 7 boundaries
DECODE_BATCHES = (1, 64, 256)
PREFILL_CHUNK = 2048

MODELS = {
    "Llama-2 7B": dict(hidden=4096, layers=32, kv_heads=32, head_dim=128, vocab=32000, params=6.74e9),
    "Llama-3 8B": dict(hidden=4096, layers=32, kv_heads=8, head_dim=128, vocab=128256, params=8.03e9),
    "Llama-3 70B": dict(hidden=8192, layers=80, kv_heads=8, head_dim=128, vocab=128256, params=70.6e9),
}

# Per direction bandwidth (bytes/s) and latency per hop (s) of the link between two ranks.
# NVLink 4 (H100 SXM): 450 GB/s each way; the hop latency is a few hundred ns of wire and ~1 us of
# protocol. PCIe 4.0 x16: ~25 GB/s achieved of 32. RDMA (InfiniBand / RoCE) ~5-10 us per hop,
# kernel TCP 20-50 us: the optimistic end is used, so the network rows are lower bounds.
LINKS = {
    "NVLink (450 GB/s, 1 us)": dict(bandwidth=450e9, latency=1e-6),
    "PCIe 4.0 x16 (25 GB/s, 5 us)": dict(bandwidth=25e9, latency=5e-6),
    "400 Gb/s RDMA (50 GB/s, 5 us)": dict(bandwidth=50e9, latency=5e-6),
    "100 Gb/s RDMA (12.5 GB/s, 5 us)": dict(bandwidth=12.5e9, latency=5e-6),
    "100 Gb/s TCP (12.5 GB/s, 20 us)": dict(bandwidth=12.5e9, latency=20e-6),
}
NETWORK_LINKS = [name for name in LINKS if "Gb/s" in name]

# The accelerator the compute side assumes (H100 SXM): HBM3 bandwidth and dense bf16 peak.
HBM_BANDWIDTH = 3.35e12  # bytes/s per accelerator
PEAK_FLOPS = 989e12  # bf16 dense, per accelerator
PREFILL_UTILISATION = 0.5  # fraction of peak a prefill GEMM reaches
WEIGHT_BYTES_PER_PARAM = 2  # bf16 weights


def ring_all_reduce(nbytes: float, ranks: int, link: dict) -> float:
    """Seconds of one ring all-reduce: reduce-scatter then all-gather, 2(N-1) steps of B/N each."""
    return 2 * (ranks - 1) / ranks * nbytes / link["bandwidth"] + 2 * (ranks - 1) * link["latency"]


def ring_all_gather(nbytes: float, ranks: int, link: dict) -> float:
    """Seconds of one ring all-gather of ``nbytes`` in total (N-1 steps of B/N each)."""
    return (ranks - 1) / ranks * nbytes / link["bandwidth"] + (ranks - 1) * link["latency"]


def send(nbytes: float, link: dict) -> float:
    return nbytes / link["bandwidth"] + link["latency"]


def tp_step(model: dict, tokens: int, sampled: int, link: dict) -> dict:
    """The tensor-parallel collectives of one forward over ``tokens`` tokens at TP ranks, of which
    ``sampled`` rows need logits (every decode token; a prefill chunk's last position only)."""
    activation = tokens * model["hidden"] * BYTES_PER_ACTIVATION
    all_reduces = 2 * model["layers"] + 1  # two per layer, one for the embedding
    logits = sampled * model["vocab"] * BYTES_PER_ACTIVATION
    per_all_reduce = ring_all_reduce(activation, TP, link)
    total = all_reduces * per_all_reduce + ring_all_gather(logits, TP, link)
    return dict(
        bytes_per_all_reduce=activation,
        all_reduces=all_reduces,
        us_per_all_reduce=per_all_reduce * 1e6,
        ms_per_step=total * 1e3,
    )


def compute_ms(model: dict, tokens: int, prefill: bool) -> float:
    """The step's own time at TP ranks: the weight read (decode) or the GEMMs (prefill)."""
    if prefill:
        return 2 * model["params"] * tokens / (TP * PEAK_FLOPS * PREFILL_UTILISATION) * 1e3
    return model["params"] * WEIGHT_BYTES_PER_PARAM / (TP * HBM_BANDWIDTH) * 1e3


def table() -> dict:
    workloads = [(f"decode batch {b}", b, False) for b in DECODE_BATCHES] + [
        (f"prefill chunk {PREFILL_CHUNK}", PREFILL_CHUNK, True)
    ]
    out = {}
    for name, model in MODELS.items():
        rows = []
        for label, tokens, prefill in workloads:
            own = compute_ms(model, tokens, prefill)
            sampled = 1 if prefill else tokens
            tp = {link: tp_step(model, tokens, sampled, LINKS[link]) for link in LINKS}
            activation = tokens * model["hidden"] * BYTES_PER_ACTIVATION
            pp = {link: send(activation, LINKS[link]) * 1e3 for link in NETWORK_LINKS}
            rows.append(
                dict(
                    workload=label,
                    tokens=tokens,
                    compute_ms=own,
                    compute_kind="GEMMs at utilisation" if prefill else "weight read",
                    tp=tp,
                    tp_ratio={link: v["ms_per_step"] / own for link, v in tp.items()},
                    pp_ms_per_boundary=pp,
                    pp_ms_all_boundaries={link: v * (PP_STAGES - 1) for link, v in pp.items()},
                )
            )
        out[name] = dict(
            model=model,
            weight_gb=model["params"] * WEIGHT_BYTES_PER_PARAM / 1e9,
            kv_heads_per_rank=max(1, model["kv_heads"] // TP),
            rows=rows,
        )
    return out


def md_table(columns: list[str], rows: list[list[str]]) -> list[str]:
    """A markdown table's lines."""
    return ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)] + [
        "| " + " | ".join(row) + " |" for row in rows
    ]


def markdown(result: dict) -> str:
    p = result["parameters"]
    lines = [
        "# Collectives on paper: TP, PP and DP at 7B-8B and 70B",
        "",
        "Computed, not measured, by `python3 benchmarks/results/parallel/collective_cost.py` from the formulas "
        "in its docstring. Assumptions (its parameters): bf16 activations and weights; "
        f"TP={p['tp']} ranks; ring all-reduce 2(N-1)/N x bytes / bandwidth + 2(N-1) x hop latency, 2 per layer "
        "+ 1 for the embedding, + the all-gather of the sampled rows' logits (decode: every row; prefill: the "
        "chunk's last); PP: one send per stage boundary per micro-batch, "
        f"{p['pp_stages'] - 1} boundaries over {p['pp_stages']} nodes; accelerator H100 SXM-class: "
        f"{p['hbm_bandwidth'] / 1e12:.2f} TB/s HBM, {p['peak_flops'] / 1e12:.0f} TFLOP/s bf16 at "
        f"{p['prefill_utilisation']:.0%} for prefill. Hop latencies are the optimistic end (RDMA 5-10 us, "
        "TCP 20-50 us): the network rows are lower bounds.",
        "",
        '"own" = the step\'s own time with the weights split over the TP ranks: a decode step reads every '
        "weight once (weight bytes / (N x HBM bandwidth)); a prefill chunk runs its GEMMs.",
        "",
    ]
    links = list(LINKS)
    for name, m in result["models"].items():
        cfg = m["model"]
        lines += [
            f"## {name}: hidden {cfg['hidden']}, {cfg['layers']} layers, {cfg['kv_heads']} KV heads "
            f"({m['kv_heads_per_rank']} per rank at TP={p['tp']}), {m['weight_gb']:.0f} GB of bf16 weights",
            "",
            "TP collectives per step, ms (and x the step's own time):",
            "",
        ]
        lines += md_table(
            ["step", "tokens", "bytes / all-reduce", "own (ms)", *links],
            [
                [
                    r["workload"],
                    str(r["tokens"]),
                    f"{r['tp'][links[0]]['bytes_per_all_reduce'] / 1024:.0f} KiB",
                    f"{r['compute_ms']:.2f}",
                    *(f"{r['tp'][k]['ms_per_step']:.2f} ({r['tp_ratio'][k]:.1f}x)" for k in links),
                ]
                for r in m["rows"]
            ],
        )
        lines += [
            "",
            f"PP across nodes: one activation send per boundary, ms (x{p['pp_stages'] - 1} boundaries for one "
            "micro-batch's trip):",
            "",
        ]
        lines += md_table(
            ["step", *NETWORK_LINKS],
            [
                [
                    r["workload"],
                    *(f"{r['pp_ms_per_boundary'][k]:.3f} ({r['pp_ms_all_boundaries'][k]:.2f})" for k in NETWORK_LINKS),
                ]
                for r in m["rows"]
            ],
        )
        lines.append("")
    lines += [
        "DP: no collective inside a step (each replica runs whole steps on its own); the router forwards "
        "each request once, a few hundred bytes to a few KB over the network.",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    result = dict(
        parameters=dict(
            tp=TP,
            pp_stages=PP_STAGES,
            bytes_per_activation=BYTES_PER_ACTIVATION,
            weight_bytes_per_param=WEIGHT_BYTES_PER_PARAM,
            hbm_bandwidth=HBM_BANDWIDTH,
            peak_flops=PEAK_FLOPS,
            prefill_utilisation=PREFILL_UTILISATION,
            links=LINKS,
        ),
        models=table(),
    )
    with open(os.path.join(HERE, "collective_cost.json"), "w") as f:
        json.dump(result, f, indent=1)
    text = markdown(result)
    with open(os.path.join(HERE, "collective_cost.md"), "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
