"""Scoring criteria: how important each weight is (higher = keep).

Pure tensor math plus a small stateful wrapper per criterion.

=================  ==============================================================
``magnitude``      ``|w|`` (the absolute value -- never the signed weight)
``snip``           ``|w * dL/dw|`` from the latest gradient (Lee et al., 2019)
``snip_momentum``  ``score <- 0.9 * score + 1.0 * |w * dL/dw|``, accumulated at every
                   optimizer step, before the weights move
``gradient``       ``|dL/dw|`` from the latest gradient
=================  ==============================================================

``w`` is the *effective* weight (``weight_orig * weight_mask``); ``dL/dw`` the
gradient of the loss with respect to it, which for kept entries equals
``weight_orig.grad``. Pruned entries score 0.
"""

from __future__ import annotations

from typing import Dict, Optional, Type


from torch import Tensor

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
    "CRITERIA",
    "get_criterion",
]


def magnitude_score(weight: Tensor) -> Tensor:
    """``|w|``.

    Example:
        >>> import torch
        >>> from prunekit.training.criteria import magnitude_score
        >>> magnitude_score(torch.tensor([-3., 1.]))
        tensor([3., 1.])
    """
    return weight.detach().abs().float()


def snip_score(weight: Tensor, grad: Tensor) -> Tensor:
    """``|w * dL/dw|``.

    Example:
        >>> import torch
        >>> from prunekit.training.criteria import snip_score
        >>> snip_score(torch.tensor([-3., 1.]), torch.tensor([1., -4.]))
        tensor([3., 4.])
    """
    return (weight.detach().float() * grad.detach().float()).abs()


def gradient_score(grad: Tensor) -> Tensor:
    """``|dL/dw|``.

    Example:
        >>> import torch
        >>> from prunekit.training.criteria import gradient_score
        >>> gradient_score(torch.tensor([-2., 0.5]))
        tensor([2.0000, 0.5000])
    """
    return grad.detach().abs().float()


def momentum_update(previous: Optional[Tensor], new: Tensor, beta: float = 0.9, alpha: float = 1.0) -> Tensor:
    """``beta * previous + alpha * new`` (``alpha * new`` when there is no previous score).

    Example:
        >>> import torch
        >>> from prunekit.training.criteria import momentum_update
        >>> momentum_update(torch.tensor([1.]), torch.tensor([2.]))
        tensor([2.9000])
    """
    if previous is None:
        return alpha * new
    return previous.mul_(beta).add_(new, alpha=alpha)


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


class MagnitudeCriterion(Criterion):
    """``|w|``, computed from the weights when asked."""

    name = "magnitude"

    def score(self, name: str, weight: Tensor) -> Tensor:
        s = magnitude_score(weight)
        self.scores[name] = s
        return s

    def has_scores(self, name: str) -> bool:
        return True


class SnipCriterion(Criterion):
    """``|w * dL/dw|`` from the most recent gradient."""

    name = "snip"
    needs_grad = True

    def update(self, name: str, weight: Tensor, grad: Optional[Tensor]) -> None:
        if grad is not None:
            self.scores[name] = snip_score(weight, grad)


class SnipMomentumCriterion(Criterion):
    """``score <- beta * score + alpha * |w * dL/dw|`` at every optimizer step."""

    name = "snip_momentum"
    needs_grad = True

    def __init__(self, beta: float = 0.9, alpha: float = 1.0) -> None:
        super().__init__()
        self.beta, self.alpha = beta, alpha

    def update(self, name: str, weight: Tensor, grad: Optional[Tensor]) -> None:
        if grad is not None:
            self.scores[name] = momentum_update(self.scores.get(name), snip_score(weight, grad), self.beta, self.alpha)


class GradientCriterion(Criterion):
    """``|dL/dw|`` from the most recent gradient."""

    name = "gradient"
    needs_grad = True

    def update(self, name: str, weight: Tensor, grad: Optional[Tensor]) -> None:
        if grad is not None:
            self.scores[name] = gradient_score(grad)


CRITERIA: Dict[str, Type[Criterion]] = {
    c.name: c for c in (MagnitudeCriterion, SnipCriterion, SnipMomentumCriterion, GradientCriterion)
}


def get_criterion(name: str) -> Criterion:
    """A fresh criterion by name.

    Example:
        >>> from prunekit.training.criteria import get_criterion
        >>> get_criterion("snip_momentum").needs_grad
        True
    """
    if name not in CRITERIA:
        raise ValueError(f"criterion={name!r} is unknown; use one of {sorted(CRITERIA)}")
    return CRITERIA[name]()


