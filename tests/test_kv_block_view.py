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
