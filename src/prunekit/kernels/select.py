"""Exact k-smallest selection by magnitude, in linear time and little memory.

``torch.nn.utils.prune`` finds the entries to prune with ``torch.topk`` over
the whole tensor (and, for global pruning, over the concatenation of all
tensors): O(n log k) time and several full-size copies (values plus int64
indices). Here the k-th smallest magnitude is found with one radix step on
the IEEE-754 bit patterns instead:

1. the top 16 bits of every float, sign cleared, order like ``|x|`` (sign,
   exponent and the leading mantissa bits): a zero-copy ``int16`` view of the
   tensor gives them, one ``bitwise_and`` makes them a bucket number;
2. one histogram over those buckets (all tensors together) finds the bucket
   that holds the k-th smallest magnitude; everything below it is pruned,
   everything above it kept;
3. only that bucket's entries — a tiny fraction — are gathered and ranked
   exactly with ``kthvalue``.

Ties at the threshold are broken by position: the lowest flat index is
selected first (row-major order, tensor after tensor), so exactly ``k``
entries are selected whatever the data, and the same entries on every backend
and every run. Entries that
are not eligible (already pruned) go to a bucket above every real magnitude,
so they are never selected. NaN has no magnitude order: scores with NaN are
rejected with a ``ValueError``; ``inf`` ranks as the largest magnitude.
Scores of other real dtypes (integers) are ranked as float64.

:func:`select_lowest` is the same rule for signed values (``-inf`` first,
``+inf`` last): the ``k`` smallest values, ties at the threshold taken by
position. Channel norms, pattern units and layer budgets use it, so every
method breaks ties alike (``torch.topk``'s choice among equal values is
unspecified and differs between backends and sizes).
"""

from __future__ import annotations

import sys
from typing import Any, List, Optional, Sequence

from torch import Tensor

from .._backend import TORCH, Backend, backend_of

__all__ = ["NaNScoresError", "keep_mask_smallest", "keep_mask_smallest_multi", "select_lowest"]

_BUCKETS = 1 << 15
_SENTINEL = _BUCKETS - 1  # above every finite or infinite magnitude: ineligible entries go here


class NaNScoresError(ValueError):
    """Scores with NaN: no magnitude order exists. ``index`` says which input tensor."""

    def __init__(self, message: str, index: int = 0) -> None:
        super().__init__(message)
        self.index = index


def _float_dtypes(b: Backend) -> dict:
    # dtype -> top-16-bit pattern of +inf: buckets above it hold only NaN
    return {b.float32: 0x7F80, b.float64: 0x7FF0, b.float16: 0x7C00, b.bfloat16: 0x7F80}


def _common_dtype(scores: Sequence[Tensor], b: Backend) -> Any:
    dtypes = {s.dtype for s in scores}
    for d in dtypes:
        if d.is_complex or d == b.bool:
            raise TypeError(
                f"magnitude ranking needs real numbers, got a tensor of dtype {b.dtype_label(d)}; "
                "pass real-valued importance_scores (e.g. scores.abs() for complex values)"
            )
    floats = _float_dtypes(b)
    if len(dtypes) == 1 and next(iter(dtypes)) in floats:
        return next(iter(dtypes))
    narrow = (b.float32, b.float16, b.bfloat16)
    return b.float32 if all(d in narrow for d in dtypes) else b.float64


def _flat(score: Tensor, dtype: Any) -> Tensor:
    x = score.detach()
    if x.dtype != dtype:
        x = x.to(dtype)
    return x.contiguous().reshape(-1)


def _buckets(flat: Tensor, eligible: Optional[Tensor], b: Backend) -> Tensor:
    """int16 bucket of each entry: the top 16 IEEE bits of |x| (sentinel where not eligible)."""
    words = flat.view(b.int16)
    per = flat.element_size() // 2
    if per > 1:  # the int16 word that holds the sign and exponent
        words = words[per - 1::per] if sys.byteorder == "little" else words[0::per]
    h = words.bitwise_and(0x7FFF)
    if eligible is not None:
        h.masked_fill_(~eligible.reshape(-1).to(b.bool), _SENTINEL)
    return h


def keep_mask_smallest_multi(
    scores: Sequence[Tensor],
    k: int,
    eligible: Optional[Sequence[Optional[Tensor]]] = None,
) -> List[Tensor]:
    """Select exactly the ``k`` smallest-magnitude eligible entries across ``scores``.

    Returns one boolean tensor per input, shaped like it: ``False`` where the
    entry is selected (to prune), ``True`` elsewhere. ``eligible[i]`` (bool or
    0/1 tensor, or ``None`` for all) restricts which entries may be selected;
    ineligible entries come back ``True`` and the caller combines the result
    with its existing mask.

    Examples:
        >>> import torch
        >>> a, b = torch.tensor([0.1, -5.0]), torch.tensor([[2.0, -0.2], [0.3, 9.0]])
        >>> [m.tolist() for m in keep_mask_smallest_multi([a, b], k=3)]
        [[False, True], [[True, False], [False, True]]]
    """
    b = (backend_of(scores[0]) if scores else None) or TORCH
    xp = b.ns
    eligible = list(eligible) if eligible is not None else [None] * len(scores)
    n_ineligible = [0 if e is None else s.numel() - int((e != 0).sum()) for s, e in zip(scores, eligible)]
    n_eligible = sum(s.numel() for s in scores) - sum(n_ineligible)
    if not 0 <= k <= n_eligible:
        raise ValueError(f"cannot select k={k} entries out of {n_eligible}")
    if k == 0:
        return [xp.ones(tuple(s.shape), dtype=b.bool, device=s.device) for s in scores]
    dtype = _common_dtype(scores, b)
    inf_bucket = _float_dtypes(b)[dtype]

    # Pass 1: histogram of buckets. With one tensor its buckets are kept for
    # pass 2; with many they are recomputed, so the workspace stays one tensor's worth.
    cached: Optional[List[Tensor]] = [] if len(scores) == 1 else None
    hist = None
    for i, s in enumerate(scores):
        flat = _flat(s, dtype)
        h = _buckets(flat, eligible[i], b)
        counts = xp.bincount(h, minlength=_BUCKETS)
        _check_nan(counts, flat, h, inf_bucket, n_ineligible[i], i, b)
        hist = counts if hist is None else hist + counts
        if cached is not None:
            cached.append(h)
    if hist is None:  # unreachable: k > 0 entries are eligible, so there is a tensor
        raise ValueError("cannot select from an empty list of score tensors")
    cum = hist.cumsum(0)
    bucket = int(xp.searchsorted(cum, xp.tensor(k, dtype=cum.dtype)))
    below = int(cum[bucket - 1]) if bucket > 0 else 0

    # Pass 2: entries above the bucket are kept, below it pruned; the bucket's
    # own entries are gathered (positions and magnitudes) to be ranked exactly.
    keeps, positions, values = [], [], []
    for i, s in enumerate(scores):
        flat = _flat(s, dtype)
        h = cached[i] if cached is not None else _buckets(flat, eligible[i], b)
        keeps.append(h > bucket)
        pos = (h == bucket).nonzero().reshape(-1)
        positions.append(pos)
        values.append(flat[pos].abs())
    cand = xp.cat(values)
    threshold = b.kthvalue(cand, k - below)[0]
    need = k - below - int((cand < threshold).sum())  # tied entries to prune, in flat order
    for keep, pos, val in zip(keeps, positions, values):
        keep[pos[val > threshold]] = True
        tied = pos[val == threshold]
        if need < tied.numel():
            keep[tied[max(need, 0):]] = True
        need -= tied.numel()
    return [keep.view(tuple(s.shape)) for keep, s in zip(keeps, scores)]


def _check_nan(counts: Tensor, flat: Tensor, h: Tensor, inf_bucket: int, n_ineligible: int, index: int,
               b: Backend) -> None:
    # Buckets above +inf's hold only NaN (the sentinel bucket also holds the ineligible
    # entries); the bucket of +inf itself can hold NaN with a small payload, so look there.
    n_nan = int(counts[inf_bucket + 1:].sum()) - n_ineligible
    if int(counts[inf_bucket]):
        n_nan += int(b.ns.isnan(flat[h == inf_bucket]).sum())
    if n_nan:
        raise NaNScoresError(
            f"scores contain {n_nan} NaN value(s); NaN has no magnitude order, so no exact count can be "
            "pruned. Replace them first (e.g. torch.nan_to_num) or pass importance_scores without NaN",
            index,
        )


def keep_mask_smallest(scores: Tensor, k: int, eligible: Optional[Tensor] = None) -> Tensor:
    """Single-tensor form of :func:`keep_mask_smallest_multi`.

    Examples:
        >>> import torch
        >>> keep_mask_smallest(torch.tensor([3.0, -1.0, 0.5, 2.0]), k=2).tolist()
        [True, False, False, True]
    """
    return keep_mask_smallest_multi([scores], k, None if eligible is None else [eligible])[0]


def select_lowest(values: Tensor, k: int) -> Tensor:
    """Boolean tensor shaped like ``values``: ``True`` at its ``k`` smallest entries.

    Signed order (``-inf`` smallest, ``+inf`` largest, ``-0.0 == 0.0``); among
    entries equal to the ``k``-th smallest value the lowest flat positions are
    taken first, so exactly ``k`` entries are chosen, the same ones on every
    backend. Only the ``k``-th value is computed (``kthvalue``), never an index
    choice among ties. NaN raises :class:`NaNScoresError`.

    Examples:
        >>> import torch
        >>> select_lowest(torch.tensor([3.0, 1.0, 2.0, 1.0, 1.0]), k=2).tolist()
        [False, True, False, True, False]
        >>> select_lowest(torch.tensor([[0.0, float("-inf")], [-0.0, 5.0]]), k=2).tolist()
        [[True, True], [False, False]]
    """
    b = backend_of(values) or TORCH
    flat = values.detach().reshape(-1)
    n = flat.numel()
    if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= n:
        raise ValueError(f"cannot select k={k!r} entries out of {n}")
    if values.dtype == b.bool or values.dtype.is_complex:
        raise TypeError(f"select_lowest needs real numbers, got a tensor of dtype {b.dtype_label(values.dtype)}")
    chosen = b.ns.zeros((n,), dtype=b.bool, device=flat.device)
    if k == 0:
        return chosen.view(tuple(values.shape))
    if flat.is_floating_point():
        n_nan = int(b.ns.isnan(flat).sum())
        if n_nan:
            raise NaNScoresError(f"scores contain {n_nan} NaN value(s); NaN has no order, so no exact count "
                                 "can be selected. Replace them first (e.g. torch.nan_to_num)")
    threshold = b.kthvalue(flat, k)[0]
    below = flat < threshold
    need = k - int(below.sum())
    tied = flat == threshold
    rank = tied.to(b.int64).cumsum(0)  # 1, 2, ... along the tied entries, in flat order
    chosen = below | (tied & (rank <= need))
    return chosen.view(tuple(values.shape))
