"""The layer stack every family builds from: tensor-parallel linears and vocabulary layers whose
weight loaders take whole checkpoint tensors and keep their shard, and the weight formats they run
in (linear_method.py)."""

from pagedllm.layers.checkpoint import BlockRows, CheckpointTensor
from pagedllm.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    tensor_parallel_refusal,
)
from pagedllm.layers.linear_method import LinearMethods
from pagedllm.layers.loading import finish_layers, load_into
from pagedllm.layers.vocab import ParallelLMHead, VocabParallelEmbedding

__all__ = [
    "BlockRows",
    "CheckpointTensor",
    "ColumnParallelLinear",
    "LinearMethods",
    "MergedColumnParallelLinear",
    "ParallelLMHead",
    "QKVParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "finish_layers",
    "load_into",
    "tensor_parallel_refusal",
]
