"""Filling a model from a stream of checkpoint tensors, and finishing its layers.

A family's ``load_weights`` names each checkpoint tensor in its own terms (module path, leaf,
and the part of a fused layer it is) and hands it to ``load_into``: a parallel layer's
``weight_loader`` keeps its shard, any other parameter (norms, learned positions) is copied in
whole. ``finish_layers`` then builds every layer's local GEMM by the loader's ``LinearMethods``
and checks that nothing was left unloaded.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.layers.checkpoint import BlockRows, CheckpointTensor
from pagedllm.layers.linear import MergedColumnParallelLinear, ParallelLinear
from pagedllm.layers.linear_method import LinearMethods
from pagedllm.layers.vocab import ParallelLMHead, VocabParallelEmbedding


def load_into(model: nn.Module, name: str, t: CheckpointTensor, part: int | None = None) -> None:
    """Loads ``t`` into ``name`` ("module.path.weight" of ``model``, ``part`` of a fused layer);
    refuses names the model does not have and shapes other than its parameter's. Counts the
    tensor's values in ``model.num_params`` (the whole model's, whatever shard a rank keeps)."""
    module_name, _, leaf = name.rpartition(".")
    try:
        module = model.get_submodule(module_name)
    except AttributeError:
        raise ValueError(f"unexpected weight {name!r} in checkpoint") from None
    loader = getattr(module, "weight_loader", None)
    if loader is not None:
        try:
            n = loader(leaf, t, part)
        except ValueError as e:
            raise ValueError(f"weight {name!r}: {e}") from None
    else:
        p = getattr(module, leaf, None)
        if not isinstance(p, nn.Parameter) or part is not None:
            raise ValueError(f"unexpected weight {name!r} in checkpoint")
        if isinstance(t, BlockRows):  # a small tensor a GGUF file stores in blocks: as floats
            t = t.dequantize()
        if p.shape != t.shape:
            raise ValueError(f"weight {name!r}: checkpoint shape {tuple(t.shape)} != model {tuple(p.shape)}")
        with torch.no_grad():
            p.copy_(t)
        model._loaded_params = getattr(model, "_loaded_params", set()) | {name}
        n = t.numel()
    model.num_params = getattr(model, "num_params", 0) + n


def finish_layers(model: nn.Module, methods: LinearMethods, silu_mul_layers: tuple[str, ...] = ()) -> None:
    """Builds every parallel layer's GEMM (``silu_mul_layers``: names of fused [gate; up] layers
    whose packed GEMM may apply silu(gate) * up in its epilogue); raises on anything unloaded."""
    missing = []
    loaded = getattr(model, "_loaded_params", set())
    for name, _p in model.named_parameters():
        if name not in loaded:
            missing.append(name)
    for name, module in model.named_modules():
        if isinstance(module, (ParallelLinear, VocabParallelEmbedding, ParallelLMHead)):
            missing += [f"{name}: {what}" for what in module.missing()]
    if missing:
        raise ValueError(f"checkpoint is missing weights: {sorted(missing)}")
    for name, module in list(model.named_modules()):
        if isinstance(module, MergedColumnParallelLinear):
            module.finish(methods, silu_mul_epilogue=name.rpartition(".")[2] in silu_mul_layers)
        elif isinstance(module, ParallelLinear):
            module.finish(methods)
        elif isinstance(module, ParallelLMHead):
            module.finish(methods)
        elif isinstance(module, VocabParallelEmbedding) and not module.tied_head:
            module.finish(methods)
    if hasattr(model, "_loaded_params"):
        del model._loaded_params
    _place_packed_weights(model)


def _place_packed_weights(model: nn.Module) -> None:
    """The packed bf16 weights a step streams, moved together onto huge pages (cpu_linear)."""
    from pagedllm.models.cpu_linear import PackedLinear, place_on_huge_pages

    packed = [m for m in model.modules() if isinstance(m, PackedLinear)]
    if packed:
        place_on_huge_pages(packed)
