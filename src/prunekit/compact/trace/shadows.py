"""Shadows: int64 label tensors that follow activations through the traced run.

A shadow has its activation's shape; each element holds the id of the channel the
activation's element belongs to (-1: none). Stored shadows are *canonical*: zero-copy
views with stride 0 exactly along the dims where their labels are constant, so every
rule reads "which dims vary" from strides and works on the small *core* (the shadow
narrowed to one position along each constant dim), never on activation-sized data.
"""

from __future__ import annotations

from typing import List, Sequence

import torch
from torch import Tensor

__all__ = ["canonical", "canonical_core", "core", "fixed", "is_fixed", "squeeze_constant", "varying_dims"]


def core(s: Tensor, keep: Sequence[int] = ()) -> Tensor:
    """Narrow a canonical shadow to one position along every constant (stride-0) dim.

    ``keep``: dims left whole. Exact for union purposes: a 1x64x112x112 layer-output
    shadow becomes 1x64x1x1 without reading any element.
    """
    for d in range(s.dim()):
        if s.shape[d] > 1 and s.stride(d) == 0 and d not in keep:
            s = s.narrow(d, 0, 1)
    return s


def canonical_core(s: Tensor) -> Tensor:
    """:func:`canonical`'s core: size 1 along every constant dim."""
    r = core(s)
    for d in range(r.dim()):
        if r.shape[d] > 1 and bool((r == r.narrow(d, 0, 1)).all()):
            r = r.narrow(d, 0, 1)
    return r


def canonical(s: Tensor) -> Tensor:
    """The same labels as a view whose stride is 0 along exactly the dims where they are constant.

    Every stored shadow is canonical, so "which dims vary" is read from strides and
    every later rule works on the small core. Only non-stride-0 dims are checked, on
    the already narrowed core.
    """
    r = canonical_core(s)
    return r.expand(s.shape) if r.shape != s.shape else s


def squeeze_constant(*shadows: Tensor) -> List[Tensor]:
    """Narrow (same-shape, canonical) shadows to one position along every dim where all are constant."""
    out = list(shadows)
    for d in range(out[0].dim()):
        if out[0].shape[d] > 1 and all(s.stride(d) == 0 for s in out):
            out = [s.narrow(d, 0, 1) for s in out]
    return out


def varying_dims(s: Tensor) -> List[int]:
    """Dimensions along which a canonical shadow's labels change."""
    return [d for d in range(s.dim()) if s.shape[d] > 1 and s.stride(d) != 0]


def is_fixed(s: Tensor) -> bool:
    """True for a shadow without any id (all -1); stored shadows always hold one."""
    if s.numel() == 0:
        return True
    return s.stride() == (0,) * s.dim() and int(s.reshape(-1)[0]) < 0


def fixed(shape: Sequence[int]) -> Tensor:
    """The shadow of a tensor without channel ids: -1 everywhere, as a zero-copy view."""
    return torch.full((), -1, dtype=torch.long).expand(tuple(shape))
