"""results.jsonl (from run_bs1.sh) -> results.json + results.md: native GGUF vs dequantized fp32."""

from __future__ import annotations

import json
import os

HERE = os.path.dirname(os.path.abspath(__file__))
CMD = (
    "PYTHONPATH=$PWD flock /tmp/pagedllm-bench.lock python3 -m pagedllm.entrypoints.cli bench latency "
    "--model smollm2-135m-instruct --workload fixed --input-len 150 --output-len 128 --num-prompts 5 "
    "--quantization {q}"
)


def main() -> None:
    with open(os.path.join(HERE, "results.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    out = []
    for r in rows:
        q = r["engine"].get("quantization")
        out.append(
            {
                "quantization": q,
                "weights": "GGUF blocks (Q4_1 layers, Q8_0 embedding / tied head)" if q != "none" and q else "float32",
                "dtype": r["dtype"],
                "ms_per_output_token": r["ms_per_output_token"],
                "walls_s": r["walls_s"],
                "peak_rss_mib": r["peak_rss_mib"],
                "command": CMD.format(q=q if q else "none"),
                "time": r["time"],
            }
        )
    with open(os.path.join(HERE, "results.json"), "w") as f:
        json.dump(out, f, indent=2)
        f.write("\n")
    lines = [
        "# Quantized GGUF execution, batch size 1",
        "",
        "SmolLM2-135M-Instruct (Q4_1 GGUF, 98 MB), 5 requests of 150 prompt + 128 output tokens, one at a",
        "time, 2 cores (AMD Zen 3, AVX2), median of 3 passes; ms per output token, prefill included.",
        "",
        "| quantization | weights in memory | activations | ms / output token | peak RSS (MiB) |",
        "|---|---|---|---|---|",
    ]
    for r in out:
        lines.append(
            f"| {r['quantization']} | {r['weights']} | {r['dtype']} | {r['ms_per_output_token']:.2f} | "
            f"{r['peak_rss_mib']:.0f} |"
        )
    lines += ["", "Commands (`benchmarks/results/quantized/run_bs1.sh` runs both):", ""]
    lines += [f"    {r['command']}" for r in out]
    with open(os.path.join(HERE, "results.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
