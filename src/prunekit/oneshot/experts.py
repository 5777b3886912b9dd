"""Mixture-of-experts layers for one-shot pruning: experts stored as 3-D parameters, and routers.

``transformers`` 5 keeps a block's routed experts in one module (decorated by
``use_experts_implementation``) with 3-D parameters -- ``gate_up_proj`` (or ``up_proj``) and
``down_proj``, ``[E, out, in]`` or, with ``is_transposed``, ``[E, in, out]`` -- run per expert,
batched or through ``torch._grouped_mm``, and called as ``experts(hidden [N, H], top_k_index [N, K],
top_k_weights [N, K])``. One-shot pruning prunes each expert's 2-D slice as a layer of its own
from the tokens routed to that expert only:

* :func:`experts_layout` -- the parameters of such a module and how they are stored;
* :func:`tapped` -- for the time of a ``with``, the experts modules run an eager loop of the same
  computation that hands each expert's input rows (and their flat token indices) to a callback
  before each slice is applied, optionally following the routing recorded in another run (the
  dense copy of a block then sees its experts' inputs on the pruned block's tokens, row for row).

Examples:
    >>> import torch
    >>> class Experts(torch.nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.num_experts, self.has_gate, self.is_transposed = 2, True, False
    ...         self.gate_up_proj = torch.nn.Parameter(torch.zeros(2, 2 * 3, 4))
    ...         self.down_proj = torch.nn.Parameter(torch.zeros(2, 4, 3))
    >>> lay = experts_layout(Experts())
    >>> lay.tensors, lay.experts
    (('gate_up_proj', 'down_proj'), 2)
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any, Callable, Dict, Iterator, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import reparam
from ..moe import ExpertsLayout, experts_layout

__all__ = ["Routes", "Tap", "eager_experts", "tapped"]

#: ``tap(tensor_name, expert, rows, token_index)``: called before expert ``expert``'s slice of ``tensor_name``
#: multiplies ``rows`` (the flat indices of their tokens in ``token_index``)
Tap = Callable[[str, int, Tensor, Tensor], None]
#: the routing ``(top_k_index, top_k_weights)`` of each experts module, by its name in the block
Routes = Dict[str, Tuple[Tensor, Tensor]]


def _value(m: nn.Module, name: str) -> Tensor:
    """``m.name`` as the experts compute with it (masked when pruned), for reading only."""
    if reparam.is_masked(m, name):
        return reparam.effective_for_reading(m, name)
    return getattr(m, name)


def _linear(x: Tensor, w: Tensor, b: Optional[Tensor], transposed: bool) -> Tensor:
    y = x @ w if transposed else F.linear(x, w)
    return y if b is None else y + b


def eager_experts(m: nn.Module, lay: ExpertsLayout, hidden: Tensor, index: Tensor, weights: Tensor,
                  tap: Optional[Tap] = None) -> Tensor:
    """The experts' output computed one expert at a time (``tap`` called before each slice is applied).

    Examples:
        >>> import torch
        >>> class Experts(torch.nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.num_experts, self.has_gate, self.is_transposed = 2, False, False
        ...         self.up_proj = torch.nn.Parameter(torch.ones(2, 3, 4))
        ...         self.down_proj = torch.nn.Parameter(torch.ones(2, 4, 3))
        ...         self.act_fn = torch.nn.Identity()
        ...     def forward(self, hidden, top_k_index, top_k_weights):
        ...         return eager_experts(self, experts_layout(self), hidden, top_k_index, top_k_weights)
        >>> m, x = Experts(), torch.ones(2, 4)
        >>> eager_experts(m, experts_layout(m), x, torch.tensor([[0], [1]]), torch.ones(2, 1)).tolist()
        [[12.0, 12.0, 12.0, 12.0], [12.0, 12.0, 12.0, 12.0]]
    """
    hf: Any = m  # a transformers experts module: act_fn, _apply_gate and post_expert_norm are its own
    out = torch.zeros_like(hidden)
    up, down = _value(m, lay.up), _value(m, "down_proj")
    up_b = _value(m, lay.up + "_bias") if lay.bias else None
    down_b = _value(m, "down_proj_bias") if lay.bias else None
    for e in range(lay.experts):
        tokens, slot = torch.where(index == e)
        if tokens.numel() == 0:
            continue
        x = hidden[tokens]
        if tap is not None:
            tap(lay.up, e, x, tokens)
        h = _linear(x, up[e], None if up_b is None else up_b[e], lay.transposed)
        if not lay.gated:
            h = hf.act_fn(h)
        else:
            h = hf._apply_gate(h) if hasattr(m, "_apply_gate") else _default_gate(m, h)
        if tap is not None:
            tap("down_proj", e, h, tokens)
        y = _linear(h, down[e], None if down_b is None else down_b[e], lay.transposed)
        if getattr(m, "has_post_expert_norm", False):
            y = hf.post_expert_norm(y)
        out.index_add_(0, tokens, (y * weights[tokens, slot, None]).to(out.dtype))
    return out


def _default_gate(m: nn.Module, h: Tensor) -> Tensor:
    act_fn: Any = m.act_fn  # the experts module's activation (a module or a function)
    gate, up = h.chunk(2, dim=-1)
    return act_fn(gate) * up


def _call_args(m: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Tuple[Tensor, Tensor, Tensor]:
    """``(hidden, top_k_index, top_k_weights)`` of a call, whatever the family names them."""
    if len(args) >= 3:
        return args[0], args[1], args[2]
    bound = inspect.signature(type(m).forward).bind(m, *args, **kwargs)
    values = list(bound.arguments.values())[1:4]
    if len(values) < 3:
        raise TypeError(f"{type(m).__name__} was called without (hidden, top_k_index, top_k_weights)")
    return values[0], values[1], values[2]


@contextlib.contextmanager
def tapped(modules: Dict[str, Tuple[nn.Module, Tap]], record: Optional[Routes] = None,
           replay: Optional[Routes] = None) -> Iterator[None]:
    """For the ``with`` body, each experts module of ``modules`` (name -> (module, tap)) runs
    :func:`eager_experts` with its tap; ``record`` keeps each module's routing, ``replay`` uses the
    routing recorded under the module's name instead of its own. Every forward is put back however
    the body ends.

    Examples:
        >>> import torch
        >>> class Experts(torch.nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.num_experts, self.has_gate, self.is_transposed = 2, False, False
        ...         self.up_proj = torch.nn.Parameter(torch.ones(2, 3, 4))
        ...         self.down_proj = torch.nn.Parameter(torch.ones(2, 4, 3))
        ...         self.act_fn = torch.nn.Identity()
        ...     def forward(self, hidden, top_k_index, top_k_weights):
        ...         return eager_experts(self, experts_layout(self), hidden, top_k_index, top_k_weights)
        >>> m, x = Experts(), torch.ones(2, 4)
        >>> seen = []
        >>> with tapped({"experts": (m, lambda name, e, rows, tokens: seen.append((name, e, tokens.tolist())))}):
        ...     _ = m(x, torch.tensor([[1], [1]]), torch.ones(2, 1))
        >>> seen, "forward" in m.__dict__
        ([('up_proj', 1, [0, 1]), ('down_proj', 1, [0, 1])], False)
    """
    installed = []
    try:
        for name, (m, tap) in modules.items():
            lay = experts_layout(m)
            if lay is None:
                raise TypeError(f"{name} ({type(m).__name__}) is not an experts module with 3-D parameters")
            installed.append((m, m.__dict__.get("forward")))
            m.forward = _tapped_forward(m, lay, name, tap, record, replay)
        yield
    finally:
        for m, own in reversed(installed):
            if own is None:
                m.__dict__.pop("forward", None)
            else:
                m.__dict__["forward"] = own


def _tapped_forward(m: nn.Module, lay: ExpertsLayout, name: str, tap: Tap, record: Optional[Routes],
                    replay: Optional[Routes]) -> Callable[..., Tensor]:
    def forward(*args: Any, **kwargs: Any) -> Tensor:
        hidden, index, weights = _call_args(m, args, kwargs)
        if replay is not None and name in replay:
            index, weights = replay[name]
        if record is not None:
            record[name] = (index, weights)
        return eager_experts(m, lay, hidden, index, weights, tap).to(hidden.dtype)
    return forward
