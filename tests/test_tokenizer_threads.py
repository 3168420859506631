"""Which tokenizers the server's threads may share (pagedllm.tokenizer.shareable_across_threads)."""

from __future__ import annotations

import pytest

from pagedllm.tokenizer import shareable_across_threads

transformers = pytest.importorskip("transformers")


def test_shareable_across_threads(tiny_llama) -> None:
    tok = transformers.AutoTokenizer.from_pretrained(tiny_llama)
    assert shareable_across_threads(tok)
    tok._tokenizer.enable_truncation(16)  # encode would now reset it: a write to the backend
    assert not shareable_across_threads(tok)
    assert not shareable_across_threads(object())
