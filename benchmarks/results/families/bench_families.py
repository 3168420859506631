"""Each model family's KV cost and speed through `pagedllm bench throughput`, side by side.

Every family is built at the same small size (random weights, float32: the numbers compare the
architectures, not trained models) and runs the same token-id workload. Families whose
sliding-window layers release blocks are given a window shorter than the context, so the run
exercises the release path.

    flock /tmp/pagedllm-bench.lock python3 benchmarks/results/families/bench_families.py

writes results.json and results.md beside this script (the lock is taken by the caller: one
timed run at a time on a small machine).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))

# A small shared size: 8 layers of width 512, GQA 8/4 where the family has it, 32k vocabulary.
SIZE = dict(vocab_size=32000, hidden_size=512, intermediate_size=1536, num_hidden_layers=8)
WINDOW = 128  # shorter than the workload's prompts (256 tokens): the window is what is kept


def family_configs() -> dict[str, object]:
    """transformers configs of each family at SIZE."""
    import transformers as tf

    llama_like = dict(SIZE, num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=2048)
    return {
        "llama": tf.LlamaConfig(**llama_like),
        "mistral (window 128)": tf.MistralConfig(**llama_like, sliding_window=WINDOW),
        "qwen2": tf.Qwen2Config(**llama_like, tie_word_embeddings=True),
        "qwen3": tf.Qwen3Config(**llama_like, head_dim=64, tie_word_embeddings=True),
        "phi3": tf.Phi3Config(**llama_like, sliding_window=None, pad_token_id=0, bos_token_id=1, eos_token_id=2),
        "gemma3 (5 local : 1 global, window 128)": tf.Gemma3TextConfig(
            **llama_like, head_dim=64, sliding_window=WINDOW, query_pre_attn_scalar=64
        ),
        "gpt2": tf.GPT2Config(
            vocab_size=SIZE["vocab_size"],
            n_embd=SIZE["hidden_size"],
            n_layer=SIZE["num_hidden_layers"],
            n_head=8,
            n_inner=SIZE["intermediate_size"],
            n_positions=2048,
            bos_token_id=0,
            eos_token_id=0,
        ),
        "opt": tf.OPTConfig(
            vocab_size=SIZE["vocab_size"],
            hidden_size=SIZE["hidden_size"],
            ffn_dim=SIZE["intermediate_size"],
            num_hidden_layers=SIZE["num_hidden_layers"],
            num_attention_heads=8,
            max_position_embeddings=2048,
            word_embed_proj_dim=SIZE["hidden_size"],
        ),
    }


def build_checkpoint(cfg, out_dir: str) -> str:
    """Random weights of ``cfg`` saved as a Hugging Face folder (no tokenizer: token-id prompts)."""
    import torch
    from transformers import AutoModelForCausalLM

    if not os.path.exists(os.path.join(out_dir, "config.json")):
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(cfg).save_pretrained(out_dir)
    return out_dir


def run_family(name: str, model_dir: str, args: argparse.Namespace) -> dict:
    out_dir = tempfile.mkdtemp(prefix="families-")
    cmd = [
        sys.executable,
        "-m",
        "pagedllm.entrypoints.cli",
        "bench",
        "throughput",
        "--model",
        model_dir,
        "--skip-tokenizer-init",
        "--dtype",
        "float32",
        "--kv-cache-memory-gib",
        "0.5",
        "--workload",
        "sharegpt",
        "--num-prompts",
        str(args.num_prompts),
        "--input-len",
        str(args.input_len),
        "--output-len",
        str(args.output_len),
        "--repeats",
        str(args.repeats),
        "--label",
        name,
        "--out-dir",
        out_dir,
    ]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        return {"label": name, "error": done.stderr.strip().splitlines()[-1] if done.stderr else "failed"}
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))
    result = json.loads(line.removeprefix("RESULT "))
    result["model"] = f"random-weight {name.split()[0]} at the shared size"  # not the scratch folder's path
    return result


def markdown(rows: list[dict], args: argparse.Namespace) -> str:
    lines = [
        "# Model families: KV cost and speed",
        "",
        f"Every family at one small size ({SIZE['num_hidden_layers']} layers, width {SIZE['hidden_size']}, "
        f"vocabulary {SIZE['vocab_size']}, random weights, float32), the same workload: {args.num_prompts} "
        f"requests of {args.input_len} prompt + {args.output_len} output tokens, all at once, greedy; "
        f"median of {args.repeats} runs. Windowed families use a {WINDOW}-token window.",
        "Made by `flock /tmp/pagedllm-bench.lock python3 benchmarks/results/families/bench_families.py`.",
        "",
        "KV bytes per token = 2 (K and V) x layers x KV heads x head size x 4 bytes: GPT-2 and OPT have",
        "no grouped-query attention (8 KV heads, not 4), so a token of context costs them twice as much",
        "cache, and half as many sequences fit. Mistral's window releases blocks as sequences grow past",
        "it (KV held per sequence stays ~window-sized); Gemma 3's global layers keep every block.",
        "",
        "| family | architecture | parameters | KV bytes / token | output tok/s | total tok/s | ms / output token |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['label']} | not run: {r['error']} | | | | | |")
            continue
        lines.append(
            f"| {r['label']} | {r['architecture']} | {r['model_params'] / 1e6:.1f} M | {r['kv_bytes_per_token']:,} "
            f"| {r['output_tok_s']:.1f} | {r['total_tok_s']:.1f} | {r['ms_per_output_token']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work-dir", default=os.path.join(tempfile.gettempdir(), "pagedllm-family-checkpoints"))
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--only", nargs="*", default=None, help="family names to run (default: all)")
    args = p.parse_args()
    rows = []
    for name, cfg in family_configs().items():
        if args.only and name.split()[0] not in args.only:
            continue
        model_dir = build_checkpoint(cfg, os.path.join(args.work_dir, name.split()[0]))
        rows.append(run_family(name, model_dir, args))
        print(json.dumps(rows[-1], sort_keys=True), flush=True)
    with open(os.path.join(HERE, "results.json"), "w") as fh:
        json.dump(rows, fh, indent=1, sort_keys=True)
    with open(os.path.join(HERE, "results.md"), "w") as fh:
        fh.write(markdown(rows, args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
