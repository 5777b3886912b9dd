"""Exact k-smallest selection by magnitude, in linear time and little memory.

``torch.nn.utils.prune`` finds the entries to prune with ``torch.topk`` over
the whole tensor (and, for global pruning, over the concatenation of all
tensors): O(n log k) time and several full-size copies (values plus int64
indices). Here the k-th smallest magnitude is found by a radix step on the
IEEE-754 bit patterns instead:

1. every score becomes an integer key, ``bits(x) & 0x7fff...`` — for IEEE
   floats the bit pattern of ``|x|`` orders exactly like ``|x|`` itself;
2. one histogram over the top 15 bits of all keys finds the bucket that holds
   the k-th smallest key;
3. only that bucket's entries (a tiny fraction) are gathered and ranked
   exactly with ``kthvalue``.

Ties at the threshold are broken by position (flat order, tensor after
tensor), so exactly ``k`` entries are selected whatever the data. Entries that
are not eligible (already pruned) are given a key above every real key, so
they are never selected. NaN has no magnitude order: scores with NaN are
rejected with a ``ValueError``; ``inf`` ranks as the largest magnitude.
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence

import torch
from torch import Tensor

from .._backend import TORCH, Backend, backend_of

__all__ = ["NaNScoresError", "keep_mask_smallest", "keep_mask_smallest_multi", "magnitude_keys"]


class NaNScoresError(ValueError):
    """Scores with NaN: no magnitude order exists. ``index`` says which input tensor."""

    def __init__(self, message: str, index: int = 0) -> None:
        super().__init__(message)
        self.index = index

_HIST_BITS = 15
_SMALL = 1 << 16  # below this many entries a plain kthvalue is cheaper than a histogram


def _key_space(dtypes: Sequence[Any], b: Backend = TORCH) -> Any:
    """float32 keys when every score fits float32 exactly, else float64 keys."""
    xp = b.ns
    narrow = (xp.float32, xp.float16, xp.bfloat16)
    return xp.float32 if all(d in narrow for d in dtypes) else xp.float64


def magnitude_keys(scores: Tensor, space: Any = None) -> Tensor:
    """Contiguous integer keys that order exactly like ``|scores|``.

    Example:
        >>> import torch
        >>> k = magnitude_keys(torch.tensor([-3.0, 0.5, 2.0]))
        >>> k.argsort().tolist()
        [1, 2, 0]
    """
    b = backend_of(scores) or TORCH
    if space is None:
        space = b.float32
    if scores.dtype.is_complex or scores.dtype == b.bool:
        raise TypeError(
            f"magnitude ranking needs real numbers, got a tensor of dtype {b.dtype_label(scores.dtype)}; "
            "pass real-valued importance_scores (e.g. scores.abs() for complex values)"
        )
    x = scores.detach()
    if x.dtype != space:
        x = x.to(space)
    x = x.contiguous()
    if space == b.float32:
        return x.view(b.int32).bitwise_and(0x7FFFFFFF)
    return x.view(b.int64).bitwise_and(0x7FFFFFFFFFFFFFFF)


def _finite_check(keys: Tensor, index: int, b: Backend) -> None:
    inf_key = 0x7F800000 if keys.dtype == b.int32 else 0x7FF0000000000000
    if keys.numel() and int(keys.max()) > inf_key:
        raise NaNScoresError(
            f"scores contain {int((keys > inf_key).sum())} NaN value(s); NaN has no magnitude order, "
            "so no exact count can be pruned. Replace them first (e.g. torch.nan_to_num) or pass "
            "importance_scores without NaN",
            index,
        )


def _shift(keys: Tensor, b: Backend) -> int:
    return (31 if keys.dtype == b.int32 else 63) - _HIST_BITS


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

    Example:
        >>> import torch
        >>> a, b = torch.tensor([0.1, -5.0]), torch.tensor([[2.0, -0.2], [0.3, 9.0]])
        >>> [m.tolist() for m in keep_mask_smallest_multi([a, b], k=3)]
        [[False, True], [[True, False], [False, True]]]
    """
    n_total = sum(s.numel() for s in scores)
    if not 0 <= k <= n_total:
        raise ValueError(f"cannot select k={k} entries out of {n_total}")
    b = (backend_of(scores[0]) if scores else None) or TORCH
    space = _key_space([s.dtype for s in scores], b)
    eligible = list(eligible) if eligible is not None else [None] * len(scores)

    def keys_of(i: int, check: bool = False) -> Tensor:
        key = magnitude_keys(scores[i], space).reshape(-1)
        if check:
            _finite_check(key, i, b)
        e = eligible[i]
        if e is not None:
            key.masked_fill_(~e.reshape(-1).to(b.bool), b.ns.iinfo(key.dtype).max)
        return key

    # With one tensor the keys are kept between passes; with many they are
    # recomputed per tensor so that the workspace stays one tensor's worth.
    cached: Optional[List[Tensor]] = [] if len(scores) == 1 else None
    for i in range(len(scores)):
        key = keys_of(i, check=True)
        if cached is not None:
            cached.append(key)
        del key

    def key_iter():
        for i in range(len(scores)):
            yield cached[i] if cached is not None else keys_of(i)

    if k == 0:
        return [b.ns.ones(tuple(s.shape), dtype=b.bool, device=s.device) for s in scores]

    threshold, n_tied_to_prune = _kth_key(key_iter, k, n_total, b)

    keep: List[Tensor] = []
    tie_budget = n_tied_to_prune
    for s, key in zip(scores, key_iter()):
        m = key > threshold
        if tie_budget is not None:
            ties = (key == threshold).nonzero().view(-1)
            # the first `tie_budget` tied entries (flat order) are pruned, the rest kept
            m[ties[tie_budget:]] = True
            tie_budget = max(0, tie_budget - ties.numel())
        keep.append(m.view(s.shape))
    return keep


def _kth_key(key_iter, k: int, n_total: int, b: Backend):
    """The k-th smallest key (1-based) and, if ties straddle it, how many tied keys to prune."""
    xp = b.ns
    if n_total <= _SMALL:
        allk = xp.cat(list(key_iter()))
        threshold = b.kthvalue(allk, k)[0]
        n_lt = int((allk < threshold).sum())
        n_eq = int((allk == threshold).sum())
    else:
        hist = None
        for key in key_iter():
            h = xp.bincount(key >> _shift(key, b), minlength=1 << (_HIST_BITS + 1))
            hist = h if hist is None else hist + h
        cum = hist.cumsum(0)
        bucket = int(xp.searchsorted(cum, xp.tensor(k, dtype=cum.dtype)))
        below = int(cum[bucket - 1]) if bucket > 0 else 0
        cands = xp.cat([key[(key >> _shift(key, b)) == bucket] for key in key_iter()])
        threshold = b.kthvalue(cands, k - below)[0]
        n_lt = below + int((cands < threshold).sum())
        n_eq = int((cands == threshold).sum())
    need = k - n_lt  # how many keys equal to the threshold must be pruned (1..n_eq)
    return threshold, (None if need == n_eq else need)


def keep_mask_smallest(scores: Tensor, k: int, eligible: Optional[Tensor] = None) -> Tensor:
    """Single-tensor form of :func:`keep_mask_smallest_multi`.

    Example:
        >>> import torch
        >>> keep_mask_smallest(torch.tensor([3.0, -1.0, 0.5, 2.0]), k=2).tolist()
        [True, False, False, True]
    """
    return keep_mask_smallest_multi([scores], k, None if eligible is None else [eligible])[0]
