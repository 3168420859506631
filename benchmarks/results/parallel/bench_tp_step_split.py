"""Tensor parallel on this machine: a decode step split into compute, the model's collectives and
the step broadcast, at TP=1 (one and two threads) and TP=2 (one thread per rank).

    python3 benchmarks/results/parallel/bench_tp_step_split.py [--steps 36] [--repeats 3]

writes tp_step_split.json, tp_step_split.md and tp_step_split.png beside this script. The script
takes /tmp/pagedllm-bench.lock itself (one timed run at a time on a small machine): do not wrap
it in `flock` as well, it would wait for its own parent.

Model: a random-weight fp32 Llama (hidden 1024, 8 layers, 8 query / 4 KV heads, intermediate
2816, vocabulary 32000), greedy, 1 and then 16 requests of 32 prompt tokens on one engine per
config. Per decode step the driver (rank 0) records its wall time, the time inside the model's
collectives (all-reduce after o_proj and down_proj, the embedding's all-reduce, the head's
gather: this includes waiting for the slower rank), the time of the step broadcast (the pickled
SchedulerOutput), how many collectives ran and how many bytes each one carried.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

from bench_lock import bench_lock  # this folder: the script's own directory is on sys.path

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))

MODEL = dict(
    vocab_size=32000,
    hidden_size=1024,
    intermediate_size=2816,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=1024,
    tie_word_embeddings=False,
)
CONFIGS = ((1, 1), (1, 2), (2, 1))  # (tensor_parallel_size, threads per rank)
BATCHES = (1, 16)
PROMPT_LEN = 32
WARMUP_STEPS = 4  # the first decode steps warm the allocator and the kernels up


def build_model(out_dir: str) -> str:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    sys.path.insert(0, os.path.join(REPO, "tests"))
    from tiny_models import build_tokenizer

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**MODEL)).save_pretrained(out_dir, safe_serialization=True)
    build_tokenizer(out_dir)
    return out_dir


class StepRecorder:
    """Wraps the engine's runner and (at TP>1) the driver's group: per decode step, its wall time,
    the time inside the model's collectives and the step broadcast, and the collectives' bytes."""

    def __init__(self, runner, group) -> None:
        self.group = group
        self.steps: list[dict] = []
        self._bytes: list[tuple[str, int]] = []
        self._broadcast = 0.0
        self._execute = runner.execute
        runner.execute = self.execute
        if group is not None:
            self._wrap(group, "all_reduce", lambda x: x.numel() * x.element_size())
            # Each rank's part; every rank receives world_size parts of this size.
            self._wrap(group, "all_gather", lambda x: x.numel() * x.element_size())
            broadcast = group.broadcast_object

            def timed_broadcast(obj=None):
                t0 = time.perf_counter()
                out = broadcast(obj)
                self._broadcast += time.perf_counter() - t0
                return out

            group.broadcast_object = timed_broadcast

    def _wrap(self, group, name: str, nbytes) -> None:
        call = getattr(group, name)

        def counted(x):
            t0 = time.perf_counter()
            out = call(x)
            self._bytes.append((name, nbytes(x), time.perf_counter() - t0))
            return out

        setattr(group, name, counted)

    def execute(self, sched):
        group = self.group
        decode = bool(sched.num_scheduled_tokens) and all(n == 1 for n in sched.num_scheduled_tokens.values())
        c0, n0 = (group.comm_seconds, group.num_collectives) if group else (0.0, 0)
        self._bytes.clear()
        self._broadcast = 0.0
        t0 = time.perf_counter()
        out = self._execute(sched)
        wall = time.perf_counter() - t0
        if decode:
            self.steps.append(
                dict(
                    wall=wall,
                    comm=(group.comm_seconds - c0) if group else 0.0,
                    broadcast=self._broadcast,
                    collectives=(group.num_collectives - n0) if group else 0,
                    bytes=list(self._bytes),
                )
            )
        return out


def run_config(model_dir: str, tp: int, threads: int, steps: int) -> list[dict]:
    """One engine; for each decode batch in BATCHES, that many greedy requests for `steps` decode
    steps: the medians of its steps. One engine serves every batch size: its start-up (spawning
    and loading the ranks) is most of a run's time and none of what is measured."""
    from pagedllm import LLM, SamplingParams

    llm = LLM(model=model_dir, dtype="float32", num_kv_blocks=256, tensor_parallel_size=tp, num_threads=threads)
    runner = llm.llm_engine.runner
    rec = StepRecorder(runner, runner.executor.tp if tp > 1 else None)
    params = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True, detokenize=False)
    results = []
    try:
        for batch in BATCHES:
            rec.steps.clear()
            prompts = [{"prompt_token_ids": [5 + i] * PROMPT_LEN} for i in range(batch)]
            llm.generate(prompts, params, use_tqdm=False)
            results.append(dict(batch=batch, **step_medians(rec.steps[WARMUP_STEPS:])))
    finally:
        if tp > 1:
            runner.shutdown()
    return results


def step_medians(kept: list[dict]) -> dict:
    each: dict[str, list[float]] = {}  # "kind bytes" -> seconds of every such collective
    for s in kept:
        for name, n, dt in s["bytes"]:
            each.setdefault(f"{name} {n}", []).append(dt)
    return dict(
        step_ms=statistics.median(s["wall"] for s in kept) * 1e3,
        collectives_ms=statistics.median(s["comm"] for s in kept) * 1e3,
        broadcast_ms=statistics.median(s["broadcast"] for s in kept) * 1e3,
        collectives_per_step=statistics.median(s["collectives"] for s in kept),
        us_by_collective={k: statistics.median(v) * 1e6 for k, v in sorted(each.items())},
        count_by_collective={k: len(v) // len(kept) for k, v in sorted(each.items())},
        steps=len(kept),
    )


def machine() -> dict:
    import torch

    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout
    except OSError:
        rev = ""
    return dict(
        cpu=cpu,
        cpu_count=os.cpu_count(),
        cpus_usable=len(os.sched_getaffinity(0)),
        torch=torch.__version__,
        python=platform.python_version(),
        pagedllm_revision=rev.strip() or None,
    )


def summarize(runs: list[dict]) -> list[dict]:
    """Per (batch, tp, threads): the median over repeats of each run's medians."""
    rows = []
    for batch in BATCHES:
        for tp, threads in CONFIGS:
            mine = [r for r in runs if (r["batch"], r["tp"], r["threads"]) == (batch, tp, threads)]
            row = dict(batch=batch, tp=tp, threads=threads, repeats=len(mine))
            for key in ("step_ms", "collectives_ms", "broadcast_ms", "collectives_per_step"):
                row[key] = statistics.median(r[key] for r in mine)
            row["compute_ms"] = row["step_ms"] - row["collectives_ms"] - row["broadcast_ms"]
            row["step_ms_per_repeat"] = [round(r["step_ms"], 2) for r in mine]
            row["count_by_collective"] = mine[0]["count_by_collective"]
            row["us_by_collective"] = {
                k: statistics.median(r["us_by_collective"][k] for r in mine) for k in row["count_by_collective"]
            }
            if row["collectives_per_step"]:
                row["us_per_collective"] = row["collectives_ms"] * 1e3 / row["collectives_per_step"]
            rows.append(row)
    return rows


def fmt_bytes(n: int) -> str:
    return f"{n // 1024} KiB" if n >= 1024 and n % 1024 == 0 else f"{n} B"


def markdown(result: dict) -> str:
    m, a = result["machine"], result["args"]
    lines = [
        "# Tensor parallel: a decode step split into compute and collectives",
        "",
        f"Random-weight fp32 Llama (hidden {MODEL['hidden_size']}, {MODEL['num_hidden_layers']} layers, "
        f"{MODEL['num_attention_heads']} query / {MODEL['num_key_value_heads']} KV heads, intermediate "
        f"{MODEL['intermediate_size']}, vocabulary {MODEL['vocab_size']}), greedy, {PROMPT_LEN}-token prompts, "
        f"{a['steps']} decode steps per run (the first {WARMUP_STEPS} dropped); each figure is the median over "
        f"{a['repeats']} runs of the run's median step. Runs are interleaved: every repeat starts each config's "
        "engine once (in rotated order) and runs decode batch " + " then ".join(map(str, BATCHES)) + " on it.",
        f"Machine: {m['cpu']}, {m['cpus_usable']} usable CPUs, torch {m['torch']}, shared with other work"
        + (
            " (load average over 1 min: {:.1f} before, {:.1f} after).".format(
                result["load_average_1_5_15_min"]["before"][0], result["load_average_1_5_15_min"]["after"][0]
            )
            if "load_average_1_5_15_min" in result
            else "."
        ),
        "",
        "Made by `python3 benchmarks/results/parallel/bench_tp_step_split.py` (it takes "
        f"`/tmp/pagedllm-bench.lock` itself; {result['seconds_under_lock']:.0f} s under the lock).",
        "",
        "step = the driver's wall time of a decode step; collectives = inside the model's all-reduces and the "
        "head's gather (including waiting for the slower rank: an upper bound on the communication); "
        "broadcast = sending the step's SchedulerOutput to the worker; compute = the rest.",
        "",
        "| decode batch | TP | threads per rank | step (ms) | compute (ms) | collectives (ms) | broadcast (ms) "
        "| collectives / step | mean per collective (us) | step per repeat (ms) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        tp2 = r["tp"] > 1
        lines.append(
            f"| {r['batch']} | {r['tp']} | {r['threads']} | {r['step_ms']:.1f} | {r['compute_ms']:.1f} | "
            + (
                f"{r['collectives_ms']:.1f} | {r['broadcast_ms']:.2f} | {r['collectives_per_step']:.0f} | "
                f"{r['us_per_collective']:.0f} | "
                if tp2
                else "- | - | - | - | "
            )
            + ", ".join(f"{x:.1f}" for x in r["step_ms_per_repeat"])
            + " |"
        )
    lines += [
        "",
        "Bytes per collective at TP=2 (one rank's message; an fp32 all-reduce carries tokens x hidden x 4 bytes; "
        "the greedy head gathers each rank's (max, index) as float64), and the median time of one in the step "
        "(the mean above is higher: a few collectives wait milliseconds for a rank the shared cores did not run):",
        "",
        "| decode batch | collective | per step | bytes | median in the step (us) | bytes / time |",
        "|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        if r["tp"] == 1:
            continue
        for key, count in r["count_by_collective"].items():
            kind, n = key.split()
            us = r["us_by_collective"][key]
            mbps = int(n) / (us * 1e-6) / 1e6
            lines.append(f"| {r['batch']} | {kind} | {count} | {fmt_bytes(int(n))} | {us:.0f} | {mbps:.2f} MB/s |")
    lines += ["", "![compute vs collectives](tp_step_split.png)", ""]
    return "\n".join(lines)


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    labels = [f"batch {r['batch']}\nTP={r['tp']}\n{r['threads']} thr/rank" for r in rows]
    compute = [r["compute_ms"] for r in rows]
    coll = [r["collectives_ms"] for r in rows]
    bcast = [r["broadcast_ms"] for r in rows]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    ax.bar(labels, compute, label="compute")
    ax.bar(labels, coll, bottom=compute, label="model collectives")
    ax.bar(labels, bcast, bottom=[c + k for c, k in zip(compute, coll, strict=True)], label="step broadcast")
    ax.set_ylabel("ms per decode step (median)")
    ax.set_ylim(0, max(r["step_ms"] for r in rows) * 1.3)  # room for the legend above the bars
    ax.set_title("Decode step: compute vs collectives (2-core CPU, gloo)")
    ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=36, help="decode steps per run (the first 4 are dropped)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out-dir", default=HERE)
    p.add_argument("--from-json", action="store_true", help="only rewrite the md and png from the out-dir's JSON")
    args = p.parse_args()
    if args.from_json:
        with open(os.path.join(args.out_dir, "tp_step_split.json")) as f:
            write_outputs(json.load(f), args.out_dir)
        return
    if args.steps <= WARMUP_STEPS:
        p.error(f"--steps must be more than the {WARMUP_STEPS} warm-up steps")
    with bench_lock(), tempfile.TemporaryDirectory() as d:
        model_dir = build_model(d)
        runs = []
        t0, load_before = time.perf_counter(), os.getloadavg()
        for rep in range(args.repeats):
            shift = rep % len(CONFIGS)
            for tp, threads in CONFIGS[shift:] + CONFIGS[:shift]:  # no config always runs first
                for r in run_config(model_dir, tp, threads, args.steps):
                    r.update(tp=tp, threads=threads, repeat=rep)
                    print(f"repeat {rep} batch {r['batch']} TP={tp} x{threads}: step {r['step_ms']:.1f} ms", flush=True)
                    runs.append(r)
        seconds = time.perf_counter() - t0
    result = dict(
        machine=machine(),
        model=MODEL,
        args=dict(steps=args.steps, repeats=args.repeats, prompt_len=PROMPT_LEN, warmup_steps=WARMUP_STEPS),
        seconds_under_lock=round(seconds, 1),
        load_average_1_5_15_min=dict(before=load_before, after=os.getloadavg()),
        rows=summarize(runs),
        runs=runs,
    )
    write_outputs(result, args.out_dir)


def write_outputs(result: dict, out_dir: str) -> None:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "tp_step_split.json"), "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.join(out_dir, "tp_step_split.md"), "w") as f:
        f.write(markdown(result))
    plot(result, os.path.join(out_dir, "tp_step_split.png"))
    print(markdown(result))


if __name__ == "__main__":
    main()
