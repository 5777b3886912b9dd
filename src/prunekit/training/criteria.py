"""Scoring criteria: how important each weight is (higher = keep).

Pure tensor math plus a small stateful wrapper per criterion.

=================  ==============================================================
``magnitude``      ``|w|`` (the absolute value -- never the signed weight)
``snip``           ``|w * dL/dw|`` from the latest gradient (Lee et al., 2019)
``snip_momentum``  ``score <- 0.9 * score + 1.0 * |w * dL/dw|``, accumulated at every
                   optimizer step, before the weights move
``gradient``       ``|dL/dw|`` from the latest gradient
=================  ==============================================================

The per-weight formulas are the importance registry's scorers
(:mod:`prunekit.importance`); a criterion adds the per-layer state a pruner
needs (the latest scores, SNIP-momentum's running sum). Any scorer registered
there that needs only the weight and/or gradients is a criterion too:
``get_criterion(name)`` wraps it.

``w`` is the *effective* weight (``weight_orig * weight_mask``); ``dL/dw`` the
gradient of the loss with respect to it, which for kept entries equals
``weight_orig.grad``. Pruned entries score 0.
"""

from __future__ import annotations

from typing import Dict, Optional, Type

from torch import Tensor

from ..importance import Scorer, get_scorer, gradient_score, magnitude_score, snip_score

__all__ = [
    "magnitude_score",
    "snip_score",
    "gradient_score",
    "momentum_update",
    "Criterion",
    "MagnitudeCriterion",
    "SnipCriterion",
    "SnipMomentumCriterion",
    "GradientCriterion",
    "ScorerCriterion",
    "CRITERIA",
    "get_criterion",
]


def momentum_update(previous: Optional[Tensor], new: Tensor, beta: float = 0.9, alpha: float = 1.0) -> Tensor:
    """``beta * previous + alpha * new`` (``alpha * new`` when there is no previous score), a new tensor.

    Examples:
        >>> import torch
        >>> from prunekit.training.criteria import momentum_update
        >>> momentum_update(torch.tensor([1.]), torch.tensor([2.]))
        tensor([2.9000])
    """
    if previous is None:
        return alpha * new
    # a new tensor: the previous score is left as it was, so a failed step can keep it
    return previous.mul(beta).add_(new, alpha=alpha)


class Criterion:
    """Keeps one score tensor per pruned layer.

    ``needs_grad`` criteria read gradients in :meth:`update` (called before the
    optimizer step); the others compute scores from the weights in
    :meth:`score`.
    """

    name = ""
    needs_grad = False

    def __init__(self) -> None:
        self.scores: Dict[str, Tensor] = {}

    def update(self, name: str, weight: Tensor, grad: Optional[Tensor]) -> None:
        """Record what this criterion needs from one step (no-op by default)."""

    def score(self, name: str, weight: Tensor) -> Optional[Tensor]:
        """The current score of layer ``name`` (``None`` when nothing was recorded yet)."""
        return self.scores.get(name)

    def has_scores(self, name: str) -> bool:
        return name in self.scores


class ScorerCriterion(Criterion):
    """A registry scorer as a training criterion.

    Scorers that need gradients are fed at :meth:`update` (the latest step's
    scores are kept); the others score the weights when asked. Scorers that need
    a calibration pass (activation statistics, a Hessian) cannot run during
    training and are refused.

    Examples:
        >>> import torch
        >>> from prunekit.importance import get_scorer
        >>> from prunekit.training.criteria import ScorerCriterion
        >>> c = ScorerCriterion(get_scorer("snip"))
        >>> c.needs_grad, c.score("fc", torch.ones(2)) is None
        (True, True)
        >>> c.update("fc", torch.tensor([2., -1.]), torch.tensor([1., 3.]))
        >>> c.score("fc", torch.ones(2))
        tensor([2., 3.])
    """

    def __init__(self, scorer: Scorer) -> None:
        super().__init__()
        if scorer.needs_calibration:
            raise ValueError(
                f"criterion {scorer.name!r} needs a calibration pass ({sorted(scorer.needs)}), which training does not "
                f"provide; use prunekit.oneshot(model, calibration, method={scorer.name!r}) or a weight/gradient "
                "criterion (magnitude, snip, snip_momentum, gradient)"
            )
        self.scorer = scorer
        self.name = scorer.name
        self.needs_grad = scorer.needs_gradient

    def update(self, name: str, weight: Tensor, grad: Optional[Tensor]) -> None:
        if self.needs_grad and grad is not None:
            self.scores[name] = self.scorer.score(weight, grad=grad)

    def score(self, name: str, weight: Tensor) -> Optional[Tensor]:
        if self.needs_grad:
            return self.scores.get(name)
        s = self.scorer.score(weight)
        self.scores[name] = s
        return s

    def has_scores(self, name: str) -> bool:
        return not self.needs_grad or name in self.scores


class MagnitudeCriterion(ScorerCriterion):
    """``|w|``, computed from the weights when asked (the registry's ``magnitude``)."""

    name = "magnitude"

    def __init__(self) -> None:
        super().__init__(get_scorer("magnitude"))


class SnipCriterion(ScorerCriterion):
    """``|w * dL/dw|`` from the most recent gradient (the registry's ``snip``)."""

    name = "snip"
    needs_grad = True

    def __init__(self) -> None:
        super().__init__(get_scorer("snip"))


class SnipMomentumCriterion(Criterion):
    """``score <- beta * score + alpha * |w * dL/dw|`` at every optimizer step (the registry's ``snip``, accumulated)."""

    name = "snip_momentum"
    needs_grad = True

    def __init__(self, beta: float = 0.9, alpha: float = 1.0) -> None:
        super().__init__()
        self.beta, self.alpha = beta, alpha
        self.scorer = get_scorer("snip")

    def update(self, name: str, weight: Tensor, grad: Optional[Tensor]) -> None:
        if grad is not None:
            self.scores[name] = momentum_update(self.scores.get(name), self.scorer.score(weight, grad=grad),
                                                self.beta, self.alpha)


class GradientCriterion(ScorerCriterion):
    """``|dL/dw|`` from the most recent gradient (the registry's ``gradient``)."""

    name = "gradient"
    needs_grad = True

    def __init__(self) -> None:
        super().__init__(get_scorer("gradient"))


CRITERIA: Dict[str, Type[Criterion]] = {
    c.name: c for c in (MagnitudeCriterion, SnipCriterion, SnipMomentumCriterion, GradientCriterion)
}


def get_criterion(name: str) -> Criterion:
    """A fresh criterion by name: one of :data:`CRITERIA`, or any scorer of the importance registry.

    Examples:
        >>> from prunekit.training.criteria import get_criterion
        >>> get_criterion("snip_momentum").needs_grad
        True
        >>> get_criterion("taylor").name         # the registry's alias of snip
        'snip'
    """
    if name in CRITERIA:
        return CRITERIA[name]()
    try:
        scorer = get_scorer(name)
    except ValueError:
        raise ValueError(
            f"criterion={name!r} is unknown; use one of {sorted(CRITERIA)} or a scorer registered with "
            "prunekit.importance.register_scorer"
        ) from None
    return ScorerCriterion(scorer)


