"""Sparsity patterns: which groups of weights are pruned together.

Pure mask math: tensors in, tensors out; nothing here knows about modules.

Weight layout
-------------
Every weight is seen as a 2-D matrix ``(out, in)``. A ``Linear`` weight already
is one. A convolution weight ``(out, in, *kernel)`` is laid out so that blocks
run along the *input channels*: it is viewed as ``(out, *kernel, in)`` and then
flattened to ``(out, prod(kernel) * in)``, so that the ``in`` consecutive
columns of one kernel position are the input channels at that position.

Patterns
--------
``"NxM"`` (e.g. ``"1x1"``, ``"4x1"``, ``"1x4"``)
    Blocks of ``N`` rows (output dimension) by ``M`` consecutive columns (input
    channels at one kernel position). A block is pruned whole or not at all.
    ``"1x1"`` is unstructured pruning. The layer must have ``out % N == 0`` and
    ``in % M == 0`` (``in`` = input channels for a convolution).
``"channelx1"``
    A whole *input* channel (for a convolution: every output and every kernel
    position of that input channel).
``"1xchannel"``
    A whole *output* channel (a row; for a convolution a whole filter).
``"N:M"`` (e.g. ``"2:4"``)
    At most ``N`` non-zeros in every ``M`` consecutive weights along the input
    dimension -- the convention of the literature (NVIDIA's 2:4) and of
    PyTorch's semi-structured sparse format. A fully pruned layer has sparsity
    ``(M - N) / M``. Intel Neural Compressor writes its ``N:M`` the other way
    round (``N`` counts the *pruned* weights of each ``M``); its ``"2:4"`` is
    the same thing as ours, its ``"1:4"`` is our ``"3:4"``, and our ``"1:4"``
    is its ``"3:4"``. The layer must have ``in % M == 0``.

A layer whose shape does not fit its pattern is reported (``Pattern.check``
returns the reason) and skipped by the pruners -- never silently mis-pruned.

Examples:
    >>> import torch
    >>> from prunekit.kernels.patterns import get_pattern
    >>> p = get_pattern("2:4")
    >>> w = torch.tensor([[4., -1., 3., 2., 1., 5., -6., 0.5]])
    >>> keep = p.mask_from_scores(w.abs(), amount=4)
    >>> keep
    tensor([[1., 0., 1., 0., 0., 1., 1., 0.]])
"""

from __future__ import annotations

import math
import re
from typing import Optional, Sequence

from torch import Tensor

from .._backend import TORCH, Backend, backend_of
from .select import select_lowest as _select_lowest

__all__ = [
    "Pattern",
    "NxMPattern",
    "ChannelPattern",
    "NInMPattern",
    "get_pattern",
    "to_2d",
    "from_2d",
    "select_lowest",
]

_NXM = re.compile(r"^\s*(\d+)\s*x\s*(\d+)\s*$")
_NINM = re.compile(r"^\s*(\d+)\s*:\s*(\d+)\s*$")


def to_2d(t: Tensor) -> Tensor:
    """View a weight as ``(out, prod(kernel) * in)`` with input channels innermost.

    Examples:
        >>> import torch
        >>> from prunekit.kernels.patterns import to_2d
        >>> to_2d(torch.zeros(8, 3, 5, 5)).shape
        torch.Size([8, 75])
    """
    if t.dim() == 0:
        return t.reshape(1, 1)
    if t.dim() == 1:
        return t.reshape(1, -1)
    if t.dim() == 2:
        return t
    perm = (0,) + tuple(range(2, t.dim())) + (1,)
    return t.permute(*perm).reshape(t.shape[0], -1)


def from_2d(m: Tensor, shape: Sequence[int]) -> Tensor:
    """Inverse of :func:`to_2d` for a tensor of the original ``shape``.

    Examples:
        >>> import torch
        >>> from prunekit.kernels.patterns import to_2d, from_2d
        >>> w = torch.randn(4, 3, 2, 2)
        >>> torch.equal(from_2d(to_2d(w), w.shape), w)
        True
    """
    shape = tuple(shape)
    if len(shape) <= 2:
        return m.reshape(shape)
    o, i, k = shape[0], shape[1], shape[2:]
    v = m.reshape((o,) + tuple(k) + (i,))
    perm = (0, len(shape) - 1) + tuple(range(1, len(shape) - 1))
    return v.permute(*perm).contiguous()


def _b(t: Tensor) -> Backend:
    return backend_of(t) or TORCH


def _in_channels(shape: Sequence[int]) -> int:
    if len(shape) <= 1:
        return int(shape[0]) if shape else 1
    return int(shape[1])


def _out_channels(shape: Sequence[int]) -> int:
    return int(shape[0]) if len(shape) >= 2 else 1


def select_lowest(scores: Tensor, k: int) -> Tensor:
    """Boolean mask of exactly ``k`` entries with the lowest ``scores`` (1-D).

    Entries scored ``+inf`` are never chosen; among equal scores the lowest
    positions are chosen first (:func:`prunekit.kernels.select.select_lowest`),
    so the count is always exactly ``k`` and the choice is the same on every backend.

    Examples:
        >>> import torch
        >>> from prunekit.kernels.patterns import select_lowest
        >>> select_lowest(torch.tensor([3., 1., 1., 2.]), 2)
        tensor([False,  True,  True, False])
    """
    b = _b(scores)
    out = b.ns.zeros(tuple(scores.shape), dtype=b.bool, device=scores.device)
    if k <= 0:
        return out
    finite = int(b.ns.isfinite(scores).sum()) + int((scores == float("-inf")).sum())
    if k > finite:
        raise ValueError(f"cannot select {k} entries: only {finite} are eligible")
    return _select_lowest(scores, k)


class Pattern:
    """A pruning unit: how a weight splits into units pruned all-or-nothing.

    Subclasses define :meth:`check`, :meth:`to_units` and :meth:`from_units`.
    ``group_size``/``max_pruned_per_group`` restrict how many units of each
    run of ``group_size`` consecutive units may be pruned (N:M); ``None``
    means no restriction.
    """

    name: str = ""
    group_size: Optional[int] = None
    max_pruned_per_group: Optional[int] = None
    #: sparsity every fitting layer must reach (N:M), or None if any is allowed
    fixed_sparsity: Optional[float] = None

    def check(self, shape: Sequence[int]) -> Optional[str]:
        """``None`` if a tensor of ``shape`` fits the pattern, else the reason it does not."""
        raise NotImplementedError

    def to_units(self, t: Tensor) -> Tensor:
        """``(n_units, unit_numel)`` view (a copy may be made) of ``t``."""
        raise NotImplementedError

    def from_units(self, units: Tensor, shape: Sequence[int]) -> Tensor:
        """Inverse of :meth:`to_units` for a ``(n_units, unit_numel)`` tensor."""
        raise NotImplementedError

    def n_units(self, shape: Sequence[int]) -> int:
        return math.prod(shape) // self.unit_numel(shape)

    def unit_numel(self, shape: Sequence[int]) -> int:
        raise NotImplementedError

    def unit_scores(self, scores: Tensor) -> Tensor:
        """Score of each unit: the mean of its entries' scores (1-D, ``n_units``)."""
        return _b(scores).row_mean(self.to_units(scores.float()))

    def expand(self, unit_keep: Tensor, shape: Sequence[int]) -> Tensor:
        """Element mask of ``shape`` from a 1-D per-unit keep mask."""
        n = self.unit_numel(shape)
        return self.from_units(unit_keep.reshape(-1, 1).expand(-1, n), shape)

    def eligible(self, unit_scores: Tensor) -> Tensor:
        """Units that may be pruned given group limits (all of them without groups).

        Within each group the ``max_pruned_per_group`` lowest-scored units are
        eligible, so choosing the lowest eligible units never breaks the limit.
        """
        b = _b(unit_scores)
        if self.group_size is None:
            return b.ns.ones_like(unit_scores, dtype=b.bool)
        g = unit_scores.reshape(-1, self.group_size)
        order = b.ns.argsort(g, dim=1, stable=True)
        rank = b.ns.empty_like(order)
        rank.scatter_(1, order, b.ns.arange(self.group_size, device=g.device).expand_as(order))
        return (rank < self.max_pruned_per_group).reshape(-1)

    def max_units(self, shape: Sequence[int]) -> int:
        """Most units a fitting tensor of ``shape`` can lose under the pattern."""
        n = self.n_units(shape)
        if self.group_size is None or self.max_pruned_per_group is None:
            return n
        return n // self.group_size * self.max_pruned_per_group

    def ranking(self, unit_scores: Tensor, already_pruned: Optional[Tensor] = None) -> Tensor:
        """Unit scores for :func:`select_lowest`: ``-inf`` at ``already_pruned`` units (chosen
        first, so a mask only loses ones), ``+inf`` where the group limits forbid pruning.

        Examples:
            >>> import torch
            >>> from prunekit.kernels.patterns import get_pattern
            >>> get_pattern("2:4").ranking(torch.tensor([1., 2., 3., 4.]), torch.tensor([False, False, False, True]))
            tensor([1., inf, inf, -inf])
        """
        b = _b(unit_scores)
        u = unit_scores
        if already_pruned is not None:
            u = b.ns.where(already_pruned, b.ns.full_like(u, float("-inf")), u)
        return b.ns.where(self.eligible(u), u, b.ns.full_like(u, float("inf")))

    def mask_from_scores(self, scores: Tensor, amount: int, pruned: Optional[Tensor] = None) -> Tensor:
        """Keep-mask (weight dtype of ``scores``) pruning ``amount`` lowest units.

        ``pruned`` (a boolean element mask) marks entries already pruned: they
        stay pruned and count toward ``amount``.

        Examples:
            >>> import torch
            >>> from prunekit.kernels.patterns import get_pattern
            >>> get_pattern("1x2").mask_from_scores(torch.tensor([[1., 2., 9., 9.]]), 1)
            tensor([[0., 0., 1., 1.]])
        """
        reason = self.check(scores.shape)
        if reason is not None:
            raise ValueError(f"pattern {self.name!r} does not fit a tensor of shape {tuple(scores.shape)}: {reason}")
        b = _b(scores)
        already = None if pruned is None else self.to_units(pruned.to(b.bool)).any(dim=1)
        keep = ~select_lowest(self.ranking(self.unit_scores(scores), already), int(amount))
        return self.expand(keep, scores.shape).to(scores.dtype)

    def unit_pruned(self, mask: Tensor) -> Tensor:
        """1-D boolean: units whose entries are all zero in the keep-``mask``."""
        return ~(self.to_units(mask != 0).any(dim=1))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


class NxMPattern(Pattern):
    """Blocks of ``N`` output rows by ``M`` consecutive input channels (``"4x1"``, ``"1x1"``)."""

    def __init__(self, n: int, m: int) -> None:
        if n < 1 or m < 1:
            raise ValueError(f"pattern '{n}x{m}': block sides must be >= 1, e.g. '4x1'")
        self.n, self.m = int(n), int(m)
        self.name = f"{self.n}x{self.m}"

    def check(self, shape: Sequence[int]) -> Optional[str]:
        o, i = _out_channels(shape), _in_channels(shape)
        if o % self.n:
            return f"{o} output channels are not a multiple of the block height {self.n}"
        if i % self.m:
            return f"{i} input channels are not a multiple of the block width {self.m}"
        return None

    def unit_numel(self, shape: Sequence[int]) -> int:
        return self.n * self.m

    def to_units(self, t: Tensor) -> Tensor:
        w = to_2d(t)
        o, c = w.shape
        return w.reshape(o // self.n, self.n, c // self.m, self.m).permute(0, 2, 1, 3).reshape(-1, self.n * self.m)

    def from_units(self, units: Tensor, shape: Sequence[int]) -> Tensor:
        o = _out_channels(shape)
        c = math.prod(shape) // o
        w = units.reshape(o // self.n, c // self.m, self.n, self.m).permute(0, 2, 1, 3).reshape(o, c)
        return from_2d(w, shape)


class ChannelPattern(Pattern):
    """Whole input channels (``"channelx1"``) or whole output channels (``"1xchannel"``)."""

    def __init__(self, axis: str) -> None:
        if axis not in ("in", "out"):
            raise ValueError(f"axis={axis!r}: use 'in' or 'out'")
        self.axis = axis
        self.name = "channelx1" if axis == "in" else "1xchannel"

    def check(self, shape: Sequence[int]) -> Optional[str]:
        if len(shape) < 2:
            return f"a {len(shape)}-D tensor has no input/output channels"
        return None

    def unit_numel(self, shape: Sequence[int]) -> int:
        n = _in_channels(shape) if self.axis == "in" else _out_channels(shape)
        return math.prod(shape) // n

    def to_units(self, t: Tensor) -> Tensor:
        if self.axis == "out":
            return t.reshape(t.shape[0], -1)
        return t.transpose(0, 1).reshape(t.shape[1], -1)

    def from_units(self, units: Tensor, shape: Sequence[int]) -> Tensor:
        shape = tuple(shape)
        if self.axis == "out":
            return units.reshape(shape)
        swapped = (shape[1], shape[0]) + shape[2:]
        return units.reshape(swapped).transpose(0, 1).contiguous()


class NInMPattern(Pattern):
    """At most ``N`` non-zeros in every ``M`` consecutive input weights (``"2:4"``)."""

    def __init__(self, n: int, m: int) -> None:
        if m < 1 or not 0 <= n < m:
            raise ValueError(
                f"pattern '{n}:{m}': need 0 <= N < M (N kept non-zeros out of every M), e.g. '2:4'"
            )
        self.n, self.m = int(n), int(m)
        self.name = f"{self.n}:{self.m}"
        self.group_size = self.m
        self.max_pruned_per_group = self.m - self.n
        self.fixed_sparsity = (self.m - self.n) / self.m

    def check(self, shape: Sequence[int]) -> Optional[str]:
        i = _in_channels(shape)
        if i % self.m:
            return f"{i} input channels are not a multiple of M={self.m}"
        return None

    def unit_numel(self, shape: Sequence[int]) -> int:
        return 1

    def to_units(self, t: Tensor) -> Tensor:
        return to_2d(t).reshape(-1, 1)

    def from_units(self, units: Tensor, shape: Sequence[int]) -> Tensor:
        o = _out_channels(shape)
        return from_2d(units.reshape(o, -1), shape)


def get_pattern(spec: str) -> Pattern:
    """Parse a pattern string: ``"NxM"``, ``"channelx1"``, ``"1xchannel"`` or ``"N:M"``.

    Examples:
        >>> from prunekit.kernels.patterns import get_pattern
        >>> get_pattern("4x1"), get_pattern("2:4"), get_pattern("1xchannel")
        (NxMPattern('4x1'), NInMPattern('2:4'), ChannelPattern('1xchannel'))
    """
    if isinstance(spec, Pattern):
        return spec
    if not isinstance(spec, str):
        raise TypeError(f"pattern={spec!r} ({type(spec).__name__}): write a string such as '4x1', '2:4' or '1x1'")
    s = spec.strip().lower()
    if s == "channelx1":
        return ChannelPattern("in")
    if s == "1xchannel":
        return ChannelPattern("out")
    m = _NXM.match(s)
    if m:
        return NxMPattern(int(m.group(1)), int(m.group(2)))
    m = _NINM.match(s)
    if m:
        return NInMPattern(int(m.group(1)), int(m.group(2)))
    raise ValueError(
        f"pattern={spec!r} is not a pattern; write 'NxM' blocks ('1x1' unstructured, '4x1', '1x4'), "
        "'channelx1' (input channels), '1xchannel' (output channels) or 'N:M' ('2:4' = at most 2 "
        "non-zeros in every 4)"
    )
