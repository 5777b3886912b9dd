"""Removing chosen units from a traced model directly: no masks, the tensors are sliced in place.

:func:`remove_units` is :func:`~prunekit.compact.compact` for a caller that already knows which
units of which groups go (``GroupDecision``): the same module surgery
(:func:`~prunekit.compact.surgery.shrink.shrink_module`), without writing masks first, so no tensor
the size of a weight is allocated besides the smaller copy that replaces it.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from ..transaction import atomic
from .selection.prune import GroupDecision
from .surgery.journal import Journal
from .surgery.shrink import retie, shrink_module, tied_parameters
from .trace.results import DependencyGraph

__all__ = ["remove_units"]


def remove_units(
    model: nn.Module, graph: DependencyGraph, decisions: Sequence[GroupDecision], journal: Optional[Journal] = None
) -> int:
    """Slice every decided unit out of every tensor it spans, in place; returns the units removed.

    ``graph`` is :func:`~prunekit.compact.build_dependency_graph` of ``model`` (its module names
    must still be valid). Module attributes (``out_features``, head counts, ...) follow the new
    shapes; tied parameters (an LM head tied to its embedding) stay one tensor. All or nothing: on any failure (``KeyboardInterrupt`` included) the model is as it
    was; with ``journal`` the changes are recorded there (the caller decides when they stand).

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> from prunekit.compact import build_dependency_graph
        >>> from prunekit.compact.selection.prune import GroupDecision
        >>> m = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        >>> g = build_dependency_graph(m, torch.randn(1, 4))
        >>> remove_units(m, g, [GroupDecision(g.prunable_groups()[0], [0, 5], 8)])
        2
        >>> m[0].out_features, m[2].in_features
        (6, 6)
    """
    removed: Dict[Tuple[str, str], List[Tensor]] = {}
    for d in decisions:
        if not d.removed:
            continue
        if not d.group.prunable:
            raise ValueError(f"prunekit.compact.remove_units: {d.group!r} cannot be pruned ({d.group.blocked})")
        if len(d.removed) >= d.total or min(d.removed) < 0 or max(d.removed) >= d.total:
            raise ValueError(f"prunekit.compact.remove_units: units {d.removed} of a group of {d.total} leave no unit "
                             f"or are out of range; keep at least one of {d.group!r}")
        gone = torch.zeros(d.total, dtype=torch.bool)
        gone[d.removed] = True
        for key, (idx, unit_of) in d.group.member_index().items():
            removed.setdefault(key, []).append(idx[gone[unit_of]])
    by_module: Dict[str, Dict[str, Tensor]] = {}
    for (mname, sname), parts in removed.items():
        idx = torch.cat(parts)
        if idx.numel():
            by_module.setdefault(mname, {})[sname] = torch.sort(idx).values
    tied = tied_parameters(model)
    with atomic(journal if journal is not None else Journal()) as txn:
        for mname, slots in by_module.items():
            shrink_module(model, mname, graph.handlers[mname], slots, txn)  # type: ignore[arg-type]
        retie(model, tied, txn)  # type: ignore[arg-type]
        return sum(len(d.removed) for d in decisions)
