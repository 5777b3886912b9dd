"""Group importance: one score per unit (channel, head), summed over every tensor the unit spans."""

from __future__ import annotations

from typing import Callable, Dict, Optional, Tuple, Union

import torch
from torch import Tensor

from . import _masks
from .graph import DependencyGraph, Group

__all__ = ["group_importance", "IMPORTANCES"]

IMPORTANCES = ("l1", "l2", "taylor", "random")


def _per_index(t: Tensor, axis: int, kind: str, grad: Optional[Tensor]) -> Tensor:
    if kind == "l1":
        v = t.abs()
    elif kind == "l2":
        v = t.float() ** 2
    else:  # taylor
        v = (t * grad).abs()
    return v.movedim(axis, 0).reshape(t.shape[axis], -1).sum(dim=1).float()


def _taylor_grad(owner: torch.nn.Module, leaf: str, mname: str, path: str) -> Tensor:
    grad = _masks.raw(owner, leaf).grad
    if grad is None:
        raise ValueError(
            f"importance='taylor' needs gradients: '{mname}.{path}' has no .grad; "
            "run loss.backward() on a batch before prune_groups"
        )
    return grad


def group_importance(
    graph: DependencyGraph,
    group: Group,
    importance: Union[str, Callable[[Tensor, int], Tensor]] = "l1",
    generator: Optional[torch.Generator] = None,
) -> Tensor:
    """Scores of ``group``'s units (higher = more important).

    ``"l1"``: sum of |w| over every weight the unit spans (producer rows, norm
    parameters, consumer columns); ``"l2"``: the square root of the sum of w^2;
    ``"taylor"``: sum of |w * dL/dw| (run ``loss.backward()`` first); ``"random"``;
    or a callable ``f(tensor, axis) -> per-index scores``.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from prunekit.compact import build_dependency_graph, group_importance
        >>> m = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
        >>> g = build_dependency_graph(m, torch.randn(1, 4))
        >>> group_importance(g, g.prunable_groups()[0], "l1").shape
        torch.Size([3])
    """
    n = len(group.units)
    if isinstance(importance, str) and importance not in IMPORTANCES:
        raise ValueError(f"importance must be one of {IMPORTANCES} or a callable, got {importance!r}")
    if importance == "random":
        return torch.rand(n, generator=generator)
    scores = torch.zeros(n)
    cache: Dict[Tuple[str, str, int], Tensor] = {}  # q/k/v slots share one tensor and axis
    for mname, e, idx, unit_of in graph.entries(group):
        key = (mname, e.path, e.axis)
        per = cache.get(key)
        if per is None:
            owner, leaf = _masks.owner_of(graph.module(mname), e.path)
            t = _masks.effective(owner, leaf)
            if callable(importance):
                per = importance(t, e.axis).float()
            else:
                grad = _taylor_grad(owner, leaf, mname, e.path) if importance == "taylor" else None
                per = _per_index(t, e.axis, importance, grad)
            cache[key] = per
        scores.index_add_(0, unit_of, per[idx])
    if importance == "l2":
        scores = scores.sqrt()
    return scores
