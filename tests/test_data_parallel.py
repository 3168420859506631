"""Data parallelism: the router (pure Python) and `pagedllm serve --data-parallel-size 2`.

The router tests need no Ray. The server tests start one DP=2 server per module (a subprocess
that starts its own local Ray cluster and stops it on exit) and check it against offline greedy
``LLM(...).generate``: replicas are whole engines, so routing must not change a single token.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time

import httpx
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_server import ServerProcess

from pagedllm.data_parallel.router import NoReplicaError, Router, block_hashes
from pagedllm.kv.block_pool import hash_full_blocks

BS = 4  # router block size in the unit tests


def prompt(*blocks: int, tail: int = 0) -> list[int]:
    """A prompt of full blocks, block k made of the token blocks[k] repeated; ``tail`` extra tokens."""
    return [t for b in blocks for t in [b] * BS] + [999] * tail


# ---- router --------------------------------------------------------------------------------
def test_block_hashes_chain_and_skip_the_partial_block():
    a = block_hashes(prompt(1, 2, tail=3), BS)
    assert len(a) == 2  # the partial block is not cached by an engine either
    assert block_hashes(prompt(1, 2, 7), BS)[:2] == a
    # the same block after a different prefix is a different hash: the chain covers the prefix
    assert block_hashes(prompt(3, 2), BS)[1] != a[1]


def test_block_hashes_are_the_engines_unsalted_chain():
    ids = prompt(1, 2, 3, tail=1)
    assert block_hashes(ids, BS) == [h.digest() for h in hash_full_blocks(ids, BS)]


def test_a_prompt_the_replica_refuses_is_routed_by_load():
    r = Router(2, BS)
    for bad in ([2**70] * (2 * BS), [1.5] * (2 * BS)):  # not 64-bit integers: nothing to hash
        assert block_hashes(bad, BS) == []
        d = r.route(bad)
        assert (d.reason, d.matched_tokens) == ("least_loaded", 0)


def test_longest_prefix_wins():
    r = Router(3, BS, cache_threshold=0.3)
    first = r.route(prompt(1, 2, 3))
    r.release(first.replica)
    other = r.route(prompt(7, 8))
    r.release(other.replica)
    assert other.replica != first.replica  # idle tie: the replica with the emptiest record
    again = r.route(prompt(1, 2, 3, 4, tail=2))
    assert (again.replica, again.reason, again.matched_tokens) == (first.replica, "prefix", 3 * BS)
    near = r.route(prompt(7, 8, 9))
    assert (near.replica, near.matched_tokens) == (other.replica, 2 * BS)
    assert r.routed[first.replica] == 2 and r.matched_tokens[first.replica] == 3 * BS


def test_short_match_under_the_threshold_goes_to_the_least_loaded():
    r = Router(2, BS, cache_threshold=0.5)
    a = r.route(prompt(1))
    b = r.route(prompt(1, 5, 6, 7))  # 1 of 4 blocks matches replica a: under half
    assert b.reason == "least_loaded" and b.replica != a.replica


def test_imbalanced_load_overrides_affinity():
    r = Router(2, BS, balance_abs_threshold=2, balance_rel_threshold=1.5)
    picks = [r.route(prompt(1, 2)) for _ in range(4)]
    assert [p.replica for p in picks[:3]] == [0, 0, 0]
    assert [p.reason for p in picks[1:3]] == ["prefix", "prefix"]
    # 3 in flight against 0: more than 2 apart and more than 1.5x
    assert (picks[3].replica, picks[3].reason) == (1, "imbalanced")
    for p in picks:
        r.release(p.replica)
    assert r.in_flight == [0, 0]


def test_record_is_a_bounded_lru():
    r = Router(1, BS, max_blocks_per_replica=4)
    r.route(prompt(1, 2, 3))
    r.route(prompt(1, 9))  # touches block 1: now the most recent
    r.route(prompt(5, 6))  # 6 blocks recorded > 4: the two least recently used (2, 3) go
    record = r.records[0]
    assert len(record) == 4
    assert record.match(block_hashes(prompt(1, 9), BS)) == 2
    assert record.match(block_hashes(prompt(1, 2, 3), BS)) == 1


def test_round_robin_skips_dead_replicas():
    r = Router(3, BS, policy="round_robin")
    assert [r.route(prompt(1)).replica for _ in range(4)] == [0, 1, 2, 0]
    r.mark_dead(2)
    assert [r.route(prompt(1)).replica for _ in range(3)] == [1, 0, 1]
    r.mark_dead(0)
    r.mark_dead(1)
    with pytest.raises(NoReplicaError):
        r.route(prompt(1))


def test_bad_arguments_and_over_release():
    with pytest.raises(ValueError, match="routing policy"):
        Router(2, BS, policy="random")
    with pytest.raises(ValueError, match="num_replicas"):
        Router(0, BS)
    r = Router(2, BS)
    with pytest.raises(RuntimeError, match="released more"):
        r.release(0)


@settings(max_examples=200, deadline=None)
@given(
    policy=st.sampled_from(["prefix", "round_robin"]),
    ops=st.lists(
        st.one_of(
            st.tuples(st.just("route"), st.lists(st.integers(0, 3), min_size=0, max_size=5)),
            st.tuples(st.just("release"), st.integers(0, 1000)),
            st.tuples(st.just("kill"), st.integers(0, 3)),
        ),
        max_size=60,
    ),
)
def test_routing_never_picks_a_dead_replica_and_load_returns_to_zero(policy, ops):
    r = Router(4, BS, policy=policy, max_blocks_per_replica=8, balance_abs_threshold=3)
    outstanding: list[int] = []
    for op, arg in ops:
        if op == "route":
            if not r.live_replicas():
                with pytest.raises(NoReplicaError):
                    r.route(prompt(*arg))
                continue
            d = r.route(prompt(*arg))
            assert r.alive[d.replica]
            assert 0 <= d.matched_tokens <= len(arg) * BS
            outstanding.append(d.replica)
        elif op == "release" and outstanding:
            r.release(outstanding.pop(arg % len(outstanding)))
        elif op == "kill" and len(r.live_replicas()) > 1:
            r.mark_dead(arg)
        assert all(len(rec) <= 8 for rec in r.records)
        assert r.in_flight == [outstanding.count(i) for i in range(4)]
    for i in outstanding:
        r.release(i)
    assert r.in_flight == [0, 0, 0, 0]


# ---- the DP=2 server -----------------------------------------------------------------------
MODEL = "tiny-dp"
NUM_REQUESTS = 100
BLOCK = 16  # the engine's default block size
# Every replica gets one torch thread (2 replicas on a 2-core test machine); the offline reference
# runs in this process and is numerically the same engine (fp32; threads split rows, not sums).


@pytest.fixture(scope="module")
def dp_server(tiny_llama, tmp_path_factory):
    srv = ServerProcess(
        tiny_llama,
        str(tmp_path_factory.mktemp("dp") / "server.log"),
        "--served-model-name",
        MODEL,
        "--data-parallel-size",
        "2",
        "--num-threads",
        "1",
        wait=False,
    )
    srv.wait_healthy(timeout=600)  # two replica processes load torch and the model (stops it on failure)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def workload(tiny_llama):
    """100 prompts (token ids, mixed lengths), their max_tokens and offline greedy references."""
    from pagedllm import LLM, SamplingParams

    rng = random.Random(0)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randrange(4, 80))] for _ in range(NUM_REQUESTS)]
    max_tokens = [4 + (i % 5) * 4 for i in range(NUM_REQUESTS)]
    llm = LLM(model=tiny_llama, dtype="float32", num_kv_blocks=256)
    params = [SamplingParams(temperature=0, ignore_eos=True, max_tokens=m) for m in max_tokens]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    refs = [(o.outputs[0].text, len(o.outputs[0].token_ids)) for o in outs]
    del llm
    return prompts, max_tokens, refs


def stats(srv: ServerProcess) -> dict:
    return srv.stats()


def test_100_concurrent_requests_equal_offline_greedy(dp_server, workload):
    prompts, max_tokens, refs = workload

    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[str, int]:
        kw = dict(
            model=MODEL, prompt=prompts[i], max_tokens=max_tokens[i], temperature=0, extra_body={"ignore_eos": True}
        )
        if i % 3 == 0:  # a third streamed
            stream = await client.completions.create(**kw, stream=True, stream_options={"include_usage": True})
            text, usage = "", None
            async for c in stream:
                if c.choices:
                    text += c.choices[0].text
                usage = c.usage or usage
            return text, usage.completion_tokens
        out = await client.completions.create(**kw)
        return out.choices[0].text, out.usage.completion_tokens

    async def run() -> list[tuple[str, int]]:
        async with openai.AsyncOpenAI(
            base_url=dp_server.url("/v1"), api_key="none", max_retries=0, timeout=300
        ) as client:
            return await asyncio.gather(*(one(client, i) for i in range(NUM_REQUESTS)))

    got = asyncio.run(run())
    mismatches = [i for i in range(NUM_REQUESTS) if got[i] != refs[i]]
    assert not mismatches, [(i, got[i], refs[i]) for i in mismatches[:5]]
    s = dp_server.wait_idle()
    routed = [r["router_requests_routed"] for r in s["replicas"]]
    assert sum(routed) >= NUM_REQUESTS and min(routed) > 0, routed  # both replicas served
    assert [r["router_in_flight"] for r in s["replicas"]] == [0, 0]
    assert s["num_requests_running"] == 0 and s["num_free_kv_blocks"] == 2 * 256  # no leaked blocks


def test_shared_prefix_lands_on_one_replica_and_hits_its_cache(dp_server):
    rng = random.Random(5)
    system = [rng.randrange(3, 512) for _ in range(5 * BLOCK)]  # five full blocks
    requests = [system + [rng.randrange(3, 512) for _ in range(6)] for _ in range(9)]
    before = stats(dp_server)["replicas"]
    body = dict(model=MODEL, max_tokens=2, temperature=0)
    r = httpx.post(dp_server.url("/v1/completions"), json={**body, "prompt": requests[0]}, timeout=60)
    assert r.status_code == 200, r.text

    async def rest() -> list[int]:
        async with httpx.AsyncClient(timeout=60) as c:
            rs = await asyncio.gather(
                *(c.post(dp_server.url("/v1/completions"), json={**body, "prompt": p}) for p in requests[1:])
            )
            return [x.status_code for x in rs]

    assert asyncio.run(rest()) == [200] * 8
    after = dp_server.wait_idle()["replicas"]
    routed = [a["router_requests_routed"] - b["router_requests_routed"] for a, b in zip(after, before, strict=True)]
    assert sorted(routed) == [0, 9], routed
    home = routed.index(9)
    matched = after[home]["router_prefix_matched_tokens"] - before[home]["router_prefix_matched_tokens"]
    assert matched == 8 * 5 * BLOCK  # the router saw the 8 followers match the 5 blocks
    hits = after[home]["prefix_cache_hits"] - before[home]["prefix_cache_hits"]
    queries = after[home]["prefix_cache_queries"] - before[home]["prefix_cache_queries"]
    # and the replica's own prefix cache really held them (the primer finished before they came).
    # The pool counts lookups in blocks and stops at the first miss: the primer missed once, each
    # follower hit its 5 prefix blocks (its 6th block is partial, never looked up).
    assert (hits, queries) == (8 * 5, 8 * 5 + 1), (hits, queries)


def test_metrics_carry_a_replica_label(dp_server):
    text = httpx.get(dp_server.url("/metrics"), timeout=30).text
    for replica in ("0", "1"):
        assert f'pagedllm:num_requests_running{{model_name="{MODEL}",replica="{replica}"}}' in text
        assert f'pagedllm:prefix_cache_hits_total{{model_name="{MODEL}",replica="{replica}"}}' in text
        assert f'pagedllm:router_requests_routed_total{{model_name="{MODEL}",replica="{replica}"}}' in text
        assert f'pagedllm:replica_up{{model_name="{MODEL}",replica="{replica}"}} 1.0' in text
    # the per-request histograms are the front end's: one series, no replica label
    assert f'pagedllm:e2e_request_latency_seconds_count{{model_name="{MODEL}"}}' in text


def test_kv_blocks_per_replica(dp_server):
    for replica in (0, 1):
        r = httpx.get(dp_server.url(f"/kv/blocks?replica={replica}"), timeout=30)
        assert r.status_code == 200 and r.json()["num_blocks"] == 256
    assert httpx.get(dp_server.url("/kv/blocks"), timeout=30).status_code == 200  # the page's default
    bad = httpx.get(dp_server.url("/kv/blocks?replica=2"), timeout=30)
    assert bad.status_code == 400 and "replicas 0 to 1" in bad.json()["error"]["message"]


def test_the_server_and_its_ray_cluster_listen_on_loopback_only(dp_server):
    """The local Ray cluster a DP server starts (GCS, raylet, agents, replica workers) is bound to
    loopback, as is the server: nothing of it is reachable from another machine."""
    from listening_sockets import assert_loopback_only

    pids = {r["pid"] for r in stats(dp_server)["replicas"]}
    listening = assert_loopback_only(dp_server.proc.pid, expect_processes=3)
    assert dp_server.port in {x.port for x in listening}
    assert pids <= {x.pid for x in listening}, "the replicas' own sockets were not found"


def test_killed_replica_fails_its_requests_and_the_other_keeps_serving(dp_server):
    """Last in the module: it kills replica 1's process."""
    pids = [r["pid"] for r in stats(dp_server)["replicas"]]
    long = dict(model=MODEL, max_tokens=400, temperature=0, extra_body={"ignore_eos": True}, stream=True)
    client = openai.OpenAI(base_url=dp_server.url("/v1"), api_key="none", max_retries=0, timeout=120)
    # Two long streams at once: with nothing else in flight they go one to each replica.
    streams = [client.completions.create(prompt=[5 + i] * 8, **long) for i in range(2)]
    firsts = [next(iter(s)) for s in streams]  # both running
    assert all(f.choices for f in firsts)
    on = {r["replica"]: r["router_in_flight"] for r in stats(dp_server)["replicas"]}
    assert on == {0: 1, 1: 1}, on
    os.kill(pids[1], signal.SIGKILL)
    outcomes = []
    for s in streams:
        try:
            for _ in s:
                pass
            outcomes.append("finished")
        except openai.APIError as e:  # the server sends an error event: the stream is not cut silently
            outcomes.append("failed: " + str(e))
    assert sorted(o.split(":")[0] for o in outcomes) == ["failed", "finished"], outcomes
    # the survivor serves every new request; /health stays 200 while one replica is left
    for i in range(4):
        out = client.completions.create(model=MODEL, prompt=[9, 9, i], max_tokens=3, temperature=0, stream=False)
        assert out.usage.completion_tokens == 3
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and stats(dp_server)["replicas"][1]["alive"]:
        time.sleep(0.2)
    s = stats(dp_server)
    assert [r["alive"] for r in s["replicas"]] == [True, False]
    assert httpx.get(dp_server.url("/health"), timeout=30).status_code == 200
    assert 'pagedllm:replica_up{model_name="tiny-dp",replica="1"} 0.0' in httpx.get(dp_server.url("/metrics")).text
