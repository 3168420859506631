"""Each layer's attention window as transformers reads it from Mistral, Qwen2 and layer_types configs."""

from __future__ import annotations

import pytest

from pagedllm.models.attention_windows import layer_windows, sliding_window

transformers = pytest.importorskip("transformers")


def test_mistral_windows_every_layer():
    cfg = transformers.MistralConfig(num_hidden_layers=3, sliding_window=16)
    assert layer_windows(cfg) == [16, 16, 16]
    assert sliding_window(cfg) == 16
    assert layer_windows(transformers.MistralConfig(num_hidden_layers=2, sliding_window=None)) == [None, None]


def test_qwen2_windows_layers_from_max_window_layers():
    on = transformers.Qwen2Config(num_hidden_layers=4, use_sliding_window=True, sliding_window=8, max_window_layers=2)
    assert layer_windows(on) == [None, None, 8, 8]
    off = transformers.Qwen2Config(num_hidden_layers=4, use_sliding_window=False, sliding_window=8)
    assert layer_windows(off) == [None] * 4
    assert sliding_window(off) is None


class _Plain:
    """A config object as a hand-written or older config gives it: attributes only."""

    def __init__(self, **kw) -> None:
        self.__dict__.update(kw)


def test_layer_types_and_plain_configs():
    mixed = _Plain(
        num_hidden_layers=3, sliding_window=4, layer_types=["sliding_attention", "full_attention", "sliding_attention"]
    )
    assert layer_windows(mixed) == [4, None, 4]
    assert sliding_window(_Plain(num_hidden_layers=2, sliding_window=4, layer_types=["full_attention"] * 2)) is None
    qwen2_style = _Plain(num_hidden_layers=3, sliding_window=4, use_sliding_window=True, max_window_layers=1)
    assert layer_windows(qwen2_style) == [None, 4, 4]
    assert layer_windows(_Plain(num_hidden_layers=2, sliding_window=None)) == [None, None]
