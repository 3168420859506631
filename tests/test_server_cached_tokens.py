"""usage.prompt_tokens_details.cached_tokens (completions, chat), usage.input_tokens_details.
cached_tokens (responses) and cache_read_input_tokens (messages): the prompt tokens a request took
from the prefix cache, equal to the hits the engine counted for it (the /metrics counter's delta,
in blocks, times the block size).

Each case sends a long prompt, then one sharing all but its end: the first finds nothing cached,
the second the shared blocks.
"""

from __future__ import annotations

import random
import re
import time

import anthropic
import httpx
import openai
import pytest
from test_server import ServerProcess, served

MODEL = "tiny"
BLOCK_SIZE = 16  # the engine's default
WORDS = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa".split()
HITS = re.compile(rf'^pagedllm:prefix_cache_hits_total\{{model_name="{MODEL}"\}} (\S+)$', re.M)


@pytest.fixture(scope="module")
def server(tiny_llama, tmp_path_factory):
    with served(tiny_llama, tmp_path_factory, "--served-model-name", MODEL) as srv:
        yield srv


def prefix_cache_hits(server) -> int:
    """The /metrics counter once the engine is idle (its snapshot is published as it goes idle:
    waits until it agrees with the live /stats)."""
    live = server.wait_idle()["prefix_cache_hits"]
    deadline = time.monotonic() + 5
    while True:
        scraped = int(float(HITS.search(httpx.get(server.url("/metrics"), timeout=10).text).group(1)))
        if scraped == live or time.monotonic() > deadline:
            return scraped
        time.sleep(0.05)


def long_prefix(seed: int) -> str:
    """About 250 tokens (of the tiny model's 512) no other test sends (so nothing of it is cached yet)."""
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) + str(rng.randrange(1000)) for _ in range(30))


def completions(server, prompt: str, stream: bool) -> int:
    client = openai.OpenAI(base_url=server.url("/v1"), api_key="none", max_retries=0, timeout=120)
    if not stream:
        return client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=2
        ).usage.prompt_tokens_details.cached_tokens
    chunks = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=2, stream=True, stream_options={"include_usage": True}
    )
    return [c.usage for c in chunks if c.usage][0].prompt_tokens_details.cached_tokens


def chat(server, prompt: str, stream: bool) -> int:
    client = openai.OpenAI(base_url=server.url("/v1"), api_key="none", max_retries=0, timeout=120)
    messages = [{"role": "user", "content": prompt}]
    if not stream:
        return client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=2
        ).usage.prompt_tokens_details.cached_tokens
    chunks = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=2, stream=True, stream_options={"include_usage": True}
    )
    return [c.usage for c in chunks if c.usage][0].prompt_tokens_details.cached_tokens


def responses(server, prompt: str, stream: bool) -> int:
    client = openai.OpenAI(base_url=server.url("/v1"), api_key="none", max_retries=0, timeout=120)
    kw = {"model": MODEL, "input": prompt, "max_output_tokens": 2}
    if not stream:
        usage = client.responses.create(**kw).usage
    else:
        events = list(client.responses.create(stream=True, **kw))
        assert events[-1].type in ("response.completed", "response.incomplete")
        usage = events[-1].response.usage
    assert usage.input_tokens_details.cached_tokens <= usage.input_tokens  # cached ones are counted in
    return usage.input_tokens_details.cached_tokens


def messages(server, prompt: str, stream: bool) -> int:
    client = anthropic.Anthropic(base_url=server.base_url, api_key="none", max_retries=0, timeout=120)
    kw = {"model": MODEL, "messages": [{"role": "user", "content": prompt}]}
    if not stream:
        usage = client.messages.create(max_tokens=2, **kw).usage
    else:
        with client.messages.stream(max_tokens=2, **kw) as s:
            usage = s.get_final_message().usage
    # Anthropic's input_tokens leave the cached ones out: together they are the whole prompt.
    assert usage.input_tokens + usage.cache_read_input_tokens == client.messages.count_tokens(**kw).input_tokens
    return usage.cache_read_input_tokens


ENDPOINTS = [completions, chat, responses, messages]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_cached_tokens_are_the_prefix_cache_hits(server, endpoint, stream):
    seed = ENDPOINTS.index(endpoint) * 2 + stream
    prefix = long_prefix(seed)
    before = prefix_cache_hits(server)
    first = endpoint(server, prefix + " first", stream)
    middle = prefix_cache_hits(server)
    second = endpoint(server, prefix + " second", stream)
    after = prefix_cache_hits(server)
    assert first == (middle - before) * BLOCK_SIZE == 0
    assert second == (after - middle) * BLOCK_SIZE
    assert second >= 8 * BLOCK_SIZE  # several blocks of the shared prefix


def test_without_prefix_caching_nothing_is_cached(tiny_llama, tmp_path):
    srv = ServerProcess(
        tiny_llama, str(tmp_path / "server.log"), "--served-model-name", MODEL, "--no-enable-prefix-caching"
    )
    try:
        prefix = long_prefix(99)
        assert [completions(srv, prefix + end, False) for end in (" a", " b")] == [0, 0]
        assert messages(srv, prefix + " c", True) == 0
    finally:
        srv.stop()
