"""Group importance: one score per unit (channel, head), summed over every tensor the unit spans.

The criteria are the importance registry's scorers (:mod:`prunekit.importance`):
each tensor a unit spans adds its ``unit_partial``, and the sum is finalized
once (``l2``: the square root). Any registered scorer that needs only the
weights and/or gradients works here, a user's own included.
"""

from __future__ import annotations

from typing import Callable, Dict, Optional, Tuple, Union

import torch
from torch import Tensor

from ...importance import Scorer, UnitFunctionScorer, get_scorer, list_scorers
from ... import reparam
from ..trace.graph import DependencyGraph, Group

__all__ = ["group_importance", "IMPORTANCES", "as_group_scorer"]

#: the built-in choices (any registered scorer name is accepted too)
IMPORTANCES = ("l1", "l2", "taylor", "random")

Importance = Union[str, Scorer, Callable[[Tensor, int], Tensor]]


def as_group_scorer(importance: Importance) -> Optional[Scorer]:
    """The scorer for ``importance`` (``None`` for ``"random"``, which draws one number per unit).

    Examples:
        >>> from prunekit.compact.selection.importance import as_group_scorer
        >>> as_group_scorer("taylor").name
        'snip'
    """
    if isinstance(importance, str):
        if importance == "random":
            return None
        try:
            scorer = get_scorer(importance)
        except ValueError:
            raise ValueError(
                f"importance must be one of {IMPORTANCES} (or a scorer registered in prunekit.importance: "
                f"{', '.join(list_scorers())}) or a callable, got {importance!r}"
            ) from None
    elif isinstance(importance, Scorer):
        scorer = importance
    elif callable(importance):
        return UnitFunctionScorer(importance)
    else:
        raise TypeError(f"importance must be a name, a Scorer or a callable f(tensor, axis), got {importance!r}")
    if scorer.needs_calibration:
        raise ValueError(
            f"importance {scorer.name!r} needs a calibration pass ({', '.join(sorted(scorer.needs))}), which "
            "prune_groups does not run; use a weight or gradient criterion (l1, l2, taylor)"
        )
    return scorer


def _grad(owner: torch.nn.Module, leaf: str, mname: str, path: str, name: str) -> Tensor:
    t = reparam.stored(owner, leaf)
    grad = None if t is None else t.grad
    if grad is None:
        raise ValueError(
            f"importance={name!r} needs gradients: '{mname}.{path}' has no .grad; "
            "run loss.backward() on a batch before prune_groups"
        )
    return grad


def group_importance(
    graph: DependencyGraph,
    group: Group,
    importance: Importance = "l1",
    generator: Optional[torch.Generator] = None,
) -> Tensor:
    """Scores of ``group``'s units (higher = more important).

    ``"l1"``: sum of |w| over every weight the unit spans (producer rows, norm
    parameters, consumer columns); ``"l2"``: the square root of the sum of w^2;
    ``"taylor"``: sum of |w * dL/dw| (run ``loss.backward()`` first); ``"random"``;
    any other scorer of :mod:`prunekit.importance` by name or object; or a
    callable ``f(tensor, axis) -> per-index scores``.

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> from prunekit.compact import build_dependency_graph, group_importance
        >>> m = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
        >>> g = build_dependency_graph(m, torch.randn(1, 4))
        >>> group_importance(g, g.prunable_groups()[0], "l1").shape
        torch.Size([3])
    """
    n = group.n_units
    scorer = as_group_scorer(importance)
    if scorer is None:
        return torch.rand(n, generator=generator)
    label = importance if isinstance(importance, str) else scorer.name
    scores = torch.zeros(n)
    cache: Dict[Tuple[str, str, int], Tensor] = {}  # q/k/v slots share one tensor and axis
    for mname, e, idx, unit_of in graph.entries(group):
        key = (mname, e.path, e.axis)
        per = cache.get(key)
        if per is None:
            owner, leaf = reparam.owner_of(graph.module(mname), e.path)
            t = reparam.effective(owner, leaf)
            grad = _grad(owner, leaf, mname, e.path, label) if scorer.needs_gradient else None
            per = scorer.unit_partial(t, e.axis, grad=grad)
            cache[key] = per
        scores.index_add_(0, unit_of, per[idx])
    return scorer.unit_finalize(scores)
