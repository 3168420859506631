"""What the live KV view (/kv, /kv/blocks) costs: writes results.json and results.md here.

1. Per /kv/blocks call at 100k blocks: the snapshot (PagedKVCacheManager.block_snapshot, stats)
   and its JSON, on a paged cache filled to ~90% by forked sequences with a shared prompt (plus
   prefix-cache entries), and on a contiguous one; beside it the per-block Python loop that
   PagedKVCacheManager.stats() used to run, for scale.
2. Step time under load with the page polling vs not: an AsyncLLMEngine (tiny random-weight
   Llama, 100k KV blocks) runs a fixed workload of n = 4 requests with a shared prefix while a
   coroutine does what the endpoint does (snapshot on the engine thread, JSON on the event loop)
   at 0 (closed), 1 Hz (the page's slowest) and 10 Hz (beyond its fastest, 150 ms); step time =
   the interval between consecutive steps' schedules (EngineCore.on_schedule), so a snapshot
   taken between steps lands in it.
3. ``--screenshot``: the page under load in headless chromium (Playwright), as kv_view.png.

Run from the repository root, alone on the machine (timed runs take the shared lock):
    flock /tmp/pagedllm-bench.lock python3 benchmarks/results/kv_view/measure.py [--screenshot]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
sys.path.insert(0, ROOT)

from pagedllm.kv.contiguous import ContiguousKVCacheManager  # noqa: E402
from pagedllm.kv.paged import PagedKVCacheManager  # noqa: E402
from pagedllm.sampling_params import SamplingParams  # noqa: E402
from pagedllm.sequence import Sequence  # noqa: E402

NUM_BLOCKS = 100_000
BLOCK_SIZE = 16


def timed(fn, repeats: int) -> dict:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return {"median_ms": 1e3 * statistics.median(times), "max_ms": 1e3 * max(times), "repeats": repeats}


def filled_paged_cache() -> tuple[PagedKVCacheManager, int]:
    """Groups of one 1000-token prompt + 3 forks that each wrote 200 more, until ~90% is held."""
    kv = PagedKVCacheManager(NUM_BLOCKS, BLOCK_SIZE)
    g = 0
    while kv.num_free_blocks() > 0.12 * NUM_BLOCKS:
        prompt = [1 + (g % 7)] * 64 + list(range(g * 1000, g * 1000 + 936))  # 64 tokens shared by all
        parent = Sequence(f"r{g}", prompt, SamplingParams(max_tokens=200))
        assert kv.allocate_slots(parent, len(prompt), kv.find_cached_prefix(parent))
        parent.num_computed_tokens = len(prompt)
        kv.cache_computed_blocks(parent)
        parent.append_output_token(3)
        for i in range(1, 4):
            child = parent.fork(f"r{g}#{i}")
            assert kv.fork(parent, child)
            child.append_output_token(4)
            assert kv.allocate_slots(child, 200)
        g += 1
    # some finished requests: their blocks stay as prefix-cache entries
    for k in range(0, g, 10):
        kv.free(Sequence(f"r{k}", [], SamplingParams()))
        for i in range(1, 4):
            kv.free(Sequence(f"r{k}#{i}", [], SamplingParams()))
    kv.take_block_ops()
    return kv, g


def old_stats_loop(kv: PagedKVCacheManager) -> int:
    """The per-block loop PagedKVCacheManager.stats() ran before (for scale only)."""
    bs = kv.block_size
    fill: dict[int, int] = {}
    for rid, table in kv._tables.items():
        n = kv._num_tokens[rid]
        for i, b in enumerate(table):
            f = min(bs, n - i * bs)
            if f > fill.get(b, 0):
                fill[b] = f
    return sum(fill.values())


def snapshot_costs(repeats: int = 30) -> dict:
    kv, groups = filled_paged_cache()
    snap = kv.block_snapshot()
    payload = json.dumps(snap.to_dict())
    paged = {
        "num_blocks": NUM_BLOCKS,
        "block_size": BLOCK_SIZE,
        "num_sequences": len(snap.seqs),
        "blocks_held": kv.pool.num_used_blocks,
        "logical_blocks": kv.stats().logical_blocks,
        "state_counts": snap.state_counts(),
        "json_bytes": len(payload),
        "block_snapshot": timed(kv.block_snapshot, repeats),
        "stats": timed(kv.stats, repeats),
        "snapshot_to_json": timed(lambda: json.dumps(kv.block_snapshot().to_dict()), repeats),
        "old_stats_per_block_loop": timed(lambda: old_stats_loop(kv), repeats),
    }
    assert old_stats_loop(kv) == kv.stats().used
    ckv = ContiguousKVCacheManager(NUM_BLOCKS, BLOCK_SIZE, "max", max_model_len=2048)
    i = 0
    while True:
        seq = Sequence(f"c{i}", list(range(300)), SamplingParams(max_tokens=500))
        if not ckv.allocate_slots(seq, 300):
            break
        i += 1
    contiguous = {
        "num_blocks": NUM_BLOCKS,
        "block_size": BLOCK_SIZE,
        "reserve": "max",
        "num_sequences": i,
        "snapshot_to_json": timed(lambda: json.dumps(ckv.block_snapshot().to_dict()), repeats),
    }
    return {"paged": paged, "contiguous": contiguous}


async def _workload(engine, poll_hz: float) -> dict:
    step_starts: list[float] = []
    engine.engine.core.on_schedule = lambda sched: step_starts.append(time.perf_counter())
    polls: list[float] = []
    done = asyncio.Event()

    async def poller() -> None:
        while not done.is_set():
            t0 = time.perf_counter()
            json.dumps(await engine.get_kv_blocks())  # what /kv/blocks does per call
            polls.append(time.perf_counter() - t0)
            try:
                await asyncio.wait_for(done.wait(), 1 / poll_hz)
            except TimeoutError:
                pass

    async def one(i: int) -> None:
        prompt = list(range(3, 67)) + [100 + i] * 16  # 64 shared tokens + 16 of its own
        params = SamplingParams(n=4, max_tokens=400, temperature=1.0, seed=i, ignore_eos=True)
        stream = await engine.add_request(f"q{poll_hz}-{i}", {"prompt_token_ids": prompt}, params)
        async for _ in stream:
            pass

    task = asyncio.create_task(poller()) if poll_hz > 0 else None
    t0 = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(96)))
    wall = time.perf_counter() - t0
    done.set()
    if task is not None:
        await task
    engine.engine.core.on_schedule = None
    gaps = [b - a for a, b in zip(step_starts, step_starts[1:], strict=False)]
    gaps.sort()
    return {
        "poll_hz": poll_hz,
        "steps": len(step_starts),
        "step_ms_mean": 1e3 * statistics.fmean(gaps),
        "step_ms_median": 1e3 * statistics.median(gaps),
        "step_ms_p99": 1e3 * gaps[int(0.99 * (len(gaps) - 1))],
        "workload_s": wall,
        "polls": len(polls),
        "poll_ms_median": 1e3 * statistics.median(polls) if polls else None,
    }


def step_times(rounds: int = 2) -> dict:
    from pagedllm.config import EngineConfig
    from pagedllm.engine.async_engine import AsyncLLMEngine
    from tests.tiny_models import build_model

    with tempfile.TemporaryDirectory() as tmp:
        model = build_model("llama", os.path.join(tmp, "llama"))
        config = EngineConfig(model=model, dtype="float32", num_kv_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE)
        engine = AsyncLLMEngine.from_config(config)
        engine.start()
        try:
            runs = []
            asyncio.run(_workload(engine, 0))  # warm-up
            for _ in range(rounds):  # interleaved, so drift hits every setting alike
                for hz in (0, 1, 10):
                    runs.append(asyncio.run(_workload(engine, hz)))
        finally:
            engine.shutdown()
    by_hz = {}
    for hz in (0, 1, 10):
        rs = [r for r in runs if r["poll_hz"] == hz]
        by_hz[str(hz)] = {
            "step_ms_mean": statistics.fmean(r["step_ms_mean"] for r in rs),
            "step_ms_median": statistics.fmean(r["step_ms_median"] for r in rs),
            "step_ms_p99": statistics.fmean(r["step_ms_p99"] for r in rs),
            "workload_s": statistics.fmean(r["workload_s"] for r in rs),
            "poll_ms_median": rs[0]["poll_ms_median"],
            "runs": rs,
        }
    return {
        "model": "tiny random-weight Llama (2 layers, hidden 64), float32",
        "num_kv_blocks": NUM_BLOCKS,
        "block_size": BLOCK_SIZE,
        "workload": "96 requests, n=4, 64 shared prompt tokens + 16 own, 400 output tokens each, all at once",
        "by_poll_hz": by_hz,
    }


def screenshot(path: str) -> None:
    """The page under load: a tiny model's server, requests with a shared prefix, n > 1."""
    import httpx
    from playwright.sync_api import sync_playwright

    from tests.test_server import free_port
    from tests.tiny_models import build_model

    with tempfile.TemporaryDirectory() as tmp:
        model = build_model("llama", os.path.join(tmp, "llama"))
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", model, "--port", str(port)]
        cmd += ["--dtype", "float32", "--num-kv-blocks", "1536", "--block-size", "4", "--served-model-name", "tiny"]
        cmd += ["--uvicorn-log-level", "warning", "--disable-uvicorn-access-log"]
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            for _ in range(300):
                try:
                    if httpx.get(base + "/health", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    time.sleep(0.2)

            def one(i: int, max_tokens: int) -> None:
                prompt = list(range(3, 3 + 40 + 8 * (i % 3))) + [200 + i] * (5 + i % 4)
                body = {"model": "tiny", "prompt": prompt, "n": 1 + i % 4, "max_tokens": max_tokens}
                r = httpx.post(base + "/v1/completions", json={**body, "ignore_eos": True, "seed": i}, timeout=300)
                r.raise_for_status()

            for i in range(6):  # finished requests leave prefix-cache entries behind
                one(100 + i, 4)
            with sync_playwright() as p:
                browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=["--no-sandbox"])
                page = browser.new_page(viewport={"width": 1280, "height": 760})
                page.goto(base + "/kv?interval=200")
                workers = [threading.Thread(target=one, args=(i, 400)) for i in range(14)]
                for w in workers:
                    w.start()
                # once most requests hold blocks: hover one that shares some
                page.wait_for_function("() => window.kvView.last && window.kvView.last.seqs.length >= 20")
                time.sleep(1.0)
                page.hover("#seqs div.seq:has-text('shared') >> nth=1")
                time.sleep(0.3)
                page.screenshot(path=path)
                browser.close()
            for w in workers:
                w.join()
        finally:
            proc.terminate()
            proc.wait(20)


def write_markdown(res: dict, path: str) -> None:
    s = res["snapshot"]["paged"]
    c = res["snapshot"]["contiguous"]
    st = res["step_time"]["by_poll_hz"]
    lines = [
        "# Cost of the live KV view (`/kv`, `/kv/blocks`)",
        "",
        f"Machine: {res['machine']}. Made by `measure.py` (this folder).",
        "",
        f"## One /kv/blocks snapshot at {s['num_blocks']:,} blocks",
        "",
        f"Paged cache, block size {s['block_size']}: {s['num_sequences']} sequences (forks sharing their prompt), "
        f"{s['blocks_held']:,} blocks held, {s['logical_blocks']:,} logical blocks, "
        f"{s['state_counts']['cached']:,} cached free blocks; JSON {s['json_bytes'] / 1e3:.0f} kB.",
        "",
        "| what | median ms | max ms |",
        "|---|---:|---:|",
        f"| block_snapshot() (numpy over the refcounts + per-sequence tables) | {s['block_snapshot']['median_ms']:.2f}"
        f" | {s['block_snapshot']['max_ms']:.2f} |",
        f"| stats() (O(sequences)) | {s['stats']['median_ms']:.2f} | {s['stats']['max_ms']:.2f} |",
        f"| snapshot + JSON (paged) | {s['snapshot_to_json']['median_ms']:.2f} | "
        f"{s['snapshot_to_json']['max_ms']:.2f} |",
        f"| snapshot + JSON (contiguous, `max`, {c['num_sequences']} reservations) | "
        f"{c['snapshot_to_json']['median_ms']:.2f} | {c['snapshot_to_json']['max_ms']:.2f} |",
        f"| for scale: the per-block loop stats() ran before | {s['old_stats_per_block_loop']['median_ms']:.2f} | "
        f"{s['old_stats_per_block_loop']['max_ms']:.2f} |",
        "",
        "Only the snapshot itself (block_snapshot + get_stats) runs on the engine thread between steps;",
        "the JSON is encoded on the event loop.",
        "",
        "## Step time under load, page polling vs closed",
        "",
        f"{res['step_time']['workload']}; {res['step_time']['model']}, {res['step_time']['num_kv_blocks']:,} KV "
        f"blocks of {res['step_time']['block_size']}. Mean of {len(st['0']['runs'])} interleaved runs per setting.",
        "",
        "| polling | step ms mean | median | p99 | workload s | one poll ms (median) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for hz, label in (("0", "closed"), ("1", "1 Hz"), ("10", "10 Hz")):
        r = st[hz]
        poll = "" if r["poll_ms_median"] is None else f"{r['poll_ms_median']:.1f}"
        lines.append(
            f"| {label} | {r['step_ms_mean']:.2f} | {r['step_ms_median']:.2f} | {r['step_ms_p99']:.2f} | "
            f"{r['workload_s']:.2f} | {poll} |"
        )
    lines.append("")
    with open(path, "w") as f:
        f.write("\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--screenshot", action="store_true", help="also write kv_view.png")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    res = {
        "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores, Python {platform.python_version()}",
        "snapshot": snapshot_costs(),
        "step_time": step_times(args.rounds),
    }
    with open(os.path.join(HERE, "results.json"), "w") as f:
        json.dump(res, f, indent=2)
    write_markdown(res, os.path.join(HERE, "results.md"))
    if args.screenshot:
        screenshot(os.path.join(HERE, "kv_view.png"))
    print(open(os.path.join(HERE, "results.md")).read())


if __name__ == "__main__":
    main()
