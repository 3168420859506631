"""What the loader, the engine builder, the runner and the benchmarks expect of a model.

Every family (llama.py, gemma3.py, phi3.py, gpt2.py, opt.py) provides this; nothing outside
pagedllm.models looks at a family's own layers. The loader (loader.py) builds a model (one
tensor-parallel rank's, or the whole), streams the checkpoint's tensors into ``load_weights``
(each layer keeps its shard), has ``finish_weights`` build the layers' GEMMs in the weight
formats it chose, and then lets the model recompute what is computed rather than loaded
(``init_computed_buffers``: RoPE tables, for instance).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol, runtime_checkable

import torch
from torch import nn

from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.layers import CheckpointTensor, LinearMethods

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]


@runtime_checkable
class CausalLM(Protocol):
    """A decoder over a flat batch of tokens and a paged KV cache.

    ``forward(input_ids[T], positions[T], kv_caches, meta) -> hidden[T, D]``: K/V of every layer
    go into that layer's cache at ``meta.slot_mapping`` (pagedllm.attention.paged_attention), so
    the attention kernels the runner put in ``meta`` serve every family alike.

    Optional, looked up with getattr: ``enable_cpu_kernels(kernels) -> bool`` (a fused CPU layer
    path; absent: the layers run in PyTorch, attention still takes the compiled kernels);
    ``prefix_cache_salt(num_prompt_tokens) -> bytes | None`` (what besides the tokens decides the
    cached keys); ``uses_prompt_lens = True`` (the runner then fills ``meta.prompt_lens``).
    """

    layers: nn.ModuleList  # one per decoder layer: the KV cache has a (K, V) pair for each
    num_heads: int  # query heads
    num_kv_heads: int  # K/V heads the cache stores (== num_heads without GQA)
    head_dim: int
    num_params: int  # set by the loader: parameters before packing (FLOP-per-token figures)

    def __call__(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: KVCaches, meta: AttentionMetadata
    ) -> torch.Tensor: ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[rows, vocab] logits in the model's dtype."""
        ...

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """argmax of compute_logits(hidden) per row without the logits, or None where it cannot."""
        ...

    def activation_dtype(self) -> torch.dtype:
        """dtype of the hidden states (and so of the KV cache)."""
        ...

    def load_weights(self, tensors: Iterable[tuple[str, CheckpointTensor]]) -> None:
        """Takes Hugging Face-named checkpoint tensors (float, or GGUF block rows); raises on
        unknown or misshapen ones."""
        ...

    def finish_weights(self, methods: LinearMethods) -> None:
        """Builds the layers' GEMMs in ``methods``' weight formats; raises on missing weights."""
        ...

    def init_computed_buffers(self, device: torch.device) -> None:
        """Recomputes on ``device`` the buffers made from the config, not the checkpoint."""
        ...
