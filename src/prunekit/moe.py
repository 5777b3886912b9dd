"""How ``transformers`` 5 stores a mixture-of-experts layer: the experts module and the router.

Pure queries over a module's attributes and tensors (``transformers`` is never imported), shared
by compaction (:mod:`prunekit.compact.handlers.moe`), one-shot pruning
(:mod:`prunekit.oneshot.experts`) and MACs counting:

* :func:`experts_layout` -- an experts module keeps its routed experts in 3-D parameters,
  ``gate_up_proj`` (or ``up_proj`` without a gate) and ``down_proj``, ``[E, out, in]`` or, with
  ``is_transposed``, ``[E, in, out]``; optional per-expert biases (``has_bias``);
* :func:`is_router` -- a router is a leaf with a bare ``weight`` ``[num_experts, hidden]``, ``top_k``
  and ``num_experts``.

Examples:
    >>> import torch
    >>> class Experts(torch.nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.num_experts = 4
    ...         self.gate_up_proj = torch.nn.Parameter(torch.zeros(4, 2 * 6, 8))
    ...         self.down_proj = torch.nn.Parameter(torch.zeros(4, 8, 6))
    >>> lay = experts_layout(Experts())
    >>> lay.experts, lay.hidden, lay.intermediate, lay.tensors
    (4, 8, 6, ('gate_up_proj', 'down_proj'))
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch
from torch import nn

from . import reparam

__all__ = ["ExpertsLayout", "experts_layout", "is_router"]


@dataclass(frozen=True)
class ExpertsLayout:
    """Where the sizes of an experts module live: ``up`` is ``gate_up_proj`` (gated experts) or
    ``up_proj``; ``transposed`` weights are ``[E, in, out]`` instead of ``[E, out, in]``;
    ``interleaved``: gate and up rows alternate instead of gate rows then up rows; ``bias``: the
    parameters have per-expert biases (``<name>_bias``)."""

    up: str
    experts: int
    hidden: int
    intermediate: int
    gated: bool
    interleaved: bool
    transposed: bool
    bias: bool = False

    @property
    def out_axis(self) -> int:
        return 2 if self.transposed else 1

    @property
    def in_axis(self) -> int:
        return 1 if self.transposed else 2

    @property
    def tensors(self) -> Tuple[str, str]:
        """The parameters' names, in the order the experts apply them."""
        return (self.up, "down_proj")


def _shape3(m: nn.Module, name: str) -> Optional[torch.Size]:
    t = reparam.stored(m, name)  # masked or not
    return t.shape if isinstance(t, torch.Tensor) and t.dim() == 3 else None


def experts_layout(m: nn.Module) -> Optional[ExpertsLayout]:
    """The :class:`ExpertsLayout` of a ``transformers`` experts module, or None.

    Examples:
        >>> import torch
        >>> experts_layout(torch.nn.Linear(4, 4)) is None
        True
    """
    if "down_proj" not in m._parameters and "down_proj_orig" not in m._parameters:
        return None  # cheap first: every supported layout has a 3-D down_proj parameter of its own
    gated = bool(getattr(m, "has_gate", True))
    up = "gate_up_proj" if gated else "up_proj"
    up_shape, down_shape = _shape3(m, up), _shape3(m, "down_proj")
    n = getattr(m, "num_experts", None)
    if up_shape is None or down_shape is None or not isinstance(n, int) or isinstance(n, bool):
        return None
    transposed = bool(getattr(m, "is_transposed", False))
    e, up_out, up_in = (up_shape[0], up_shape[2], up_shape[1]) if transposed else tuple(up_shape)
    _, down_out, down_in = (down_shape[0], down_shape[2], down_shape[1]) if transposed else tuple(down_shape)
    inter = down_in
    if not (e == n == down_shape[0] and up_in == down_out and up_out == (2 if gated else 1) * inter):
        return None
    return ExpertsLayout(up, n, up_in, inter, gated, not bool(getattr(m, "is_concatenated", True)), transposed,
                         bool(getattr(m, "has_bias", False)))


def is_router(m: nn.Module) -> bool:
    """Whether ``m`` is a mixture-of-experts router: a leaf with a ``weight`` ``[num_experts, hidden]``,
    ``top_k`` and ``num_experts``, whose other tensors (a bias, score corrections) are per expert.

    Examples:
        >>> import torch
        >>> class Router(torch.nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.top_k, self.num_experts = 2, 4
        ...         self.weight = torch.nn.Parameter(torch.zeros(4, 8))
        >>> is_router(Router()), is_router(torch.nn.Linear(8, 4))
        (True, False)
    """
    if "weight" not in m._parameters and "weight_orig" not in m._parameters:
        return False
    n, k = getattr(m, "num_experts", None), getattr(m, "top_k", None)
    if not (isinstance(n, int) and isinstance(k, int)) or isinstance(m, (nn.Linear, nn.Embedding)) or m._modules:
        return False
    w = reparam.stored(m, "weight")
    if w is None or w.dim() != 2 or w.shape[0] != n:
        return False
    others = [t for t_name, t in list(m._parameters.items()) + list(m._buffers.items())
              if t is not None and t_name not in ("weight", "weight_orig", "weight_mask")]
    return all(tuple(t.shape) == (n,) for t in others)
