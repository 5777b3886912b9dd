"""The one importance registry: every criterion prunekit ranks weights by.

A scorer (:class:`Scorer`) has a ``name``, declares what it ``needs`` (the
weight, gradients, activation statistics or a Hessian from a calibration
pass) and scores an entry, a unit of one tensor, or a group of coupled
tensors. The pruning methods, the training pruners, compaction's
``prune_groups`` and one-shot pruning all take their criteria from here, and
a criterion registered with :func:`register_scorer` is usable by all of them
(as far as they can supply what it needs). Pure tensor math: nothing here
knows about modules.

Examples:
    >>> import torch
    >>> import prunekit.importance as imp
    >>> @imp.register_scorer("l1_sq")
    ... def l1_sq(weight):
    ...     return weight.abs() ** 2
    >>> imp.get_scorer("l1_sq").unit_scores(torch.tensor([[1., 2.], [3., 0.]]), axis=0)
    tensor([5., 9.])
    >>> imp.unregister_scorer("l1_sq")
"""

from .activations import ActivationStats
from .registry import SCORERS, get_scorer, list_scorers, register_scorer, unregister_scorer
from .scorer import ACTIVATIONS, GRADIENT, HESSIAN, NEEDS, WEIGHT, FunctionScorer, Scorer, UnitFunctionScorer, reduce_per_index
from .scorers import (
    L2,
    OBS,
    Gradient,
    LnNorm,
    Magnitude,
    Snip,
    Wanda,
    dampened_hessian,
    gradient_score,
    magnitude_score,
    obs_score,
    snip_score,
    wanda_score,
)

__all__ = [
    "ACTIVATIONS",
    "GRADIENT",
    "HESSIAN",
    "NEEDS",
    "WEIGHT",
    "ActivationStats",
    "FunctionScorer",
    "Gradient",
    "L2",
    "LnNorm",
    "Magnitude",
    "OBS",
    "SCORERS",
    "Scorer",
    "Snip",
    "UnitFunctionScorer",
    "Wanda",
    "dampened_hessian",
    "get_scorer",
    "gradient_score",
    "list_scorers",
    "magnitude_score",
    "obs_score",
    "reduce_per_index",
    "register_scorer",
    "snip_score",
    "unregister_scorer",
    "wanda_score",
]
