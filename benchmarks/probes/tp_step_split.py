"""Tensor parallel on this machine: decode step time split into compute and the collectives.

python tp_step_split.py [batch=16] [steps=64] [hidden=1024] [layers=8]

Builds a random-weight Llama (fp32; 8 query / 4 KV heads, vocabulary 32000) in a temporary folder,
runs `batch` greedy requests for `steps` decode steps at tensor_parallel_size 1 (one and two
threads) and 2 (one thread per rank), and prints per decode step: the driver's wall time, and of it the time inside the
model's collectives (all-reduce, the LM head's gather: this includes waiting for the slower rank).
"""

import statistics
import sys
import tempfile
import time

import torch

from pagedllm import LLM, SamplingParams


def build(out_dir: str, hidden: int, layers: int) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    sys.path.insert(0, "../../tests")
    from tiny_models import build_tokenizer

    cfg = LlamaConfig(
        vocab_size=32000,
        hidden_size=hidden,
        intermediate_size=hidden * 11 // 4,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(out_dir, safe_serialization=True)
    build_tokenizer(out_dir)
    return out_dir


def run(model_dir: str, tp: int, threads: int, batch: int, steps: int) -> tuple[list[float], list[float]]:
    llm = LLM(model=model_dir, dtype="float32", num_kv_blocks=256, tensor_parallel_size=tp, num_threads=threads)
    engine = llm.llm_engine
    runner = engine.runner
    group = runner.executor.tp if tp > 1 else None
    wall, comm = [], []
    execute = runner.execute

    def timed(sched):
        decode = sched.num_scheduled_tokens and all(n == 1 for n in sched.num_scheduled_tokens.values())
        c0 = group.comm_seconds if group else 0.0
        t0 = time.perf_counter()
        out = execute(sched)
        if decode:
            wall.append(time.perf_counter() - t0)
            comm.append((group.comm_seconds - c0) if group else 0.0)
        return out

    runner.execute = timed
    params = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True, detokenize=False)
    llm.generate([{"prompt_token_ids": [5 + i] * 32} for i in range(batch)], params, use_tqdm=False)
    if tp > 1:
        runner.shutdown()
    return wall[4:], comm[4:]  # the first steps warm the allocator up


def main() -> None:
    args = {k: int(v) for k, v in (a.split("=") for a in sys.argv[1:])}
    batch, steps = args.get("batch", 16), args.get("steps", 64)
    with tempfile.TemporaryDirectory() as d:
        model_dir = build(d, args.get("hidden", 1024), args.get("layers", 8))
        print(f"decode step, batch {batch}, median over {steps - 4} steps (ms)")
        print("| TP | threads per rank | step | collectives | compute (step - collectives) |")
        print("|---|---|---|---|---|")
        for tp, threads in ((1, 1), (1, 2), (2, 1)):
            wall, comm = run(model_dir, tp, threads, batch, steps)
            w, c = statistics.median(wall) * 1e3, statistics.median(comm) * 1e3
            print(f"| {tp} | {threads} | {w:.1f} | {c:.1f} | {w - c:.1f} |")


if __name__ == "__main__":
    main()
