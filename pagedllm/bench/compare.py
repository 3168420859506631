"""`pagedllm bench compare`: paged KV vs contiguous reservation (the vLLM paper's Orca baselines).

Three modes, each writing ``<mode>.json``, ``<mode>.md`` and PNG plots under --out-dir:

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
from contextlib import contextmanager

from pagedllm.bench.workloads import add_workload_args, load_workload, workload_summary

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


# ---- driving the engine ------------------------------------------------------------------------


@contextmanager
def kv_sampler(engine, enabled: bool = True):
    """Snapshots KV memory right after each ``schedule()``, i.e. the memory the step runs with.

    Sampling after ``step()`` instead would miss what the step used (finished requests are already
    freed, the next admissions not yet made). Wraps the scheduler instance's method; the engine's
    files are untouched. Yields [last snapshot or None, seconds spent sampling].
    """
    state: list = [None, 0.0]
    if not enabled:
        yield state
        return
    sched = engine.scheduler
    orig = sched.schedule

    def schedule():
        out = orig()
        t = time.monotonic()
        state[0] = _kv_sample(engine, out)
        state[1] += time.monotonic() - t
        return out

    sched.schedule = schedule
    try:
        yield state
    finally:
        del sched.schedule  # back to the class's method


@contextmanager
def attention_timer():
    """Times every paged_attention call of the Llama-family model (CPU: calls are synchronous).

    Yields a one-element list holding the accumulated seconds; [None] if the model module has no
    ``paged_attention`` to wrap (then attention time is not measurable and is reported as such).
    """
    import pagedllm.models.llama as llama

    orig = getattr(llama, "paged_attention", None)
    acc: list[float | None] = [None if orig is None else 0.0]
    if orig is None:
        yield acc
        return

    def timed(*a, **kw):
        t = time.perf_counter()
        try:
            return orig(*a, **kw)
        finally:
            acc[0] += time.perf_counter() - t

    llama.paged_attention = timed
    try:
        yield acc
    finally:
        llama.paged_attention = orig


def _kv_sample(engine, sched) -> dict:
    """KV memory in slots while the step ``sched`` runs, split the way the paper's Figure 2 does.

    Per running request: used = tokens in the cache once this step has written its K/V,
    reserved = its block table x block_size, final = the most tokens it will ever hold
    (prompt + max_tokens - 1: the last sampled token is never fed back). Reserved slots it will
    fill later are ``future``; reserved slots it never fills are internal fragmentation.
    """
    st = engine.get_stats()
    kv = engine.kv_manager.stats()
    bs = engine.kv_manager.block_size
    new = {s.request.request_id: s.num_new_tokens for s in sched.scheduled}
    future = internal = 0
    for r in engine.scheduler.running:
        rid = r.request_id
        res = len(engine.kv_manager.block_table(rid)) * bs
        final = min(res, r.num_prompt_tokens + r.max_tokens - 1)
        future += max(0, final - r.num_computed_tokens - new.get(rid, 0))
        internal += res - final
    return {
        "running": st["num_requests_running"],
        "waiting": st["num_requests_waiting"],
        "total": st["kv_slots_total"],
        "used": st["kv_slots_used"],
        "reserved": st["kv_slots_reserved"],
        "free": kv.free,
        "unusable_free": kv.unusable_free,
        "future": future,
        "internal": internal,
    }


def _percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    k = (len(s) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def run_workload(engine, requests: list[dict], sample_kv: bool = True, time_attention: bool = False) -> dict:
    """Runs every request to exactly max_tokens (greedy, ignore_eos) and returns the measurements.

    Returns {"outputs": {request index: token ids}, "samples": [per step], "requests": [per request],
    plus totals}. Latencies are in engine time, from t=0 when every request arrived.
    """
    from pagedllm.sampling_params import SamplingParams

    preempt0 = engine.scheduler.num_preemptions
    ids = []
    for i, r in enumerate(requests):
        sp = SamplingParams(temperature=0.0, max_tokens=r["max_tokens"], ignore_eos=True, detokenize=False)
        prompt = {"prompt_token_ids": r["prompt_token_ids"]} if "prompt_token_ids" in r else r["prompt"]
        ids.append(engine.add_request(f"bench-{i}", prompt, sp))
    index = {rid: i for i, rid in enumerate(ids)}
    samples: list[dict] = []
    per_request: list[dict | None] = [None] * len(ids)
    outputs: dict[int, list[int]] = {}
    first_token: dict[int, float] = {}
    # Engine time: the sum of step() durations less the KV sampling inside them. Every request
    # arrived at engine time 0, and a request's latency is the engine time at the end of the step
    # that finished it, so the sampling never counts.
    engine_time = 0.0
    stalled = 0
    wall0 = time.monotonic()
    with attention_timer() as attn, kv_sampler(engine, sample_kv) as snap:
        attn_prev = attn[0] or 0.0
        while engine.has_unfinished_requests():
            t0 = time.monotonic()
            sampling0 = snap[1]
            outs = engine.step()
            dt = time.monotonic() - t0 - (snap[1] - sampling0)
            engine_time += dt
            sample = {"t": engine_time, "dt": dt, "tokens": len(outs)}
            stalled = stalled + 1 if not outs and engine.scheduler.num_running == 0 else 0
            if stalled > 100:
                raise RuntimeError("the engine admits nothing: a waiting request can never be scheduled")
            if attn[0] is not None and time_attention:
                sample["attn"] = attn[0] - attn_prev
                attn_prev = attn[0]
            for o in outs:
                i = index[o.request_id]
                first_token.setdefault(i, engine_time)
                if o.finished:
                    per_request[i] = {
                        "latency": engine_time,
                        "ttft": first_token[i],
                        "prompt_tokens": len(o.prompt_token_ids),
                        "output_tokens": len(o.outputs[0].token_ids),
                    }
                    outputs[i] = o.outputs[0].token_ids
            if sample_kv:
                sample.update(snap[0])
            else:
                sample["running"] = engine.scheduler.num_running
                sample["waiting"] = engine.scheduler.num_waiting
            samples.append(sample)
    done = [r for r in per_request if r is not None]
    assert len(done) == len(ids), "some requests did not finish"
    out_tokens = sum(r["output_tokens"] for r in done)
    prompt_tokens = sum(r["prompt_tokens"] for r in done)
    lat = [r["latency"] for r in done]
    result = {
        "num_requests": len(done),
        "prompt_tokens": prompt_tokens,
        "output_tokens": out_tokens,
        "engine_time_s": engine_time,
        "wall_s": time.monotonic() - wall0,
        "num_steps": len(samples),
        "output_tok_s": out_tokens / engine_time,
        "total_tok_s": (out_tokens + prompt_tokens) / engine_time,
        "req_s": len(done) / engine_time,
        "ms_per_output_token": 1000 * engine_time / out_tokens,
        "latency_mean_s": sum(lat) / len(lat),
        "latency_p50_s": _percentile(lat, 0.5),
        "latency_p99_s": _percentile(lat, 0.99),
        "norm_latency_mean_s_per_tok": sum(r["latency"] / r["output_tokens"] for r in done) / len(done),
        "max_running": max(s["running"] for s in samples),
        "mean_running": sum(s["running"] * s["dt"] for s in samples) / engine_time,
        "num_preemptions": engine.scheduler.num_preemptions - preempt0,
        "mean_step_ms": 1000 * engine_time / len(samples),
        "samples": samples,
        "requests": per_request,
        "outputs": outputs,
    }
    if time_attention and samples and "attn" in samples[0]:
        attn_total = sum(s["attn"] for s in samples)
        result["attention_s"] = attn_total
        result["attention_ms_per_step"] = 1000 * attn_total / len(samples)
        result["attention_fraction"] = attn_total / engine_time
    sat = [s for s in samples if s["waiting"] > 0]
    sat_time = sum(s["dt"] for s in sat)
    # Throughput while requests wait: the regime where KV memory (or max_num_seqs) limits the
    # batch, without the drain at the end, whose length the single longest request sets.
    result["saturated_time_s"] = sat_time
    result["saturated_output_tok_s"] = sum(s["tokens"] for s in sat) / sat_time if sat_time else None
    if sample_kv:
        result["memory"] = memory_breakdown(samples)
        result["memory_saturated"] = memory_breakdown([s for s in samples if s["waiting"] > 0])
    return result


def memory_breakdown(samples: list[dict]) -> dict | None:
    """Time-averaged (weights: step durations) split of KV memory, as fractions of the total.

    token_states + future + internal = reserved; reserved + external + free = total.
    waste = 1 - used / reserved (ratio of time averages).
    """
    w = sum(s["dt"] for s in samples)
    if not samples or w <= 0:
        return None
    total = samples[0]["total"]

    def avg(key: str) -> float:
        return sum(s[key] * s["dt"] for s in samples) / w

    used, reserved, unusable, future, internal = (
        avg(k) for k in ("used", "reserved", "unusable_free", "future", "internal")
    )
    return {
        "time_s": w,
        "token_states": used / total,
        "future": future / total,
        "internal_frag": internal / total,
        "external_frag": unusable / total,
        "free": (total - reserved - unusable) / total,
        "reserved": reserved / total,
        "used_over_reserved": used / reserved if reserved else 0.0,
        "waste": 1 - used / reserved if reserved else 0.0,
    }


def make_engine(args: argparse.Namespace, layout: str, block_size: int, max_num_seqs: int | None = None):
    from pagedllm.config import EngineConfig
    from pagedllm.engine.llm_engine import LLMEngine

    kv_layout, reserve = LAYOUTS[layout]
    cfg = EngineConfig(
        model=args.model,
        dtype=args.dtype,
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
    # Warm-up outside the measurement: first calls allocate and pick kernels.
    run_workload(engine, [{"prompt_token_ids": list(range(3, 35)), "max_tokens": 4}], sample_kv=False)
    return engine


def _config_record(args: argparse.Namespace, engine) -> dict:
    return {
        "model": args.model,
        "model_path": engine.model_path,
        "dtype": str(engine.dtype).removeprefix("torch."),
        "num_kv_tokens": engine.num_kv_blocks * engine.config.block_size,
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

    vocab = load_hf_config(resolve_model_path(args.model)).vocab_size
    return load_workload(
        args.workload,
        args.num_prompts,
        args.seed,
        vocab,
        input_len=args.input_len,
        output_len=args.output_len,
    )


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
        res = run_workload(engine, requests, time_attention=True)
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
        for key in ("layouts", "block_sizes"):
            for name, res in result.get(key, {}).items():
                result[key][name] = _strip(res, args.timeline_points)
        path = os.path.join(args.out_dir, f"{mode}.json")
        with open(path, "w") as fh:
            fh.write(report.dumps_json(result))
        files.append(path)
        _log("wrote " + ", ".join(files))
    return 0
