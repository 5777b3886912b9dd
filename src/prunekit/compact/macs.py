"""A small multiply-accumulate counter, by operation, that works on any model that runs."""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from . import weights
from .handlers.base import arg
from ..moe import ExpertsLayout, experts_layout
from .trace.inputs import split_inputs

__all__ = ["count_macs", "count_params"]


def _prod(xs: Any) -> int:
    return int(math.prod(xs))


class _MacMode(TorchFunctionMode):
    """Adds up the MACs of every counted op; ``effective``: a linear/conv op counts only its non-zero weights."""

    def __init__(self, effective: bool = False) -> None:
        super().__init__()
        self.macs = 0
        self.effective = effective
        self.in_experts = 0  # inside a routed experts module, which counts itself (see _experts_macs)

    def _weight_macs(self, out: torch.Tensor, w: torch.Tensor) -> int:
        """A linear/conv op: every output element reads ``w.shape[1:]`` weights; effective: only non-zero ones.

        Each output position (an output element per output channel) reads every weight once, so the
        effective count is (non-zero weights) x (output positions); NaN counts as non-zero.
        """
        if not self.effective:
            return out.numel() * _prod(w.shape[1:])
        positions = out.numel() // w.shape[0] if w.shape[0] else 0
        return int(torch.count_nonzero(w.detach())) * positions

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.in_experts:
            return func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        if name in ("linear", "conv1d", "conv2d", "conv3d"):
            out = func(*args, **kwargs)
            self.macs += self._weight_macs(out, args[1] if len(args) > 1 else kwargs["weight"])
            return out
        if name in ("conv_transpose1d", "conv_transpose2d", "conv_transpose3d"):
            out = func(*args, **kwargs)
            x = args[0] if args else kwargs["input"]
            w = args[1] if len(args) > 1 else kwargs["weight"]
            # each input element of channel c meets the weights w[c] (out/groups x kernel); effective: non-zero ones
            if not self.effective:
                self.macs += x.numel() * _prod(w.shape[1:])
            elif w.shape[0]:
                self.macs += (x.numel() // w.shape[0]) * int(torch.count_nonzero(w.detach()))
            return out
        if name in ("matmul", "__matmul__", "bmm", "mm", "baddbmm", "addmm", "addbmm", "grouped_mm", "_grouped_mm"):
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


    def enter_experts(self, module: nn.Module, args: tuple) -> None:
        self.in_experts += 1

    def leave_experts(self, layout: ExpertsLayout, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        self.in_experts -= 1
        if not self.in_experts:
            self.macs += _experts_macs(module, layout, arg(args, kwargs, 1, "top_k_index"), self.effective)


def _experts_macs(module: nn.Module, layout: ExpertsLayout, top_k_index: Any, effective: bool) -> int:
    """A routed experts module: per expert, (tokens it received) x (MACs of its projections for one token)."""
    if not isinstance(top_k_index, torch.Tensor):
        return 0
    idx = top_k_index.detach().reshape(-1).long()
    idx = idx[(idx >= 0) & (idx < layout.experts)]  # an out-of-range index (expert parallelism) runs nowhere
    tokens = torch.bincount(idx, minlength=layout.experts)
    if not effective:
        up_rows = (2 if layout.gated else 1) * layout.intermediate
        return int(tokens.sum()) * (up_rows + layout.intermediate) * layout.hidden
    per_expert = sum(torch.count_nonzero(weights.read_only(module, p).reshape(layout.experts, -1), dim=1)
                     for p in (layout.up, "down_proj"))
    return int((tokens * per_expert).sum())


def _mha_macs(args: tuple, kwargs: dict) -> int:
    """F.multi_head_attention_forward (seq-first, packed weights): projections + attention."""
    q, k = args[0], args[1]
    e = args[3]
    w_out = args[11] if len(args) > 11 else kwargs["out_proj_weight"]
    nq, nk = q.numel() // e, k.numel() // e
    src = k.shape[0]
    return nq * e * e + 2 * nk * e * e + 2 * nq * src * e + nq * w_out.shape[1] * w_out.shape[0]


def count_macs(model: nn.Module, example_inputs: Any, *, effective: bool = False) -> int:
    """Multiply-accumulates of one forward pass: linear, conv (also transposed), matmul and attention ops.

    Element-wise ops, norms and pooling are not counted. With ``effective=True``
    a linear or convolution op counts only its non-zero weights (the MACs a
    kernel that skips zero weights would do: non-zero weights x output
    positions); a pruned module counts through its effective weight
    (``weight_orig * weight_mask``). Ops without weights (matmul, attention)
    count in full either way.

    Mixture-of-experts: a routed experts module (3-D expert weights, as in
    ``transformers``' Mixtral, Qwen2-MoE, Qwen3-MoE) counts what its experts do
    for the tokens they actually receive: for every (token, chosen expert) pair of
    the router's top-k choice, that expert's gate/up and down projections for one
    token (``effective``: that expert's non-zero weights). An expert that receives
    no token costs nothing; the result is the same whichever implementation runs
    (per-expert loop, batched or grouped matmul). The router counts as a linear layer.

    Examples:
        >>> import torch
        >>> fc = torch.nn.Linear(8, 4)
        >>> count_macs(fc, torch.randn(3, 8))
        96
        >>> with torch.no_grad(): fc.weight[:, :6] = 0
        >>> count_macs(fc, torch.randn(3, 8), effective=True)  # 8 non-zero weights x 3 rows
        24
    """
    args, kwargs = split_inputs(example_inputs)
    mode = _MacMode(effective)
    was = [(m, m.training) for m in model.modules()]
    hooks = []
    try:
        for m in model.modules():
            layout = experts_layout(m)
            if layout is not None:
                hooks.append(m.register_forward_pre_hook(mode.enter_experts))
                hooks.append(m.register_forward_hook(functools.partial(mode.leave_experts, layout), with_kwargs=True))
        model.eval()
        with torch.enable_grad(), mode:  # grad on: keeps fused inference fast paths out of the way
            model(*args, **kwargs)
    finally:
        for h in hooks:
            h.remove()
        for m, t in was:
            m.training = t
    return mode.macs


def count_params(model: nn.Module) -> int:
    """Number of stored parameter elements (a masked weight counts in full).

    Examples:
        >>> count_params(torch.nn.Linear(8, 4))
        36
    """
    return sum(p.numel() for p in model.parameters())
