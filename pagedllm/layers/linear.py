"""Linear layers that hold one tensor-parallel rank's shard of their weight (Megatron-LM's layout).

Each layer is built from the whole model's sizes and the rank's ``TensorParallelGroup`` (None: one
rank, no collective). Its ``weight_loader`` receives each checkpoint tensor whole (a float tensor,
or GGUF block rows) and keeps the rank's part; ``finish`` then turns the parts into the local GEMM
(``local``) by the ``LinearMethods`` the loader chose once:

- column-parallel (``ColumnParallelLinear``, and its fused forms ``MergedColumnParallelLinear``
  [gate; up] and ``QKVParallelLinear`` [q; k; v]): the rank's output rows, no communication; the
  next row-parallel layer consumes them locally;
- row-parallel (``RowParallelLinear``): the rank's input columns, its partial products summed over
  the ranks by one all-reduce, the bias added once after the sum.

KV heads split over the ranks; with fewer KV heads than ranks each is replicated on
world_size / num_kv_heads ranks (vLLM's rule), so every rank's query heads find theirs locally.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.layers.checkpoint import CheckpointTensor, columns_of, rows_of
from pagedllm.layers.linear_method import LinearMethods
from pagedllm.parallel.group import TensorParallelGroup


def tensor_parallel_refusal(num_heads: int, num_kv_heads: int, intermediate_size: int, world_size: int) -> str | None:
    """Why a decoder of these sizes cannot be split over ``world_size`` ranks, or None."""
    if num_heads % world_size:
        return f"{num_heads} attention heads do not split over {world_size} ranks"
    if num_kv_heads % world_size and world_size % num_kv_heads:
        return f"{num_kv_heads} KV heads neither split over nor replicate onto {world_size} ranks"
    if intermediate_size % world_size:
        return f"intermediate size {intermediate_size} does not split over {world_size} ranks"
    return None


def _world(tp: TensorParallelGroup | None) -> tuple[int, int]:
    return (1, 0) if tp is None else (tp.world_size, tp.rank)


class ParallelLinear(nn.Module):
    """What every parallel linear shares: the parts received, the local GEMM built from them."""

    fine_input_scales = False  # GGUF Q4_x / Q5_x: the input quantized per 16 values (QuantizedLinear)

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool, tp: TensorParallelGroup | None) -> None:
        super().__init__()
        self.tp = tp
        self.world_size, self.rank = _world(tp)
        self.in_features, self.out_sizes, self.has_bias = in_features, list(out_sizes), bias
        self._weights: dict[int, CheckpointTensor] = {}
        self._biases: dict[int, torch.Tensor] = {}
        self.local: nn.Module | None = None

    @property
    def out_features(self) -> int:
        """Of this rank's output."""
        return sum(self._local_rows(i).stop - self._local_rows(i).start for i in range(len(self.out_sizes)))

    def _local_rows(self, part: int) -> slice:
        """This rank's rows of output part ``part`` (in the part's own coordinates)."""
        return slice(0, self.out_sizes[part])

    def _keep(self, t: CheckpointTensor, part: int, kind: str) -> CheckpointTensor:
        return rows_of(t, self._local_rows(part))

    def weight_loader(self, kind: str, t: CheckpointTensor, part: int | None = None) -> int:
        """Takes checkpoint tensor ``t`` ("weight" or "bias") of output part ``part`` (None: all
        parts, fused in the checkpoint, split here by their sizes); returns its numel."""
        if kind not in ("weight", "bias") or (kind == "bias" and not self.has_bias):
            raise ValueError(f"unexpected {kind} for a layer of {self.out_sizes} outputs")
        if part is None and len(self.out_sizes) > 1:
            start = 0
            for i, n in enumerate(self.out_sizes):
                self.weight_loader(kind, rows_of(t, slice(start, start + n)), i)
                start += n
            if start != t.shape[0]:
                raise ValueError(f"fused {kind} of {t.shape[0]} rows for parts of {self.out_sizes} rows")
            return t.numel()
        part = part or 0
        expected = (self.out_sizes[part], self.in_features) if kind == "weight" else (self.out_sizes[part],)
        if tuple(t.shape) != expected:
            raise ValueError(f"checkpoint {kind} of shape {tuple(t.shape)} != model {expected}")
        (self._weights if kind == "weight" else self._biases)[part] = self._keep(t, part, kind)
        return t.numel()

    def missing(self) -> list[str]:
        """What the checkpoint has not given this layer yet."""
        parts = range(len(self.out_sizes))
        out = [f"weight part {i}" for i in parts if i not in self._weights]
        if self.has_bias:
            out += [f"bias part {i}" for i in parts if i not in self._biases]
        return out

    def _bias(self) -> torch.Tensor | None:
        if not self.has_bias:
            return None
        return torch.cat([self._biases[i] for i in range(len(self.out_sizes))])

    def finish(self, methods: LinearMethods, silu_mul_epilogue: bool = False) -> None:
        """Builds the local GEMM from the parts (which it then drops)."""
        if self.missing():
            raise ValueError(f"checkpoint is missing {', '.join(self.missing())}")
        weights = [self._weights[i] for i in range(len(self.out_sizes))]
        self.local = methods.linear(weights, self._bias(), silu_mul_epilogue, self.fine_input_scales)
        self._weights, self._biases = {}, {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.local(x)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_sizes={self.out_sizes}, ranks={self.world_size}"


class ColumnParallelLinear(ParallelLinear):
    """y_r = x W_r^T: this rank's equal share of the output rows of each part (a ReplicatedLinear
    with ``tp=None``)."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool = False, tp: TensorParallelGroup | None = None
    ) -> None:
        super().__init__(in_features, [out_features], bias, tp)
        self._check_split()

    def _check_split(self) -> None:
        for n in self.out_sizes:
            if n % self.world_size:
                raise ValueError(f"{n} output features do not split over {self.world_size} ranks")

    def _local_rows(self, part: int) -> slice:
        n = self.out_sizes[part] // self.world_size
        return slice(self.rank * n, (self.rank + 1) * n)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input run as one GEMM ([gate; up]): each
    rank holds its share of every part, parts in order."""

    def __init__(
        self, in_features: int, out_sizes: list[int], bias: bool = False, tp: TensorParallelGroup | None = None
    ) -> None:
        ParallelLinear.__init__(self, in_features, out_sizes, bias, tp)
        self._check_split()


class QKVParallelLinear(ParallelLinear):
    """[q; k; v] of multi-head attention: this rank's query heads and the KV heads they attend
    with (replicated when there are fewer KV heads than ranks)."""

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool = False,
        tp: TensorParallelGroup | None = None,
    ) -> None:
        kv = num_kv_heads * head_dim
        super().__init__(hidden_size, [num_heads * head_dim, kv, kv], bias, tp)
        world, rank = self.world_size, self.rank
        if num_heads % world:
            raise ValueError(f"{num_heads} attention heads do not split over {world} ranks")
        if num_kv_heads % world and world % num_kv_heads:
            raise ValueError(f"{num_kv_heads} KV heads neither split over nor replicate onto {world} ranks")
        self.head_dim = head_dim
        self.num_heads = num_heads // world  # of this rank
        self.num_kv_heads = num_kv_heads // world if num_kv_heads >= world else 1
        self._kv_first = rank * self.num_kv_heads if num_kv_heads >= world else rank // (world // num_kv_heads)

    def _local_rows(self, part: int) -> slice:
        d = self.head_dim
        if part == 0:
            return slice(self.rank * self.num_heads * d, (self.rank + 1) * self.num_heads * d)
        return slice(self._kv_first * d, (self._kv_first + self.num_kv_heads) * d)


class RowParallelLinear(ParallelLinear):
    """y = sum over ranks of x_r W_r^T (one all-reduce), + bias once after the sum. x_r: this
    rank's slice of the input features (the heads / intermediate columns it computed).
    ``fine_input_scales``: for an MLP's down projection (see QuantizedLinear)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        tp: TensorParallelGroup | None = None,
        fine_input_scales: bool = False,
    ) -> None:
        super().__init__(in_features, [out_features], bias, tp)
        self.fine_input_scales = fine_input_scales
        if in_features % self.world_size:
            raise ValueError(f"{in_features} input features do not split over {self.world_size} ranks")
        n = in_features // self.world_size
        self.local_columns = slice(self.rank * n, (self.rank + 1) * n)
        self.bias: torch.Tensor | None = None  # added after the all-reduce (ranks > 1)

    def _keep(self, t: CheckpointTensor, part: int, kind: str) -> CheckpointTensor:
        if kind == "bias" or self.world_size == 1:
            return t
        return columns_of(t, self.local_columns, self.world_size)

    def finish(self, methods: LinearMethods, silu_mul_epilogue: bool = False) -> None:
        if self.world_size == 1:  # the bias inside the one GEMM
            super().finish(methods, silu_mul_epilogue)
            return
        if self.missing():
            raise ValueError(f"checkpoint is missing {', '.join(self.missing())}")
        self.local = methods.linear([self._weights[0]], None, False, self.fine_input_scales)
        self.bias = None if not self.has_bias else self._biases[0].to(methods.dtype)
        self._weights, self._biases = {}, {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp is None:
            return self.local(x)
        out = self.tp.all_reduce(self.local(x))
        return out if self.bias is None else out + self.bias

    @property
    def reduces(self) -> bool:
        """Whether forward all-reduces (the fused decode plan cannot run such a layer)."""
        return self.tp is not None
