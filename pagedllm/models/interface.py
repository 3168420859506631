"""What the loader, the engine builder, the runner and the benchmarks expect of a model.

Every family (llama.py, gpt2.py, opt.py) provides this; nothing outside pagedllm.models looks at
a family's own layers. The loader builds a model on the meta device, materialises it with
``to_empty`` (which leaves non-persistent buffers uninitialised), copies the checkpoint in with
``load_hf_weights`` and then lets the model recompute what is computed rather than loaded
(``init_computed_buffers``: RoPE tables, for instance).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol, runtime_checkable

import torch
from torch import nn

from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.kernels.interface import CpuKernels

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

    def load_hf_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copies Hugging Face-named checkpoint tensors in; raises on unknown, missing or misshapen ones."""
        ...

    def init_computed_buffers(self, device: torch.device) -> None:
        """Recomputes on ``device`` the buffers made from the config, not the checkpoint."""
        ...

    def pack_for_cpu(self, kernels: CpuKernels | None = None) -> int:
        """Lays bf16 matmul weights out for the CPU kernels; returns how many layers it packed."""
        ...
