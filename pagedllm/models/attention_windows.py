"""Each layer's sliding attention window, read from a Hugging Face config as transformers reads it.

Its own module because more than the Llama decoder asks it: Gemma 3 builds its layers from it, and
the engine builder reads it for the KV manager's release of out-of-window blocks and for
``disable_sliding_window``'s cap on max_model_len.
"""

from __future__ import annotations


def layer_windows(cfg) -> list[int | None]:
    """Each layer's sliding attention window (None: that layer attends to the whole context), as
    transformers reads the config: ``layer_types`` ("sliding_attention" / "full_attention") where
    given; else Qwen2's ``use_sliding_window`` with ``max_window_layers`` (layers from that index
    on are windowed); else Mistral's ``sliding_window`` for every layer."""
    n = cfg.num_hidden_layers
    window = getattr(cfg, "sliding_window", None)
    if window is None or getattr(cfg, "use_sliding_window", True) is False:
        return [None] * n
    window = int(window)
    layer_types = getattr(cfg, "layer_types", None)
    if layer_types is not None:
        return [window if t == "sliding_attention" else None for t in layer_types]
    first = getattr(cfg, "max_window_layers", None) if hasattr(cfg, "use_sliding_window") else None
    return [window if first is None or i >= first else None for i in range(n)]


def sliding_window(cfg) -> int | None:
    """The smallest attention window any layer uses, or None if every layer attends to all."""
    windows = [w for w in layer_windows(cfg) if w is not None]
    return min(windows) if windows else None
