"""Group-aware structured pruning: choose whole units and write them as masks."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor, nn

from .._backend import require_torch
from . import _masks
from .graph import DependencyGraph, Group, build_dependency_graph
from .importance import group_importance

logger = logging.getLogger(__name__)

__all__ = ["GroupDecision", "prune_groups"]


@dataclass
class GroupDecision:
    """What :func:`prune_groups` did to one group."""

    group: Group
    removed: List[int]  # unit indices
    total: int

    @property
    def kept(self) -> int:
        return self.total - len(self.removed)


def _keep_count(n: int, n_remove: int, width: int, round_to: Optional[int]) -> int:
    keep = max(n - n_remove, 1)
    if round_to:
        step = round_to // math.gcd(round_to, width)
        keep = max(step, int(math.ceil(keep / step)) * step)
    return min(keep, n)


def prune_groups(
    model: nn.Module,
    example_inputs: Any,
    amount: float,
    *,
    importance: Union[str, Callable[[Tensor, int], Tensor]] = "l1",
    scope: str = "local",
    ignored_layers: Optional[Sequence[Any]] = None,
    round_to: Optional[int] = None,
    exact: bool = True,
    generator: Optional[torch.Generator] = None,
) -> List[GroupDecision]:
    """Mask the least important ``amount`` of every group of coupled channels/heads.

    Whole units are masked in every tensor they span (a conv's rows and bias, its
    batchnorm, the next layer's input columns, both sides of a residual add), through
    ``custom_from_mask``, so the masked model can be evaluated and fine-tuned; then
    :func:`compact` removes them.

    Args:
        amount: fraction in [0, 1) of units to remove.
        importance: ``"l1"``, ``"l2"``, ``"taylor"`` (needs ``.grad``), ``"random"`` or a callable.
        scope: ``"local"`` (each group loses ``amount``) or ``"global"`` (the lowest
            ``amount`` of all units, scores normalized by each group's mean).
        ignored_layers: modules/names left alone (default: the final classifier).
        round_to: keep a multiple of this many channels per group (e.g. 8).

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from prunekit.compact import prune_groups
        >>> m = nn.Sequential(nn.Conv2d(3, 16, 3), nn.BatchNorm2d(16), nn.ReLU(), nn.Conv2d(16, 8, 3))
        >>> d = prune_groups(m, torch.randn(1, 3, 8, 8), 0.5, ignored_layers=[])
        >>> [x.kept for x in d]
        [8]
    """
    require_torch(model, "prunekit.prune_groups")
    if isinstance(amount, bool) or not isinstance(amount, (int, float)):
        raise TypeError(f"amount must be a float in [0, 1), got {type(amount).__name__}")
    if not 0.0 <= float(amount) < 1.0:
        raise ValueError(f"amount must be in [0, 1) (the fraction of units to remove), got {amount}")
    if scope not in ("local", "global"):
        raise ValueError(f"scope must be 'local' or 'global', got {scope!r}")
    if round_to is not None and (not isinstance(round_to, int) or round_to < 1):
        raise ValueError(f"round_to must be a positive int or None, got {round_to!r}")
    graph = build_dependency_graph(model, example_inputs, ignored_layers=ignored_layers, exact=exact)
    groups = graph.prunable_groups()
    scores = [group_importance(graph, g, importance, generator) for g in groups]
    decisions: List[GroupDecision] = []
    if scope == "local":
        counts = [int(round(amount * len(g.units))) for g in groups]
    else:
        norm = [s / (s.mean() + 1e-12) for s in scores]
        flat = torch.cat(norm) if norm else torch.empty(0)
        k = int(round(amount * flat.numel()))
        counts = [0] * len(groups)
        if k:
            order = torch.argsort(flat, stable=True)[:k]
            owner = torch.cat([torch.full((len(g.units),), i) for i, g in enumerate(groups)])
            for i in owner[order].tolist():
                counts[i] += 1
    for g, s, c in zip(groups, scores, counts):
        n = len(g.units)
        keep = _keep_count(n, c, g.units[0].width(), round_to)
        order = torch.argsort(s, stable=True)
        decisions.append(GroupDecision(g, sorted(order[: n - keep].tolist()), n))
    _write_masks(graph, decisions)
    return decisions


def _write_masks(graph: DependencyGraph, decisions: List[GroupDecision]) -> None:
    masks: Dict[Tuple[str, str], Tensor] = {}
    for d in decisions:
        for ui in d.removed:
            for (mname, sname), idx in d.group.units[ui].members.items():
                spec = graph.slots[(mname, sname)].spec
                for e in spec.entries:
                    if e.role == "buffer":
                        continue
                    key = (mname, e.path)
                    if key not in masks:
                        owner, leaf = _masks.owner_of(graph.module(mname), e.path)
                        masks[key] = torch.ones_like(_masks.raw(owner, leaf).detach())
                    masks[key].index_fill_(e.axis, idx + e.offset, 0)
    for (mname, path), mask in masks.items():
        owner, leaf = _masks.owner_of(graph.module(mname), path)
        _masks.apply_mask(owner, leaf, mask)
    logger.info("prune_groups: masked %d units in %d tensors", sum(len(d.removed) for d in decisions), len(masks))
