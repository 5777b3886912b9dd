"""The scorer object: what a criterion needs and how it scores a tensor or a group.

Pure tensor math: a scorer receives tensors (a weight, its gradient, statistics
of the inputs it saw) and returns scores; it never sees a module. Higher means
more important (kept); every score is >= 0.

What a scorer needs is declared in :attr:`Scorer.needs`, a set of:

==============  ==================================================================
``weight``      the (effective) weight
``gradient``    ``dL/dweight`` from a backward pass
``activations`` per-input-feature statistics from a calibration pass
                (:class:`~prunekit.importance.ActivationStats`: squared norms)
``hessian``     the inputs' second moment ``X^T X`` from a calibration pass
                (:class:`~prunekit.importance.ActivationStats` with ``hessian=True``)
==============  ==================================================================

Three ways to score:

* :meth:`Scorer.score` -- one score per entry (unstructured and N:M pruning);
* :meth:`Scorer.unit_scores` -- one score per index along an axis (a channel,
  a row) of one tensor;
* :meth:`Scorer.unit_partial` + :meth:`Scorer.unit_finalize` -- a group of
  coupled tensors: the partials of every tensor the unit spans are added, then
  finalized once (``l2``: the square root of the summed squares).
"""

from __future__ import annotations

from typing import Any, Callable, ClassVar, FrozenSet, Optional

from torch import Tensor

__all__ = [
    "WEIGHT",
    "GRADIENT",
    "ACTIVATIONS",
    "HESSIAN",
    "NEEDS",
    "Scorer",
    "FunctionScorer",
    "reduce_per_index",
]

WEIGHT = "weight"
GRADIENT = "gradient"
ACTIVATIONS = "activations"
HESSIAN = "hessian"
#: everything a scorer may ask for
NEEDS: FrozenSet[str] = frozenset({WEIGHT, GRADIENT, ACTIVATIONS, HESSIAN})


def reduce_per_index(values: Tensor, axis: int) -> Tensor:
    """Sum ``values`` over every dimension but ``axis``: one float per index along ``axis``.

    Examples:
        >>> import torch
        >>> reduce_per_index(torch.tensor([[1., 2.], [3., 4.]]), axis=1)
        tensor([4., 6.])
    """
    return values.movedim(axis, 0).reshape(values.shape[axis], -1).sum(dim=1).float()


class Scorer:
    """Base class of every importance criterion (subclass it, or register a function).

    Subclasses set :attr:`name` and :attr:`needs` and implement :meth:`score`;
    the group methods default to summing the entry scores over a unit.

    Examples:
        >>> import torch
        >>> from prunekit.importance import get_scorer
        >>> s = get_scorer("magnitude")
        >>> s.name, sorted(s.needs), s.needs_calibration
        ('magnitude', ['weight'], False)
        >>> s.score(torch.tensor([-3., 1.]))
        tensor([3., 1.])
        >>> s.unit_scores(torch.tensor([[1., -2.], [3., 4.]]), axis=0)
        tensor([3., 7.])
    """

    #: registry name
    name: ClassVar[str] = ""
    #: what the caller must supply (see the module docstring)
    needs: ClassVar[FrozenSet[str]] = frozenset({WEIGHT})

    # ---------------------------------------------------------------- what it needs
    @property
    def needs_gradient(self) -> bool:
        """True when :meth:`score` reads ``grad``."""
        return GRADIENT in self.needs

    @property
    def needs_calibration(self) -> bool:
        """True when the scorer needs a calibration pass (activation statistics or a Hessian)."""
        return bool(self.needs & {ACTIVATIONS, HESSIAN})

    def check_inputs(self, weight: Tensor, grad: Optional[Tensor] = None, stats: Any = None, where: str = "") -> None:
        """Raise a ``ValueError`` that says what is missing, naming ``where`` (a module.tensor).

        Examples:
            >>> import torch
            >>> from prunekit.importance import get_scorer
            >>> get_scorer("snip").check_inputs(torch.ones(2), where="fc.weight")
            Traceback (most recent call last):
            ...
            ValueError: scorer 'snip' needs gradients: 'fc.weight' has none; run loss.backward() on a batch first
        """
        at = f"'{where}'" if where else "the tensor"
        if GRADIENT in self.needs and grad is None:
            raise ValueError(f"scorer {self.name!r} needs gradients: {at} has none; run loss.backward() on a batch first")
        if self.needs & {ACTIVATIONS, HESSIAN} and stats is None:
            raise ValueError(
                f"scorer {self.name!r} needs a calibration pass ({', '.join(sorted(self.needs & {ACTIVATIONS, HESSIAN}))}): "
                f"no activation statistics for {at}; use prunekit.oneshot(model, calibration, method={self.name!r})"
            )
        if HESSIAN in self.needs and not getattr(stats, "has_hessian", False):
            raise ValueError(
                f"scorer {self.name!r} needs the inputs' Hessian for {at}: collect ActivationStats(..., hessian=True)"
            )

    # ---------------------------------------------------------------- scoring
    def score(self, weight: Tensor, *, grad: Optional[Tensor] = None, stats: Any = None) -> Tensor:
        """One score per entry of ``weight`` (same shape, float, >= 0; higher = keep)."""
        raise NotImplementedError(f"{type(self).__name__}.score")

    def ranking_input(self, weight: Tensor, *, grad: Optional[Tensor] = None, stats: Any = None) -> Tensor:
        """A tensor whose magnitudes order the entries as :meth:`score` does.

        Selection kernels rank by magnitude, so the magnitude scorer hands back
        the weight itself (no copy); other scorers hand back their scores.
        """
        return self.score(weight, grad=grad, stats=stats)

    def unit_partial(self, weight: Tensor, axis: int, *, grad: Optional[Tensor] = None, stats: Any = None) -> Tensor:
        """Per-index contribution of one tensor to the score of the units along ``axis``.

        The partials of every tensor a unit spans are added before :meth:`unit_finalize`.
        Default: the entry scores summed over the other dimensions.
        """
        return reduce_per_index(self.score(weight, grad=grad, stats=stats), axis)

    def unit_finalize(self, total: Tensor) -> Tensor:
        """Turn summed partials into unit scores (identity by default; ``l2`` takes the square root)."""
        return total

    def unit_scores(self, weight: Tensor, axis: int, *, grad: Optional[Tensor] = None, stats: Any = None) -> Tensor:
        """One score per index of ``weight`` along ``axis`` (a channel, a row, a column)."""
        return self.unit_finalize(self.unit_partial(weight, axis, grad=grad, stats=stats))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, needs={sorted(self.needs)})"


class FunctionScorer(Scorer):
    """A scorer made from a plain function ``fn(weight, *, grad=None, stats=None) -> Tensor``.

    What :func:`~prunekit.importance.register_scorer` builds when it decorates a function.

    Examples:
        >>> import torch
        >>> from prunekit.importance import FunctionScorer
        >>> s = FunctionScorer("cube", lambda w, **_: w.abs() ** 3)
        >>> s.score(torch.tensor([-2., 1.]))
        tensor([8., 1.])
    """

    def __init__(self, name: str, fn: Callable[..., Tensor], needs: Optional[FrozenSet[str]] = None) -> None:
        self.name = name  # type: ignore[misc]  # an instance attribute shadows the class default
        self.needs = frozenset(needs) if needs is not None else frozenset({WEIGHT})  # type: ignore[misc]
        self.fn = fn

    def score(self, weight: Tensor, *, grad: Optional[Tensor] = None, stats: Any = None) -> Tensor:
        kwargs = {}
        if GRADIENT in self.needs:
            kwargs["grad"] = grad
        if self.needs_calibration:
            kwargs["stats"] = stats
        out = self.fn(weight, **kwargs)
        if tuple(out.shape) != tuple(weight.shape):
            raise ValueError(
                f"scorer {self.name!r} returned a tensor of shape {tuple(out.shape)} for a weight of shape "
                f"{tuple(weight.shape)}; a scorer returns one score per entry"
            )
        return out.float()


class UnitFunctionScorer(Scorer):
    """A group scorer from ``fn(tensor, axis) -> per-index scores`` (compaction's callable importance)."""

    def __init__(self, fn: Callable[[Tensor, int], Tensor], name: str = "") -> None:
        self.name = name or getattr(fn, "__name__", "custom")  # type: ignore[misc]
        self.fn = fn

    def score(self, weight: Tensor, *, grad: Optional[Tensor] = None, stats: Any = None) -> Tensor:
        raise ValueError(f"importance {self.name!r} scores whole units (fn(tensor, axis)), not single entries")

    def unit_partial(self, weight: Tensor, axis: int, *, grad: Optional[Tensor] = None, stats: Any = None) -> Tensor:
        return self.fn(weight, axis).float()
