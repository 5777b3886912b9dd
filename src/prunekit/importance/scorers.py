"""The built-in criteria, registered by name.

=============================  ===================  ==========================================================
name (aliases)                 needs                score (higher = keep)
=============================  ===================  ==========================================================
``magnitude`` (``l1``)         weight               ``|w|``; a unit: ``sum |w|``
``l2``                         weight               ``|w|``; a unit: ``sqrt(sum w^2)`` over every tensor it spans
``ln`` (``n=...``)             weight               ``|w|``; a unit of one tensor: its L``n`` norm, for every order
                                                    :func:`~prunekit.kernels.norms.channel_norms` knows
``snip`` (``taylor``)          weight, gradient     ``|w * dL/dw|`` (Lee et al. 2019; first-order Taylor)
``gradient``                   gradient             ``|dL/dw|``
``wanda``                      weight, activations  ``|w_ij| * ||X_j||_2`` (Sun et al. 2023), ranked per output row
``obs`` (``sparsegpt``)        weight, hessian      ``w_ij^2 / [H^-1]_jj`` with ``H = X^T X`` dampened
                                                    (Optimal Brain Surgeon's saliency, as SparseGPT selects)
=============================  ===================  ==========================================================

Examples:
    >>> import torch
    >>> from prunekit.importance import get_scorer, ActivationStats
    >>> w = torch.tensor([[1.0, -2.0], [0.5, 3.0]])
    >>> stats = ActivationStats(2); stats.add(torch.tensor([[4.0, 0.0], [0.0, 1.0]]))
    >>> get_scorer("wanda").score(w, stats=stats)
    tensor([[4., 2.],
            [2., 3.]])
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Optional

import torch
from torch import Tensor

from ..kernels.norms import NormOrder, channel_norms, validate_norm_order
from .registry import register_scorer
from .scorer import ACTIVATIONS, GRADIENT, HESSIAN, WEIGHT, Scorer, reduce_per_index

__all__ = [
    "Magnitude",
    "L2",
    "LnNorm",
    "Snip",
    "Gradient",
    "Wanda",
    "OBS",
    "magnitude_score",
    "snip_score",
    "gradient_score",
    "wanda_score",
    "dampened_hessian",
    "obs_score",
]


# ------------------------------------------------------------------ the pure functions
def magnitude_score(weight: Tensor) -> Tensor:
    """``|w|`` (float).

    Examples:
        >>> import torch
        >>> from prunekit.importance import magnitude_score
        >>> magnitude_score(torch.tensor([-3., 1.]))
        tensor([3., 1.])
    """
    return weight.detach().abs().float()


def snip_score(weight: Tensor, grad: Tensor) -> Tensor:
    """``|w * dL/dw|`` (float).

    Examples:
        >>> import torch
        >>> from prunekit.importance import snip_score
        >>> snip_score(torch.tensor([-3., 1.]), torch.tensor([1., -4.]))
        tensor([3., 4.])
    """
    return (weight.detach().float() * grad.detach().float()).abs()


def gradient_score(grad: Tensor) -> Tensor:
    """``|dL/dw|`` (float).

    Examples:
        >>> import torch
        >>> from prunekit.importance import gradient_score
        >>> gradient_score(torch.tensor([-2., 0.5]))
        tensor([2.0000, 0.5000])
    """
    return grad.detach().abs().float()


def _check_2d(weight: Tensor, features: int, name: str) -> None:
    if weight.dim() != 2:
        raise ValueError(
            f"scorer {name!r} scores 2-D weights (out_features, in_features) of linear layers; got a weight of "
            f"shape {tuple(weight.shape)}. Use 'magnitude' for other layers"
        )
    if weight.shape[1] != features:
        raise ValueError(
            f"scorer {name!r}: the weight has {weight.shape[1]} input features but the activation statistics "
            f"have {features}; gather them on this layer's inputs"
        )


def wanda_score(weight: Tensor, input_norm: Tensor) -> Tensor:
    """``|w_ij| * ||X_j||_2``: Wanda's score of a ``(out, in)`` weight given each input feature's norm.

    Examples:
        >>> import torch
        >>> from prunekit.importance import wanda_score
        >>> wanda_score(torch.tensor([[1., -2.]]), torch.tensor([3., 0.5]))
        tensor([[3., 1.]])
    """
    return weight.detach().float().abs() * input_norm.to(weight.device).float().unsqueeze(0)


def dampened_hessian(xtx: Tensor, damp: float = 0.01) -> Tensor:
    """``H + damp * mean(diag(H)) * I`` in float32, with dead inputs (``H_jj == 0``) given ``H_jj = 1``.

    SparseGPT's conditioning of the inputs' second moment before its Cholesky
    factorisation. A zero diagonal means the input feature was always zero:
    its weights never matter, and a unit diagonal keeps the matrix invertible.

    Examples:
        >>> import torch
        >>> from prunekit.importance import dampened_hessian
        >>> dampened_hessian(torch.tensor([[2., 0.], [0., 0.]]), damp=0.5).tolist()
        [[2.75, 0.0], [0.0, 1.75]]
    """
    if not (isinstance(damp, numbers.Real) and damp >= 0):
        raise ValueError(f"damp must be a number >= 0 (a fraction of the mean diagonal), got {damp!r}")
    h = xtx.detach().float().clone()
    diag = h.diagonal()
    dead = diag == 0
    diag[dead] = 1.0
    diag += float(damp) * diag.mean()
    return h


def obs_score(weight: Tensor, xtx: Tensor, damp: float = 0.01) -> Tensor:
    """``w_ij^2 / [H^-1]_jj``: Optimal Brain Surgeon's saliency, ``H`` from :func:`dampened_hessian`.

    The loss of removing ``w_ij`` alone with the row's other weights re-fitted
    (up to a factor 1/2). Inputs that were always zero score 0 (their weights
    have no effect).

    Examples:
        >>> import torch
        >>> from prunekit.importance import obs_score
        >>> obs_score(torch.tensor([[1., 1.]]), torch.tensor([[4., 0.], [0., 1.]]), damp=0.0)
        tensor([[4., 1.]])
    """
    w = weight.detach().float()
    h = dampened_hessian(xtx.to(w.device), damp)
    dead = xtx.diagonal().to(w.device) == 0
    hinv = torch.cholesky_inverse(torch.linalg.cholesky(h))
    s = w.pow(2) / hinv.diagonal().unsqueeze(0)
    s[:, dead] = 0.0
    return s


# ------------------------------------------------------------------ the registered scorers
@register_scorer("magnitude", aliases=("l1",))
class Magnitude(Scorer):
    """``|w|``; a unit scores ``sum |w|`` over every entry it spans (the L1 norm)."""

    name = "magnitude"
    needs = frozenset({WEIGHT})

    def score(self, weight: Tensor, *, grad: Optional[Tensor] = None, stats: Any = None) -> Tensor:
        return magnitude_score(weight)

    def ranking_input(self, weight: Tensor, *, grad: Optional[Tensor] = None, stats: Any = None) -> Tensor:
        return weight  # the selection kernels rank by magnitude already: no copy

    def unit_partial(self, weight: Tensor, axis: int, *, grad: Optional[Tensor] = None, stats: Any = None) -> Tensor:
        return reduce_per_index(weight.detach().abs(), axis)


@register_scorer("l2")
class L2(Scorer):
    """``|w|``; a unit scores ``sqrt(sum w^2)`` over every entry it spans, across tensors."""

    name = "l2"
    needs = frozenset({WEIGHT})

    def score(self, weight: Tensor, *, grad: Optional[Tensor] = None, stats: Any = None) -> Tensor:
        return magnitude_score(weight)

    def ranking_input(self, weight: Tensor, *, grad: Optional[Tensor] = None, stats: Any = None) -> Tensor:
        return weight

    def unit_partial(self, weight: Tensor, axis: int, *, grad: Optional[Tensor] = None, stats: Any = None) -> Tensor:
        return reduce_per_index(weight.detach().float() ** 2, axis)

    def unit_finalize(self, total: Tensor) -> Tensor:
        return total.sqrt()


@register_scorer("ln")
class LnNorm(Scorer):
    """The L``n`` norm of each unit, for every order of :func:`~prunekit.kernels.norms.channel_norms`.

    For one tensor (``unit_scores``) the norms are the kernel's, bit-equal to
    ``torch.norm`` where torch accepts the order. Across a group of tensors
    only orders that add up (``p > 0`` finite, ``'fro'``) are defined.
    """

    name = "ln"
    needs = frozenset({WEIGHT})

    def __init__(self, n: NormOrder = 2) -> None:
        validate_norm_order(n)
        self.n = n

    def score(self, weight: Tensor, *, grad: Optional[Tensor] = None, stats: Any = None) -> Tensor:
        if not isinstance(self.n, str) and float(self.n) == 0:
            return (weight.detach() != 0).float()
        return magnitude_score(weight)

    def ranking_input(self, weight: Tensor, *, grad: Optional[Tensor] = None, stats: Any = None) -> Tensor:
        return weight if isinstance(self.n, str) or float(self.n) != 0 else self.score(weight)

    def unit_scores(self, weight: Tensor, axis: int, *, grad: Optional[Tensor] = None, stats: Any = None) -> Tensor:
        return channel_norms(weight, self.n, axis)

    def _p(self) -> float:
        p = 2.0 if self.n == "fro" else (float(self.n) if not isinstance(self.n, str) else math.nan)
        if not (0 < p < math.inf):
            raise ValueError(
                f"ln scorer with n={self.n!r} cannot add up over a group of tensors; use a finite p > 0 or 'fro' "
                "(or score one tensor with unit_scores)"
            )
        return p

    def unit_partial(self, weight: Tensor, axis: int, *, grad: Optional[Tensor] = None, stats: Any = None) -> Tensor:
        return reduce_per_index(weight.detach().float().abs() ** self._p(), axis)

    def unit_finalize(self, total: Tensor) -> Tensor:
        return total ** (1.0 / self._p())

    def __repr__(self) -> str:
        return f"LnNorm(n={self.n!r})"


@register_scorer("snip", aliases=("taylor",))
class Snip(Scorer):
    """``|w * dL/dw|`` (SNIP; compaction's first-order Taylor importance)."""

    name = "snip"
    needs = frozenset({WEIGHT, GRADIENT})

    def score(self, weight: Tensor, *, grad: Optional[Tensor] = None, stats: Any = None) -> Tensor:
        self.check_inputs(weight, grad, stats)
        return snip_score(weight, grad)  # type: ignore[arg-type]

    def unit_partial(self, weight: Tensor, axis: int, *, grad: Optional[Tensor] = None, stats: Any = None) -> Tensor:
        self.check_inputs(weight, grad, stats)
        return reduce_per_index((weight.detach() * grad.detach()).abs(), axis)  # type: ignore[union-attr]


@register_scorer("gradient")
class Gradient(Scorer):
    """``|dL/dw|``."""

    name = "gradient"
    needs = frozenset({GRADIENT})

    def score(self, weight: Tensor, *, grad: Optional[Tensor] = None, stats: Any = None) -> Tensor:
        self.check_inputs(weight, grad, stats)
        return gradient_score(grad)  # type: ignore[arg-type]


@register_scorer("wanda")
class Wanda(Scorer):
    """``|w_ij| * ||X_j||_2`` (Sun et al. 2023); compare within each output row (``comparison_group = "row"``)."""

    name = "wanda"
    needs = frozenset({WEIGHT, ACTIVATIONS})
    #: Wanda prunes the same fraction of every output row
    comparison_group = "row"

    def score(self, weight: Tensor, *, grad: Optional[Tensor] = None, stats: Any = None) -> Tensor:
        self.check_inputs(weight, grad, stats)
        _check_2d(weight, stats.features, self.name)
        return wanda_score(weight, stats.norm)


@register_scorer("obs", aliases=("sparsegpt",))
class OBS(Scorer):
    """``w_ij^2 / [H^-1]_jj`` with SparseGPT's dampening (``damp`` x the mean diagonal).

    This is the saliency SparseGPT uses to choose its masks; the full method
    (masks chosen column block by column block while the remaining weights are
    updated) is :func:`prunekit.oneshot.sparsegpt_prune`.
    """

    name = "obs"
    needs = frozenset({WEIGHT, HESSIAN})
    comparison_group = "row"

    def __init__(self, damp: float = 0.01) -> None:
        dampened_hessian(torch.zeros(1, 1), damp)  # validates damp
        self.damp = float(damp)

    def score(self, weight: Tensor, *, grad: Optional[Tensor] = None, stats: Any = None) -> Tensor:
        self.check_inputs(weight, grad, stats)
        _check_2d(weight, stats.features, self.name)
        return obs_score(weight, stats.xtx, self.damp)
