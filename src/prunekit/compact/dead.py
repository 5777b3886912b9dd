"""Which units are dead: removing them cannot change the masked model's output.

A unit (channel, head, group of a grouped conv) is dead when every tensor that *reads*
it is zero there (its consumers' input columns are masked); a unit no tensor reads
(the query/key dims of a head) must be zero everywhere.
"""

from __future__ import annotations

from typing import Dict, List, Tuple

import torch
from torch import Tensor

from .. import reparam
from .results import DependencyGraph, Group

__all__ = ["NonZero", "unit_states", "zero_units"]


class NonZero:
    """Cache: for (module, tensor path, axis), which indices have any non-zero value."""

    def __init__(self, graph: DependencyGraph) -> None:
        self.graph = graph
        self.cache: Dict[Tuple[str, str, int], Tensor] = {}

    def __call__(self, mname: str, path: str, axis: int) -> Tensor:
        key = (mname, path, axis)
        if key not in self.cache:
            owner, leaf = reparam.owner_of(self.graph.module(mname), path)
            t = reparam.effective(owner, leaf)
            self.cache[key] = (t != 0).movedim(axis, 0).reshape(t.shape[axis], -1).any(dim=1)
        return self.cache[key]


def unit_states(graph: DependencyGraph, group: Group, nz: NonZero) -> Tuple[Tensor, Tensor]:
    """Per unit of ``group``: (removable, partially zero), as bool tensors.

    A unit is removable when it is zero in every tensor that reads it (role ``"in"``);
    a unit no tensor reads (the query/key dims of a head) must be zero everywhere.
    Every unit of a group spans the same tensors, so "has readers" is per group.
    """
    n = len(group.units)
    readers_zero = torch.ones(n, dtype=torch.bool)
    others_zero = torch.ones(n, dtype=torch.bool)
    any_zero = torch.zeros(n, dtype=torch.bool)
    has_readers = has_others = False
    for mname, e, idx, unit_of in graph.entries(group):
        nonzero = torch.zeros(n, dtype=torch.long).index_add_(0, unit_of, nz(mname, e.path, e.axis)[idx].long())
        zero = nonzero == 0
        any_zero |= zero
        if e.role == "in":
            readers_zero &= zero
            has_readers = True
        else:
            others_zero &= zero
            has_others = True
    if has_readers:
        return readers_zero, any_zero
    return others_zero & has_others, any_zero


def zero_units(graph: DependencyGraph) -> Dict[int, List[int]]:
    """For each group index, the indices of its units that :func:`compact` would remove.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from prunekit.compact import build_dependency_graph, prune_groups, zero_units
        >>> m = nn.Sequential(nn.Linear(8, 4), nn.ReLU(), nn.Linear(4, 2))
        >>> with torch.no_grad():
        ...     m[2].weight[:, 1] = 0
        >>> zero_units(build_dependency_graph(m, torch.randn(1, 8)))
        {1: [1]}
    """
    nz = NonZero(graph)
    out: Dict[int, List[int]] = {}
    for gi, g in enumerate(graph.groups):
        if not g.prunable:
            continue
        idx = unit_states(graph, g, nz)[0].nonzero().view(-1).tolist()
        if idx:
            out[gi] = idx
    return out
