"""What a handler can prove about its outputs' values, and how it absorbs constant inputs.

Used by mask propagation (:mod:`prunekit.compact.consts`): a layer whose output rows
are masked produces its bias there; a consumer that reads a channel holding a known
constant can fold it into its bias, after which the channel can go.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor, nn

from ..weights import is_masked, maybe

__all__ = ["Fold", "affine_row_values", "any_masked", "scale_shift_values"]

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
