"""The one door from single-process code to sharded tensors (``torch.distributed`` ``DTensor``).

The reparameterization and the pruning methods ask :func:`handler_for` whether
a tensor is sharded; for ordinary tensors the answer costs one type lookup and
is ``None``, so single-process paths stay as they are. :mod:`prunekit.distributed`
registers the handler that serves sharded tensors (imported by ``prunekit``'s
``__init__``, without importing ``torch.distributed.tensor`` until a sharded
tensor actually shows up).

A handler provides:

* ``claims_type(cls) -> bool``: whether tensors of class ``cls`` are sharded;
* ``value(module, name, orig, mask)``: the pruned tensor's effective value;
* ``compute_mask(method, old, module, name, orig, existing, importance_scores, dtype)``:
  the new mask of a pruning method, as a sharded tensor;
* ``installed(module, name)`` / ``uninstalled(module, name)``: after a mask is
  stored, and after the reparameterization is removed;
* ``global_masks(method, pairs, origs, masks, scores)``: the masks of
  ``global_unstructured`` over tensors some of which are sharded;
* ``count_true(t)`` / ``full(t)``: a sharded tensor's non-zero count / whole
  value, on every rank (collective; for reports);
* ``check_plain(t, module, name)``: raise if a plain tensor is FSDP2's temporary
  all-gathered copy of a sharded parameter (pruning it would detach the
  parameter from FSDP2).
"""

from __future__ import annotations

from typing import Any, Dict, Optional

import torch

__all__ = ["PLAIN_TYPES", "check_plain", "count_nonzero", "handler_for", "register", "whole"]

#: classes that are never sharded: checked first, for free
PLAIN_TYPES = frozenset({torch.Tensor, torch.nn.Parameter})

_HANDLER: Optional[Any] = None
_CLAIMED: Dict[type, bool] = {}


def register(handler: Any) -> None:
    """Make ``handler`` serve sharded tensors (replaces any earlier one)."""
    global _HANDLER
    _HANDLER = handler
    _CLAIMED.clear()


def handler_for(*tensors: Any) -> Optional[Any]:
    """The registered handler if any of ``tensors`` is sharded, else ``None``.

    Examples:
        >>> import torch
        >>> handler_for(torch.zeros(3), torch.nn.Parameter(torch.ones(2))) is None
        True
    """
    if _HANDLER is None:
        return None
    for t in tensors:
        cls = type(t)
        if cls in PLAIN_TYPES:
            continue
        claimed = _CLAIMED.get(cls)
        if claimed is None:
            claimed = _CLAIMED[cls] = bool(_HANDLER.claims_type(cls))
        if claimed:
            return _HANDLER
    return None


def check_plain(t: Any, module: Any, name: str) -> None:
    """Refuse to prune FSDP2's all-gathered copy of a parameter (cheap when no process group is up)."""
    if _HANDLER is None or not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return
    _HANDLER.check_plain(t, module, name)


def count_nonzero(t: Any) -> int:
    """The number of non-zero entries of ``t``, over all ranks for a sharded tensor (then collective).

    Examples:
        >>> import torch
        >>> count_nonzero(torch.tensor([0.0, 2.0, -1.0]))
        2
    """
    h = handler_for(t)
    return int((t != 0).sum()) if h is None else h.count_true(t != 0)


def whole(t: Any) -> Any:
    """``t`` itself, or the whole tensor on every rank for a sharded one (collective: one tensor gathered)."""
    h = handler_for(t)
    return t if h is None else h.full(t)
