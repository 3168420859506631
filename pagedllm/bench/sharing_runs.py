"""The measurements of ``pagedllm bench sharing`` (see pagedllm.bench.sharing): KV blocks
physical vs logical under parallel sampling and beam search, and timed runs of a shared-prefix
workload with prefix caching off and on."""

from __future__ import annotations

import random
import statistics
import sys
import time


# ---- memory ----------------------------------------------------------------------------------
def _drive(engine, add) -> dict:
    """Adds the requests (``add(engine)``), steps to the end, sampling KV block counts per step."""
    kv = engine.kv_manager
    add(engine)
    phys = logi = peak_logical = peak_phys_at = steps = 0
    t = time.perf_counter()
    preempt0 = engine.scheduler.num_preemptions
    while engine.has_unfinished_requests():
        engine.step()
        st = kv.stats()
        p, lg = st.reserved // kv.block_size, st.logical_blocks
        phys += p
        logi += lg
        steps += 1
        if lg > peak_logical:
            peak_logical, peak_phys_at = lg, p
    return {
        "steps": steps,
        "wall_s": round(time.perf_counter() - t, 2),
        "sum_physical_blocks": phys,
        "sum_logical_blocks": logi,
        "saving": round(1 - phys / logi, 4) if logi else 0.0,
        "peak_logical_blocks": peak_logical,
        "physical_blocks_at_peak": peak_phys_at,
        "saving_at_peak": round(1 - peak_phys_at / peak_logical, 4) if peak_logical else 0.0,
        "num_preemptions": engine.scheduler.num_preemptions - preempt0,
    }


def run_memory(llm, requests: list[dict], n_values: list[int], widths: list[int], max_output: int) -> list[dict]:
    from pagedllm import BeamSearchParams, SamplingParams

    rows = []
    for n in n_values:

        def add(engine, n=n):
            for i, r in enumerate(requests):
                engine.add_request(
                    None,
                    {"prompt_token_ids": r["prompt_token_ids"]},
                    SamplingParams(
                        n=n,
                        temperature=1.0,
                        seed=i,
                        max_tokens=min(r["max_tokens"], max_output),
                        ignore_eos=True,
                        detokenize=False,
                    ),
                )

        res = _drive(llm.llm_engine, add)
        rows.append({"kind": "parallel sampling", "param": n, **res})
        print(f"parallel sampling n={n}: saving {res['saving']:.1%} ({res['wall_s']} s)", file=sys.stderr)
    for w in widths:

        def add(engine, w=w):
            for r in requests:
                engine.add_beam_search_request(
                    None,
                    {"prompt_token_ids": r["prompt_token_ids"]},
                    BeamSearchParams(beam_width=w, max_tokens=min(r["max_tokens"], max_output), ignore_eos=True),
                )

        res = _drive(llm.llm_engine, add)
        rows.append({"kind": "beam search", "param": w, **res})
        print(f"beam search width={w}: saving {res['saving']:.1%} ({res['wall_s']} s)", file=sys.stderr)
    return rows


# ---- prefix caching --------------------------------------------------------------------------
def prefix_workload(prefix_len: int, num: int, output: int, vocab_size: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    prefix = [rng.randrange(3, vocab_size) for _ in range(prefix_len)]
    return [
        {
            "prompt_token_ids": prefix + [rng.randrange(3, vocab_size) for _ in range(rng.randint(16, 48))],
            "max_tokens": output,
        }
        for _ in range(num)
    ]


def _timed_run(llm, requests: list[dict]) -> dict:
    from pagedllm import SamplingParams

    kv = llm.llm_engine.kv_manager
    q0, h0 = kv.prefix_cache_stats()
    params = [
        SamplingParams(temperature=0.0, max_tokens=r["max_tokens"], ignore_eos=True, detokenize=False) for r in requests
    ]
    t = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": r["prompt_token_ids"]} for r in requests], params, use_tqdm=False)
    wall = time.perf_counter() - t
    q, h = kv.prefix_cache_stats()
    return {
        "wall_s": wall,
        "queries": q - q0,
        "hits": h - h0,
        "cached_tokens": sum(o.num_cached_tokens for o in outs),
    }


def run_prefix(model: str, kwargs: dict, prefix_lens: list[int], num: int, output: int, repeats: int) -> list[dict]:
    from pagedllm import LLM

    rows = []
    for caching in (False, True):
        llm = LLM(model=model, **{**kwargs, "enable_prefix_caching": caching})
        vocab = llm.llm_engine.vocab_size
        _timed_run(llm, prefix_workload(16, 4, 4, vocab, seed=99))  # warm-up: kernels, allocator
        for plen in prefix_lens:
            reqs = prefix_workload(plen, num, output, vocab)
            runs = []
            for _ in range(repeats):
                # Each timed run starts from a cold prefix cache: the first request computes the prefix.
                if caching:
                    llm.llm_engine.kv_manager.pool.reset_prefix_cache()
                runs.append(_timed_run(llm, reqs))
            wall = statistics.median(r["wall_s"] for r in runs)
            last = runs[-1]
            prompt_tokens = sum(len(r["prompt_token_ids"]) for r in reqs)
            out_tokens = num * output
            rows.append(
                {
                    "prefix_len": plen,
                    "prefix_caching": caching,
                    "num_requests": num,
                    "walls_s": [round(r["wall_s"], 3) for r in runs],
                    "wall_s": round(wall, 3),
                    "req_s": round(num / wall, 3),
                    "output_tok_s": round(out_tokens / wall, 1),
                    "total_tok_s": round((prompt_tokens + out_tokens) / wall, 1),
                    "prompt_tokens": prompt_tokens,
                    "hit_rate": round(last["hits"] / last["queries"], 4) if last["queries"] else 0.0,
                    "cached_prompt_fraction": round(last["cached_tokens"] / prompt_tokens, 4),
                }
            )
            print(f"prefix {plen} caching={caching}: {num / wall:.2f} req/s", file=sys.stderr)
        del llm
    return rows
