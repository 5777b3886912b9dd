"""A small multiply-accumulate counter, by operation, that works on any model that runs."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from .inputs import split_inputs

__all__ = ["count_macs", "count_params"]


def _prod(xs: Any) -> int:
    return int(math.prod(xs))


class _MacMode(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.macs = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name == "linear":
            out = func(*args, **kwargs)
            self.macs += out.numel() * args[1].shape[-1]
            return out
        if name in ("conv1d", "conv2d", "conv3d"):
            out = func(*args, **kwargs)
            w = args[1] if len(args) > 1 else kwargs["weight"]
            self.macs += out.numel() * _prod(w.shape[1:])
            return out
        if name in ("conv_transpose1d", "conv_transpose2d", "conv_transpose3d"):
            out = func(*args, **kwargs)
            x = args[0] if args else kwargs["input"]
            w = args[1] if len(args) > 1 else kwargs["weight"]
            self.macs += x.numel() * _prod(w.shape[1:])  # each input element meets out/groups x kernel weights
            return out
        if name in ("matmul", "__matmul__", "bmm", "mm", "baddbmm", "addmm", "addbmm"):
            out = func(*args, **kwargs)
            a = args[1] if name.startswith("add") or name == "baddbmm" else args[0]
            self.macs += out.numel() * a.shape[-1]
            return out
        if name == "scaled_dot_product_attention":
            q, k, v = args[:3]
            out = func(*args, **kwargs)
            self.macs += _prod(q.shape[:-1]) * k.shape[-2] * (q.shape[-1] + v.shape[-1])
            return out
        if name == "multi_head_attention_forward":
            out = func(*args, **kwargs)
            self.macs += _mha_macs(args, kwargs)
            return out
        return func(*args, **kwargs)


def _mha_macs(args: tuple, kwargs: dict) -> int:
    """F.multi_head_attention_forward (seq-first, packed weights): projections + attention."""
    q, k = args[0], args[1]
    e = args[3]
    w_out = args[11] if len(args) > 11 else kwargs["out_proj_weight"]
    nq, nk = q.numel() // e, k.numel() // e
    src = k.shape[0]
    return nq * e * e + 2 * nk * e * e + 2 * nq * src * e + nq * w_out.shape[1] * w_out.shape[0]


def count_macs(model: nn.Module, example_inputs: Any) -> int:
    """Multiply-accumulates of one forward pass: linear, conv (also transposed), matmul and attention ops.

    Element-wise ops, norms and pooling are not counted.

    Example:
        >>> import torch
        >>> count_macs(torch.nn.Linear(8, 4), torch.randn(3, 8))
        96
    """
    args, kwargs = split_inputs(example_inputs)
    mode = _MacMode()
    was = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        with torch.enable_grad(), mode:  # grad on: keeps fused inference fast paths out of the way
            model(*args, **kwargs)
    finally:
        for m, t in was:
            m.training = t
    return mode.macs


def count_params(model: nn.Module) -> int:
    """Number of stored parameter elements (a masked weight counts in full).

    Example:
        >>> count_params(torch.nn.Linear(8, 4))
        36
    """
    return sum(p.numel() for p in model.parameters())
