"""Group-aware structured pruning: choose whole units and write them as masks."""

from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor, nn

from ..._backend import require_torch
from ...importance import Scorer
from ... import methods, reparam
from ..trace.graph import DependencyGraph, Group, build_dependency_graph, check_graph
from .importance import as_group_scorer, group_importance
from ..surgery.journal import atomic

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
    importance: Union[str, Scorer, Callable[[Tensor, int], Tensor]] = "l1",
    scope: str = "local",
    ignored_layers: Optional[Sequence[Any]] = None,
    round_to: Optional[int] = None,
    exact: bool = True,
    generator: Optional[torch.Generator] = None,
    graph: Optional[DependencyGraph] = None,
    uniform: bool = False,
    gqa: str = "groups",
) -> List[GroupDecision]:
    """Mask the least important ``amount`` of every group of coupled channels/heads.

    Whole units are masked in every tensor they span (a conv's rows and bias, its
    batchnorm, the next layer's input columns, both sides of a residual add), through
    ``custom_from_mask``, so the masked model can be evaluated and fine-tuned; then
    :func:`compact` removes them. Failure-atomic: on any exception (``KeyboardInterrupt``
    included) no mask of this call stays.

    Args:
        amount: fraction in [0, 1) of units to remove.
        importance: ``"l1"``, ``"l2"``, ``"taylor"`` (needs ``.grad``), ``"random"``, any scorer
            registered in :mod:`prunekit.importance` (name or object), or a callable ``f(tensor, axis)``.
        scope: ``"local"`` (each group loses ``amount``) or ``"global"`` (the lowest
            ``amount`` of all units, scores normalized by each group's mean).
        ignored_layers: modules/names left alone (default: the final classifier).
        round_to: keep a multiple of this many channels per group (e.g. 8).
        graph: a :func:`build_dependency_graph` result for ``model`` to reuse (its
            ``ignored_layers``/``exact`` apply); pass the same graph to :func:`compact`
            to trace the model once for both calls.
        uniform: remove the same number of units from every group of the same kind
            (e.g. heads of every block, FFN neurons of every block: groups whose slots
            have the same names up to layer numbers and the same size), so a compacted
            Hugging Face model keeps one config (see :func:`compact`). With ``scope="global"``
            each kind loses the mean of what its groups would have lost.
        gqa: units of grouped-query attention, see :func:`build_dependency_graph`.

    Examples:
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
    as_group_scorer(importance)  # an unknown or unusable criterion fails before any tracing
    if graph is None:
        graph = build_dependency_graph(model, example_inputs, ignored_layers=ignored_layers, exact=exact, gqa=gqa)
    else:
        check_graph(graph, model, ignored_layers)
    groups = graph.prunable_groups()
    scores = [group_importance(graph, g, importance, generator) for g in groups]
    decisions: List[GroupDecision] = []
    if scope == "local":
        counts = [int(round(amount * g.n_units)) for g in groups]
    else:
        norm = [s / (s.mean() + 1e-12) for s in scores]
        flat = torch.cat(norm) if norm else torch.empty(0)
        k = int(round(amount * flat.numel()))
        sizes = torch.tensor([g.n_units for g in groups], dtype=torch.long)
        owner = torch.repeat_interleave(torch.arange(len(groups)), sizes)
        lowest = torch.argsort(flat, stable=True)[:k]
        counts = torch.bincount(owner[lowest], minlength=len(groups)).tolist()
    if uniform:
        counts = _uniform_counts(groups, counts)
    for g, s, c in zip(groups, scores, counts):
        n = g.n_units
        keep = _keep_count(n, c, g.unit_width, round_to)
        order = torch.argsort(s, stable=True)
        decisions.append(GroupDecision(g, sorted(order[: n - keep].tolist()), n))
    return _write_masks(graph, decisions)  # the last step: nothing can fail between the masks and the return


def group_kind(group: Group) -> Tuple[Any, ...]:
    """What a group is, up to its block: slot names with numbers replaced, and its unit count.

    Examples:
        >>> import torch
        >>> from prunekit.compact import build_dependency_graph
        >>> from prunekit.compact.selection.prune import group_kind
        >>> m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
        >>> group_kind(build_dependency_graph(m, torch.randn(1, 4)).prunable_groups()[0])
        ((('#', 'out'), ('#', 'in')), 8)
    """
    names = tuple((re.sub(r"\d+", "#", m), s) for m, s in group.slots)
    return tuple(sorted(set(names), key=names.index)), group.n_units


def _uniform_counts(groups: List[Group], counts: List[int]) -> List[int]:
    by_kind: Dict[Tuple[Any, ...], List[int]] = {}
    for i, g in enumerate(groups):
        by_kind.setdefault(group_kind(g), []).append(i)
    out = list(counts)
    for members in by_kind.values():
        c = int(round(sum(counts[i] for i in members) / len(members)))
        for i in members:
            out[i] = c
    return out


def _write_masks(graph: DependencyGraph, decisions: List[GroupDecision]) -> List[GroupDecision]:
    """Zero every removed unit in every tensor it spans: one ``index_fill_`` per tensor axis; returns
    ``decisions``, from inside the all-or-nothing block (an interrupt before the return undoes the masks)."""
    gone: Dict[Tuple[str, str], Dict[int, List[Tensor]]] = {}
    for d in decisions:
        if not d.removed:
            continue
        removed = torch.zeros(d.total, dtype=torch.bool)
        removed[d.removed] = True
        for mname, e, idx, unit_of in graph.entries(d.group):
            gone.setdefault((mname, e.path), {}).setdefault(e.axis, []).append(idx[removed[unit_of]])
    with atomic() as journal:  # a failure on the third tensor leaves the first two unmasked
        for (mname, path), axes in gone.items():
            owner, leaf = reparam.owner_of(graph.module(mname), path)
            stored = reparam.stored(owner, leaf)
            if stored is None:
                raise ValueError(f"prunekit.compact: module '{mname}' has no tensor '{path}' to mask")
            mask = torch.ones_like(stored.detach())
            for axis, parts in axes.items():
                mask.index_fill_(axis, torch.cat(parts), 0)
            journal.module(owner)
            methods.apply_mask(owner, leaf, mask)
        n_units = sum(len(d.removed) for d in decisions)
        logger.info("prune_groups: masked %d units in %d tensors", n_units, len(gone))
        return decisions


#: the selection and masking steps, for other ways of choosing units (prunekit.compact.reconstruct)
keep_count = _keep_count
write_masks = _write_masks
