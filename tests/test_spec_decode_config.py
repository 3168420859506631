"""speculative_config: what is accepted, what is refused (by name), the command line's JSON, the
n-gram proposer against a brute-force reference, and the counters on /metrics."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pagedllm.config import EngineConfig
from pagedllm.entrypoints.cli import build_parser
from pagedllm.entrypoints.engine_args import engine_kwargs
from pagedllm.spec_decode.config import SpeculativeConfig, parse_speculative_config
from pagedllm.spec_decode.ngram import propose_ngram


def test_ngram_config_and_defaults():
    cfg = EngineConfig(speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4})
    assert cfg.speculative == SpeculativeConfig(3, 4, 4)
    spec = parse_speculative_config({"num_speculative_tokens": 2, "disable_by_batch_size": 8})
    assert spec == SpeculativeConfig(2, 5, 5, 8)  # vLLM's window when neither bound is given
    assert EngineConfig().speculative is None
    draft = parse_speculative_config({"model": "some/draft", "num_speculative_tokens": 3, "quantization": "none"})
    assert draft == SpeculativeConfig(3, method="draft_model", model="some/draft", quantization=None)


@pytest.mark.parametrize(
    "value,needle",
    [
        ({"model": "some/draft", "num_speculative_tokens": 3, "method": "ngram"}, "model not supported"),
        ({"method": "eagle", "num_speculative_tokens": 3}, "method 'eagle'"),
        ({"method": "ngram", "num_speculative_tokens": 3, "draft_tensor_parallel_size": 1}, "draft_tensor_parallel"),
        ({"model": "some/draft", "num_speculative_tokens": 3, "prompt_lookup_min": 2}, "prompt_lookup_min"),
        ({"method": "ngram"}, "num_speculative_tokens is required"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be a positive"),
        ({"num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "prompt_lookup_min"),
        ({"num_speculative_tokens": 2, "disable_by_batch_size": True}, "disable_by_batch_size"),
        ("[1, 2]", "must be a dict"),
        ("{not json", "JSON object"),
    ],
)
def test_refused_with_its_name(value, needle):
    with pytest.raises(ValueError, match=needle):
        EngineConfig(speculative_config=value)


def test_refused_with_the_contiguous_layout():
    with pytest.raises(ValueError, match="kv_layout='paged'"):
        EngineConfig(kv_layout="contiguous", speculative_config={"num_speculative_tokens": 2})


def test_command_line_json():
    args = build_parser(["serve"]).parse_args(
        ["serve", "m", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 5}']
    )
    cfg = EngineConfig.from_kwargs(**engine_kwargs(args))
    assert cfg.speculative is not None and cfg.speculative.num_speculative_tokens == 5


@pytest.mark.parametrize("text", ["{oops", "[5]"])
def test_command_line_refuses_what_is_not_a_json_object(text, capsys):
    with pytest.raises(SystemExit):
        build_parser(["serve"]).parse_args(["serve", "m", "--speculative-config", text])
    assert "--speculative-config" in capsys.readouterr().err


def reference_proposal(tokens: list[int], k: int, lo: int, hi: int) -> list[int]:
    """Brute force: longest n first, latest earlier occurrence of the last n tokens."""
    for n in range(hi, lo - 1, -1):
        if n >= len(tokens):
            continue
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


@given(
    tokens=st.lists(st.integers(0, 3), max_size=40),
    k=st.integers(1, 6),
    lo=st.integers(1, 4),
    extra=st.integers(0, 3),
)
def test_ngram_matches_the_reference(tokens, k, lo, extra):
    assert propose_ngram(tokens, k, lo, lo + extra) == reference_proposal(tokens, k, lo, lo + extra)


def test_ngram_examples():
    assert propose_ngram([1, 2, 3, 9, 1, 2], 2, 1, 2) == [3, 9]
    assert propose_ngram([1, 2, 3, 4], 3, 1, 3) == []  # the suffix never occurred before
    assert propose_ngram([7, 7], 4, 1, 1) == [7]  # what followed, up to the end


def test_metrics_have_vllm_names():
    from pagedllm.metrics import ServerMetrics

    m = ServerMetrics("m", prefix="vllm")
    m.update_engine_stats(
        {
            "spec_decode_num_drafts": 3,
            "spec_decode_num_draft_tokens": 9,
            "spec_decode_num_accepted_tokens": 4,
            "spec_decode_num_accepted_tokens_per_pos": [3, 1, 0],
        }
    )
    text = m.render().decode()
    assert 'vllm:spec_decode_num_drafts_total{model_name="m"} 3.0' in text
    assert 'vllm:spec_decode_num_draft_tokens_total{model_name="m"} 9.0' in text
    assert 'vllm:spec_decode_num_accepted_tokens_total{model_name="m"} 4.0' in text
    assert 'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="1"} 1.0' in text
    m.update_engine_stats({})  # an engine that does not speculate has none
    assert "spec_decode" not in m.render().decode()
