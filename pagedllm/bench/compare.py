"""`pagedllm bench compare`: paged KV vs contiguous reservation (the vLLM paper's Orca baselines).

Three modes, each writing ``<mode>.json``, ``<mode>.md`` and PNG plots under --out-dir (the default
mode also an animation of every layout's blocks over the run, ``compare_kv_animation.gif``, when
pillow is installed):

* default (``compare``): one workload through ``paged`` and the contiguous policies ``max``,
  ``pow2``, ``oracle`` at the same KV budget (--num-kv-tokens slots) and the same model. Reports
  KV memory over time, running batch size, throughput, latency, max concurrency, and the paper's
  Figure 2: where KV memory goes (token states / reserved for future tokens / internal
  fragmentation / external fragmentation / free), time-averaged.
* ``--block-sizes 1,2,...``: the block-size study, paged only: waste, throughput and attention
  time per step per block size.
* ``--bs1 N``: batch size 1, first N requests: ms per output token of paged, contiguous and plain
  HF transformers ``generate``.

Requests are all added at t=0 and the bench drives ``LLMEngine.step()`` itself, sampling
``get_stats()`` and the KV manager in every step, right after the scheduler decided (the memory
the step runs with). Time is engine time: the sum of ``step()`` durations less that sampling (a
few ms per step for large paged block tables), in throughput and in request latencies alike.
"""

from __future__ import annotations

import argparse
import gc
import os
import time
from collections.abc import Callable

from pagedllm.bench.engine_driver import run_workload
from pagedllm.bench.workloads import add_workload_args, workload_from_args, workload_summary

# name -> (kv_layout, reserve policy)
LAYOUTS: dict[str, tuple[str, str]] = {
    "paged": ("paged", "max"),
    "max": ("contiguous", "max"),
    "pow2": ("contiguous", "pow2"),
    "oracle": ("contiguous", "oracle"),
}
# What the PagedAttention paper (Fig. 2) measured: fraction of KV memory holding token states.
PAPER_TOKEN_STATES = {"max": 0.204, "pow2": 0.268, "oracle": 0.382, "paged": 0.963}
DEFAULT_OUT_DIR = os.path.join("benchmarks", "results", "compare")


def make_engine(args: argparse.Namespace, layout: str, block_size: int, max_num_seqs: int | None = None):
    from pagedllm.config import EngineConfig
    from pagedllm.engine.llm_engine import LLMEngine

    kv_layout, reserve = LAYOUTS[layout]
    cfg = EngineConfig(
        model=args.model,
        dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        block_size=block_size,
        num_kv_blocks=max(1, args.num_kv_tokens // block_size),
        kv_layout=kv_layout,
        reserve=reserve,
        enable_prefix_caching=False,
        max_model_len=args.max_model_len,
        max_num_seqs=max_num_seqs or args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        num_threads=args.num_threads,
        seed=0,
    )
    engine = LLMEngine(cfg)
    # compare times attention per layout: every layout's decode steps run through the layer loop,
    # where attention_timer sees them (the whole-step decode plan runs attention inside one C++ call)
    drop_plan = getattr(engine.model, "drop_decode_plan", None)
    if drop_plan is not None:
        drop_plan()
    # Warm-up outside the measurement: first calls allocate and pick kernels.
    run_workload(engine, [{"prompt_token_ids": list(range(3, 35)), "max_tokens": 4}], sample_kv=False)
    return engine


def _config_record(args: argparse.Namespace, engine) -> dict:
    return {
        "model": args.model,
        "model_path": engine.model_path,
        "dtype": str(engine.dtype).removeprefix("torch."),
        "kv_cache_dtype": str(engine.kv_dtype).removeprefix("torch."),
        "num_kv_tokens": engine.num_kv_blocks * engine.config.block_size,
        "kv_cache_bytes": engine.num_kv_blocks * engine.kv_bytes_per_block,
        "max_model_len": engine.max_model_len,
        "max_num_seqs": engine.config.max_num_seqs,
        "max_num_batched_tokens": engine.config.max_num_batched_tokens,
        "num_threads": engine.config.num_threads,
    }


def columnar(rows: list[dict]) -> dict[str, list]:
    """[{k: v}, ...] -> {k: [v, ...]}: keys once, not once per sample (a third of the JSON)."""
    keys = list(rows[0]) if rows else []
    return {k: [round(r[k], 4) if isinstance(r[k], float) else r[k] for r in rows] for k in keys}


def _strip(result: dict, max_points: int) -> dict:
    """The result without token ids, with the timeline thinned to about max_points samples
    (every stride-th step; each keeps its own dt) and stored column by column."""
    out = {k: v for k, v in result.items() if k not in ("outputs", "samples", "requests")}
    samples = result["samples"]
    stride = max(1, -(-len(samples) // max_points))
    out["timeline_stride"] = stride
    out["timeline"] = columnar(samples[::stride])
    out["request_latencies_s"] = [round(r["latency"], 3) for r in result["requests"]]
    return out


def _log(msg: str) -> None:
    print(f"[compare {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _workload(args: argparse.Namespace) -> list[dict]:
    from pagedllm.models.loader import load_hf_config
    from pagedllm.models.resolve import resolve_model_path

    return workload_from_args(args, load_hf_config(resolve_model_path(args.model)).vocab_size)


def _free_engine(engine) -> None:
    del engine
    gc.collect()


# ---- modes -------------------------------------------------------------------------------------


def run_layouts(args: argparse.Namespace) -> dict:
    requests = _workload(args)
    layouts = [s.strip() for s in args.layouts.split(",") if s.strip()]
    for name in layouts:
        if name not in LAYOUTS:
            raise SystemExit(f"unknown layout {name!r}; known: {', '.join(LAYOUTS)}")
    results: dict[str, dict] = {}
    outputs: dict[str, dict[int, list[int]]] = {}
    config = None
    for name in layouts:
        bs = args.block_size if name == "paged" else args.contiguous_block_size
        engine = make_engine(args, name, bs)
        config = config or _config_record(args, engine)
        _log(f"{name}: {len(requests)} requests, block_size {bs}, {engine.num_kv_blocks} blocks")
        res = run_workload(engine, requests, time_attention=True, record_blocks=True)
        res["block_size"] = bs
        res["num_kv_blocks"] = engine.num_kv_blocks
        _free_engine(engine)
        _log(
            f"{name}: {res['engine_time_s']:.1f}s, {res['output_tok_s']:.1f} out tok/s, "
            f"max running {res['max_running']}, waste {res['memory']['waste']:.3f}"
        )
        outputs[name] = res.pop("outputs")
        results[name] = res
    # Greedy decoding with the same model: every layout should produce the same tokens. In fp32 it
    # does (tests/test_contiguous.py); in bf16 a different batch composition changes rounding,
    # which can flip a near-tie of random-weight / random-prompt logits: count matching requests.
    ref = next(iter(outputs.values()))
    same = {name: sum(out[i] == ref[i] for i in ref) / len(ref) for name, out in outputs.items()}
    ratios = {}
    if "paged" in results:
        p = results["paged"]
        for name, r in results.items():
            if name != "paged":
                sat = None
                if p["saturated_output_tok_s"] and r["saturated_output_tok_s"]:
                    sat = p["saturated_output_tok_s"] / r["saturated_output_tok_s"]
                ratios[name] = {
                    "output_tok_s": p["output_tok_s"] / r["output_tok_s"],
                    "req_s": p["req_s"] / r["req_s"],
                    "saturated_output_tok_s": sat,
                    "max_running": p["max_running"] / r["max_running"],
                }
    return {
        "mode": "compare",
        "config": config,
        "workload": {"name": args.workload, "seed": args.seed, **workload_summary(requests)},
        "layouts": results,
        "throughput_ratio_paged_over": ratios,
        "identical_outputs": same,
        "paper_token_states": PAPER_TOKEN_STATES,
    }


def run_block_sizes(args: argparse.Namespace) -> dict:
    requests = _workload(args)
    sizes = [int(s) for s in args.block_sizes.split(",") if s.strip()]
    results: dict[str, dict] = {}
    config = None
    for bs in sizes:
        engine = make_engine(args, "paged", bs)
        config = config or _config_record(args, engine)
        _log(f"paged block_size {bs}: {engine.num_kv_blocks} blocks")
        res = run_workload(engine, requests, time_attention=True)
        res.pop("outputs")
        res["block_size"] = bs
        res["num_kv_blocks"] = engine.num_kv_blocks
        _free_engine(engine)
        _log(
            f"block_size {bs}: {res['output_tok_s']:.1f} out tok/s, waste {res['memory']['waste']:.3f}, "
            f"attention {res.get('attention_ms_per_step', float('nan')):.1f} ms/step"
        )
        results[str(bs)] = res
    return {
        "mode": "block_sizes",
        "config": config,
        "workload": {"name": args.workload, "seed": args.seed, **workload_summary(requests)},
        "block_sizes": results,
    }


def _hf_generate(model_path: str, dtype, requests: list[dict], num_threads: int | None) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    if num_threads:
        torch.set_num_threads(num_threads)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
    model.eval()

    def gen(ids: list[int], n: int) -> int:
        x = torch.tensor([ids])
        with torch.inference_mode():
            out = model.generate(
                x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=0,
            )
        return out.shape[1] - len(ids)

    gen(list(range(3, 35)), 4)  # warm-up
    t0 = time.monotonic()
    produced = sum(gen(r["prompt_token_ids"], r["max_tokens"]) for r in requests)
    wall = time.monotonic() - t0
    return {"wall_s": wall, "output_tokens": produced, "ms_per_output_token": 1000 * wall / produced}


def run_bs1(args: argparse.Namespace) -> dict:
    requests = _workload(args)[: args.bs1]
    results: dict[str, dict] = {}
    config = None
    dtype = None
    model_path = None
    for name in ("paged", args.bs1_contiguous):
        bs = args.block_size if name == "paged" else args.contiguous_block_size
        engine = make_engine(args, name, bs, max_num_seqs=1)
        config = config or _config_record(args, engine)
        dtype, model_path = engine.dtype, engine.model_path
        res = run_workload(engine, requests, sample_kv=False)
        res.pop("outputs")
        _free_engine(engine)
        label = "paged" if name == "paged" else f"contiguous ({name})"
        res = {k: v for k, v in res.items() if k not in ("samples", "requests")}
        results[label] = {"block_size": bs, **res}
        _log(f"bs1 {label}: {res['ms_per_output_token']:.2f} ms/token")
    if not args.no_hf:
        results["hf transformers generate"] = _hf_generate(model_path, dtype, requests, args.num_threads)
        _log(f"bs1 HF: {results['hf transformers generate']['ms_per_output_token']:.2f} ms/token")
    return {
        "mode": "bs1",
        "config": config,
        "workload": {"name": args.workload, "seed": args.seed, **workload_summary(requests)},
        "systems": results,
    }


# ---- CLI ---------------------------------------------------------------------------------------


def add_args(parser: argparse.ArgumentParser) -> None:
    add_workload_args(parser)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument(
        "--kv-cache-dtype", default="auto", help="auto, float32, bfloat16, float16, fp8 (= fp8_e4m3), fp8_e5m2, int8"
    )
    parser.add_argument(
        "--num-kv-tokens",
        type=int,
        default=16384,
        help="KV budget in token slots, the same for every layout (blocks: it // block size)",
    )
    parser.add_argument(
        "--max-model-len",
        type=int,
        default=2048,
        help="context length; what the 'max' policy reserves (the paper's 2048)",
    )
    parser.add_argument("--block-size", type=int, default=16, help="paged block size")
    parser.add_argument(
        "--contiguous-block-size",
        type=int,
        default=1,
        help="allocation granularity of the contiguous layouts (1 = exact to the token)",
    )
    parser.add_argument("--layouts", default="paged,max,pow2,oracle")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--num-threads", type=int, default=None)
    parser.add_argument("--out-dir", default=DEFAULT_OUT_DIR)
    parser.add_argument(
        "--block-sizes",
        default=None,
        help="block-size study instead (paged only), e.g. 1,2,4,8,16,32,64,128,256",
    )
    parser.add_argument(
        "--bs1",
        type=int,
        default=None,
        metavar="N",
        help="batch-size-1 mode instead: ms/output token on the first N requests",
    )
    parser.add_argument(
        "--bs1-contiguous",
        default="max",
        choices=("max", "pow2", "oracle"),
        help="contiguous policy timed in --bs1 mode",
    )
    parser.add_argument("--no-hf", action="store_true", help="--bs1: skip HF transformers generate")
    parser.add_argument(
        "--timeline-points",
        type=int,
        default=1500,
        help="per-step samples kept in the JSON per run (plots use all)",
    )


def run(args: argparse.Namespace) -> int:
    from pagedllm.bench import report

    os.makedirs(args.out_dir, exist_ok=True)
    modes: list[tuple[str, Callable[[argparse.Namespace], dict], Callable[[dict, str], list[str]]]] = []
    if args.block_sizes:
        modes.append(("block_sizes", run_block_sizes, report.write_block_sizes))
    if args.bs1:
        modes.append(("bs1", run_bs1, report.write_bs1))
    if not modes:
        modes.append(("compare", run_layouts, report.write_compare))
    for mode, fn, write in modes:
        t0 = time.monotonic()
        result = fn(args)
        result["command_wall_s"] = time.monotonic() - t0
        files = write(result, args.out_dir)  # plots use the full per-step samples
        for res in result.get("layouts", {}).values():
            res.pop("block_frames", None)  # the animation's, not the JSON's
        for key in ("layouts", "block_sizes"):
            for name, res in result.get(key, {}).items():
                result[key][name] = _strip(res, args.timeline_points)
        path = os.path.join(args.out_dir, f"{mode}.json")
        with open(path, "w") as fh:
            fh.write(report.dumps_json(result))
        files.append(path)
        _log("wrote " + ", ".join(files))
    return 0
