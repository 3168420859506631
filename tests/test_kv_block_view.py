"""The KV cache snapshot behind the live view (/kv/blocks): its JSON form, and the engine's.

The managers' states are checked block by block against models of the cache in
tests/test_sharing_state_machine.py (paged) and tests/test_contiguous.py (contiguous).
"""

from __future__ import annotations

from pagedllm.config import EngineConfig
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.kv import block_view
from pagedllm.kv.paged import PagedKVCacheManager
from pagedllm.sampling_params import SamplingParams
from pagedllm.sequence import Sequence


def test_json_form_round_trips_states_and_counts_them():
    kv = PagedKVCacheManager(num_blocks=12, block_size=4)
    parent = Sequence("p", list(range(10)), SamplingParams(max_tokens=4))
    assert kv.allocate_slots(parent, 10)
    parent.num_computed_tokens = 10
    kv.cache_computed_blocks(parent)
    parent.append_output_token(1)
    child = parent.fork("p#1")
    assert kv.fork(parent, child)
    d = kv.block_snapshot().to_dict()
    states = block_view.decode_states(d["states"])
    assert states.size == d["num_blocks"] == 12
    table = kv.block_table("p")
    assert states[table].tolist() == [block_view.SHARED] * 3
    assert d["shared"] == {"blocks": sorted(table), "refs": [2, 2, 2]}
    assert d["state_counts"]["shared"] == 3 and d["state_counts"]["free"] == 9
    assert sum(d["state_counts"].values()) == 12
    assert d["state_names"][block_view.SHARED] == "shared"
    assert {s["seq_id"]: s["blocks"] for s in d["seqs"]} == {"p": table, "p#1": table}
    assert all(s["num_tokens"] == 10 and s["reserved_tokens"] == 12 for s in d["seqs"])
    # after both finish, the two full blocks stay as prefix-cache entries; the partly filled one is free
    kv.free(child)
    kv.free(parent)
    counts = kv.block_snapshot().state_counts()
    assert counts["cached"] == 2 and counts["free"] == 10 and counts["used"] == counts["shared"] == 0


def test_the_snapshot_is_a_copy():
    kv = PagedKVCacheManager(num_blocks=8, block_size=2)
    seq = Sequence("a", [1, 2, 3], SamplingParams(max_tokens=4))
    assert kv.allocate_slots(seq, 3)
    snap = kv.block_snapshot()
    before = (snap.states.copy(), list(snap.seqs[0].blocks))
    seq.num_computed_tokens = 3
    assert kv.allocate_slots(seq, 2)
    kv.free(seq)
    assert (snap.states == before[0]).all() and snap.seqs[0].blocks == before[1]


def test_engine_snapshot_names_requests_and_carries_its_stats(tiny_llama):
    engine = LLMEngine(EngineConfig(model=tiny_llama, dtype="float32", num_kv_blocks=64, block_size=4))
    engine.add_request("r", list(range(3, 20)), SamplingParams(max_tokens=6, n=3, ignore_eos=True, seed=0))
    seen_shared = False
    while engine.has_unfinished_requests():
        engine.step()
        snap = engine.get_kv_blocks()
        assert {s["request_id"] for s in snap["seqs"]} <= {"r"}
        st = snap["stats"]
        counts = snap["state_counts"]
        assert counts["used"] + counts["shared"] == st["num_kv_blocks"] - st["num_free_kv_blocks"]
        assert counts["shared"] == st["kv_shared_blocks"]
        seen_shared |= counts["shared"] > 0
    assert seen_shared
    counts = engine.get_kv_blocks()["state_counts"]
    assert counts["free"] + counts["cached"] == 64


def test_bench_records_block_frames_and_animates_them(tiny_llama, tmp_path):
    from argparse import Namespace

    from PIL import Image

    from pagedllm.bench.compare import make_engine
    from pagedllm.bench.engine_driver import run_workload
    from pagedllm.bench.report.animation import STATE_COLORS, animate_kv

    args = Namespace(
        model=tiny_llama,
        dtype="float32",
        kv_cache_dtype="auto",
        num_kv_tokens=256,
        max_model_len=128,
        max_num_seqs=256,
        max_num_batched_tokens=2048,
        num_threads=1,
    )
    requests = [{"prompt_token_ids": list(range(3 + i, 23 + i)), "max_tokens": 8} for i in range(6)]
    layouts = {}
    for name, bs in (("paged", 4), ("oracle", 1)):
        res = run_workload(make_engine(args, name, bs), requests, record_blocks=True)
        frames = res["block_frames"]
        assert len(frames) == res["num_steps"] and [t for t, _ in frames] == [s["t"] for s in res["samples"]]
        held = [int(((st == block_view.USED) | (st == block_view.SHARED)).sum()) for _, st in frames]
        assert max(held) > 0 and frames[0][1].size == 256 // bs
        res["block_size"] = bs
        layouts[name] = res
    assert (layouts["oracle"]["block_frames"][0][1] == block_view.RESERVED).any()  # reservations' tails
    path = animate_kv({"layouts": layouts}, str(tmp_path / "kv.gif"), num_frames=6, fps=5)
    gif = Image.open(path)
    assert 2 <= gif.n_frames <= 6  # Pillow merges a frame identical to the one before (the finished end)
    colors = set()
    for i in range(gif.n_frames):
        gif.seek(i)
        colors |= {c for _, c in gif.convert("RGB").getcolors(1 << 20)}
    want = {
        tuple(int(STATE_COLORS[s][i : i + 2], 16) for i in (1, 3, 5)) for s in (block_view.USED, block_view.RESERVED)
    }
    assert want <= colors, "no frame shows a block in use or a reserved tail"


def test_swapped_blocks_show_until_the_cache_is_idle():
    kv = PagedKVCacheManager(num_blocks=8, block_size=2)
    kv.enable_swap(8)
    a = Sequence("a", [1, 2, 3], SamplingParams(max_tokens=4))
    assert kv.allocate_slots(a, 3)
    table = list(kv.block_table("a"))
    b = Sequence("b", [4, 5], SamplingParams(max_tokens=4))
    assert kv.allocate_slots(b, 2)
    assert kv.swap_out([a])
    kv.take_block_ops()  # what the scheduler does each step
    snap = kv.block_snapshot()
    assert snap.states[table].tolist() == [block_view.SWAPPING] * 2
    assert (snap.num_host_blocks, snap.num_host_blocks_used) == (8, 2)
    assert [s.seq_id for s in snap.seqs] == ["b"]  # a swapped sequence has no device table
    kv.free(a)
    kv.free(b)
    assert kv.block_snapshot().state_counts()["swapping"] == 0  # nothing moves in an idle cache
