"""Proved constants: channels whose every element masks make hold one known value.

The one home of the concept. A fact reads "every element of channel c holds v"; it is
proved at a layer and then carried along the traced run:

* **at a layer** -- what a handler proves about its outputs, per index a float64 value
  or NaN (unknown): a ``Linear``/``Conv`` row whose weights are masked (or meet only
  known constant inputs) holds its bias (:func:`affine_row_values`), a normalization
  whose scale is masked holds its shift (:func:`scale_shift_values`); and how a reader
  folds a constant input into its bias (a :data:`Fold` rule);
* **along the run** -- a *const map* (:data:`ConstMap`) is what is known about one
  traced tensor: for some of its channel labels, the one value every element with that
  label holds (``(labels, values)``: sorted int64 labels and float64 values; a label
  absent from the map is unknown). Maps start where a handler proved values
  (:func:`from_slot`) and follow the run: labels moved by shape operations keep their
  value, element-wise operations compute it (:func:`apply_pointwise`), operations that
  mix positions keep only zeros (:func:`keep_zeros`: a weighted sum of zeros is zero)
  and anything else forgets it.

:mod:`prunekit.compact.proofs.dead` draws the conclusion: which units can go.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Tuple

import torch
from torch import Tensor, nn

from ..weights import is_masked, maybe

__all__ = [
    "ConstMap", "Fold", "affine_row_values", "any_masked", "apply_pointwise", "by_label", "from_slot", "keep_zeros",
    "lookup", "merge", "scale_shift_values",
]


# ----------------------------------------------------------------------------- at a layer
#: (weight path, input axis, output axis, bias path): ``bias[o] += sum(weight[o, j, ...] * c_j)``
Fold = Tuple[str, int, int, str]


def any_masked(m: nn.Module, *paths: str) -> bool:
    """Whether any of the tensors at ``paths`` (that exist) is masked."""
    out = False
    for p in paths:
        try:
            out = out or is_masked(m, p)
        except AttributeError:
            continue
    return out


def affine_row_values(
    m: nn.Module,
    weight: str,
    bias: Optional[str],
    in_values: Optional[Tensor],
    out_axis: int = 0,
    in_axis: int = 1,
    groups: int = 1,
    position_dependent: bool = False,
) -> Optional[Tensor]:
    """Per output row of ``y = W x + b`` (Linear, Conv, Conv1D): the constant the output
    holds, or NaN. A row is constant when every weight it has is zero or meets an input
    channel of known value (``in_values``, NaN: unknown). ``position_dependent``: zero
    padding would make a non-zero constant input vary across positions (a padded conv).

    Examples:
        >>> import torch, prunekit
        >>> lin = torch.nn.Linear(2, 3)
        >>> _ = torch.nn.init.constant_(lin.bias, 0.5)
        >>> _ = prunekit.custom_from_mask(lin, "weight", torch.tensor([[1.0, 1], [0, 0], [1, 1]]))
        >>> affine_row_values(lin, "weight", "bias", None)
        tensor([   nan, 0.5000,    nan], dtype=torch.float64)
    """
    if in_values is None and not any_masked(m, weight, *(p for p in (bias,) if p)):
        return None
    w = maybe(m, weight)
    b = maybe(m, bias) if bias else None
    if w is None:
        return None
    w = w.movedim(out_axis, 0).movedim(in_axis if in_axis > out_axis else in_axis + 1, 1)  # (out, in, ...)
    w = w.reshape(w.shape[0], w.shape[1], -1).to(torch.float64)
    n_out, n_in = w.shape[0], w.shape[1]
    if in_values is None:
        vin = torch.full((n_in * groups,), float("nan"), dtype=torch.float64)
    else:
        vin = in_values.to(torch.float64)
        if position_dependent:
            vin = torch.where(vin == 0, vin, torch.full_like(vin, float("nan")))
    per_out = vin.view(groups, n_in)[torch.arange(n_out) // (n_out // groups)]  # (out, in) inputs each row sees
    known = ~torch.isnan(per_out)
    touches = (w != 0).any(dim=2)
    ok = ~(touches & ~known).any(dim=1)
    acc = (w * torch.nan_to_num(per_out).unsqueeze(2)).sum(dim=(1, 2))
    if b is not None:
        acc = acc + b.to(torch.float64)
    return torch.where(ok, acc, torch.full_like(acc, float("nan")))


def scale_shift_values(
    weight: Optional[Tensor], bias: Optional[Tensor], in_values: Optional[Tensor], n: int,
    mean: Optional[Tensor] = None, var: Optional[Tensor] = None, eps: float = 0.0,
) -> Optional[Tensor]:
    """Per feature of a normalization ``(x - mean) / sqrt(var + eps) * weight + bias``: the
    constant output where the scale is zero (the shift), or -- when running statistics
    are given -- where the input is a known constant.
    """
    out = torch.full((n,), float("nan"), dtype=torch.float64)
    shift = bias.to(torch.float64) if bias is not None else torch.zeros(n, dtype=torch.float64)
    if weight is not None:
        zero = weight == 0
        out[zero] = shift[zero]
    if in_values is not None and mean is not None and var is not None:
        scale = weight.to(torch.float64) if weight is not None else torch.ones(n, dtype=torch.float64)
        y = (in_values.to(torch.float64) - mean.to(torch.float64)) / torch.sqrt(var.to(torch.float64) + eps) * scale + shift
        out = torch.where(torch.isnan(out), y, out)
    return out if bool((~torch.isnan(out)).any()) else None


# ----------------------------------------------------------------------------- along the traced run
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
