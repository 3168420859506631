"""Copying checkpoint tensors into a model's parameters, with the checks every family makes."""

from __future__ import annotations

from collections.abc import Collection

import torch
from torch import nn


def copy_weight(own: dict[str, nn.Parameter], name: str, t: torch.Tensor) -> None:
    """Copies checkpoint tensor ``t`` into parameter ``name`` of ``own`` (named_parameters);
    refuses a name the model does not have and a shape other than the parameter's."""
    if name not in own:
        raise ValueError(f"unexpected weight {name!r} in checkpoint")
    p = own[name]
    if p.shape != t.shape:
        raise ValueError(f"weight {name!r}: checkpoint shape {tuple(t.shape)} != model {tuple(p.shape)}")
    with torch.no_grad():
        p.copy_(t)


def check_all_loaded(own: dict[str, nn.Parameter], loaded: set[str], pending: Collection[str] = ()) -> None:
    """Refuses a checkpoint that left parameters unset, or parts of a fused one still ``pending``."""
    missing = sorted(set(own) - loaded)
    if pending or missing:
        raise ValueError(f"checkpoint is missing weights: {missing or sorted(pending)}")
