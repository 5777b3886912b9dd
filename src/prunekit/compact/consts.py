"""Channels whose value is provably a constant: the facts mask propagation works with.

A *const map* is what is known about one traced tensor: for some of its channel
labels, the one value every element with that label holds (``(labels, values)``:
sorted int64 labels and float64 values). A label absent from the map is unknown.
Maps start where masks make a value certain (a producer's masked rows give its
bias; a normalization with a masked scale gives its shift) and follow the run:
labels moved by shape operations keep their value, element-wise operations compute
it, operations that mix positions keep only zeros (a weighted sum of zeros is zero)
and anything else forgets it.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Tuple

import torch
from torch import Tensor

__all__ = ["ConstMap", "apply_pointwise", "by_label", "from_slot", "keep_zeros", "lookup", "merge"]

#: (labels sorted ascending, float64 values of the same length)
ConstMap = Tuple[Tensor, Tensor]

_NAN = float("nan")


def from_slot(ids: Tensor, values: Tensor) -> Optional[ConstMap]:
    """The map of a producer slot's ids with per-index ``values`` (NaN: unknown).

    Examples:
        >>> from_slot(torch.tensor([7, 8, 9]), torch.tensor([0.5, float("nan"), 0.0]))
        (tensor([7, 9]), tensor([0.5000, 0.0000], dtype=torch.float64))
    """
    values = values.detach().to(torch.float64).reshape(-1)
    known = ~torch.isnan(values)
    if not bool(known.any()):
        return None
    labels = ids.reshape(-1)[known]
    order = torch.argsort(labels)
    return labels[order], values[known][order]


def lookup(cm: Optional[ConstMap], labels: Tensor) -> Tensor:
    """The value of every label in ``labels`` (any shape; NaN where unknown or ``-1``).

    Examples:
        >>> lookup((torch.tensor([2, 5]), torch.tensor([1.0, 0.0], dtype=torch.float64)), torch.tensor([5, 3, -1, 2]))
        tensor([0., nan, nan, 1.], dtype=torch.float64)
    """
    out = torch.full(labels.shape, _NAN, dtype=torch.float64)
    if cm is None or cm[0].numel() == 0:
        return out
    keys, vals = cm
    pos = torch.searchsorted(keys, labels.clamp_min(0)).clamp_max(keys.numel() - 1)
    hit = (keys[pos] == labels) & (labels >= 0)
    out[hit] = vals[pos[hit]]
    return out


def merge(*maps: Optional[ConstMap]) -> Optional[ConstMap]:
    """One map from several (a label known in two with different values becomes unknown)."""
    maps_ = [m for m in maps if m is not None and m[0].numel()]
    if not maps_:
        return None
    if len(maps_) == 1:
        return maps_[0]
    labels = torch.cat([m[0] for m in maps_])
    vals = torch.cat([m[1] for m in maps_])
    return by_label(labels, vals)


def by_label(labels: Tensor, vals: Tensor) -> Optional[ConstMap]:
    """Labels with one known value (all their occurrences agree and none is NaN)."""
    keep = labels >= 0
    labels, vals = labels[keep], vals[keep]
    if labels.numel() == 0:
        return None
    uniq, inv = torch.unique(labels, return_inverse=True)
    lo = torch.full((uniq.numel(),), float("inf"), dtype=torch.float64).scatter_reduce(0, inv, vals, "amin")
    hi = torch.full((uniq.numel(),), -float("inf"), dtype=torch.float64).scatter_reduce(0, inv, vals, "amax")
    nan = torch.zeros(uniq.numel(), dtype=torch.bool).index_put_((inv,), torch.isnan(vals), accumulate=True)
    ok = (lo == hi) & ~nan
    if not bool(ok.any()):
        return None
    return uniq[ok], lo[ok]


def keep_zeros(cm: Optional[ConstMap]) -> Optional[ConstMap]:
    """Only the labels known to be zero (what survives sums over positions and attention)."""
    if cm is None:
        return None
    z = cm[1] == 0
    return (cm[0][z], cm[1][z]) if bool(z.any()) else None


def apply_pointwise(
    func: Callable[..., Any], args: tuple, kwargs: dict, slots: List[Tuple[str, Any]], values: List[Tensor]
) -> Optional[Tensor]:
    """``func`` evaluated on constants: each tensor argument at ``slots`` (("arg", i) or
    ("kw", name)) replaced by the matching 1-d float64 tensor of ``values``. None if it fails."""
    a, k = list(args), dict(kwargs)
    for (where, key), v in zip(slots, values):
        if where == "arg":
            a[key] = v
        else:
            k[key] = v
    try:
        with torch.no_grad():
            out = func(*a, **k)
    except Exception:
        return None
    if not isinstance(out, Tensor) or out.shape != values[0].shape:
        return None
    return out.to(torch.float64)
