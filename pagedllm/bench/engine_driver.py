"""Drives an LLMEngine through a workload step by step, sampling its KV memory as it goes.

Used by `pagedllm bench compare` (and its tests): requests are all added at t=0, every
``step()`` is timed, and right after the scheduler decides, the KV manager is sampled (the memory
that step runs with). Time is engine time: the sum of ``step()`` durations less that sampling.
"""

from __future__ import annotations

import time
from contextlib import contextmanager, nullcontext

from pagedllm.attention.paged_attention import attention_timer


@contextmanager
def kv_sampler(engine, enabled: bool = True, record_blocks: bool = False):
    """Snapshots KV memory right after each ``schedule()``, i.e. the memory the step runs with.

    Sampling after ``step()`` instead would miss what the step used (finished requests are already
    freed, the next admissions not yet made). Uses the engine core's ``on_schedule`` observer.
    Yields [last snapshot or None, seconds spent sampling]; with ``record_blocks`` the snapshot
    also has "blocks", every block's state (KVCacheManager.block_snapshot, for the animation).
    """
    state: list = [None, 0.0]
    if not enabled:
        yield state
        return
    core = engine.core

    def observe(sched) -> None:
        t = time.monotonic()
        state[0] = _kv_sample(engine, sched)
        if record_blocks:
            state[0]["blocks"] = engine.kv_manager.block_snapshot().states
        state[1] += time.monotonic() - t

    core.on_schedule = observe
    try:
        yield state
    finally:
        core.on_schedule = None


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
    new = sched.num_scheduled_tokens
    future = internal = 0
    for r in engine.scheduler.running:
        rid = r.seq_id
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


def run_workload(
    engine, requests: list[dict], sample_kv: bool = True, time_attention: bool = False, record_blocks: bool = False
) -> dict:
    """Runs every request to exactly max_tokens (greedy, ignore_eos) and returns the measurements.

    Returns {"outputs": {request index: token ids}, "samples": [per step], "requests": [per request],
    plus totals}. Latencies are in engine time, from t=0 when every request arrived. With
    ``record_blocks`` (and ``sample_kv``) also "block_frames": [(engine time, block states)] per step.
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
    timer = attention_timer() if time_attention else nullcontext([0.0])
    frames: list = []
    with timer as attn, kv_sampler(engine, sample_kv, record_blocks) as snap:
        attn_prev = attn[0]
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
            if time_attention:
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
                if record_blocks:
                    frames.append((engine_time, sample.pop("blocks")))
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
    if record_blocks and sample_kv:
        result["block_frames"] = frames
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
