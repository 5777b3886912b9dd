"""Per-channel norms for structured pruning, for every order torch documents.

``channel_norms(t, n, dim)`` returns one value per slice ``t.select(dim, c)``:

* a number ``p`` (``1``, ``2``, ``3``, ``0.5``, ``0``...): the vector p-norm of
  the flattened slice, ``(sum |x|^p)^(1/p)``; ``0`` counts non-zeros;
* ``inf`` / ``-inf``: the largest / smallest absolute value in the slice;
* ``'fro'``: the Frobenius norm, i.e. the 2-norm of the flattened slice, for
  slices of any rank (``torch.norm`` refuses it beyond two dims);
* ``'nuc'``: the nuclear norm (sum of singular values) of the slice viewed as a
  matrix ``(size of its first dim, product of the others)``. For a conv
  weight ``[out, in, kh, kw]`` with ``dim=0`` each output channel is the
  ``in x (kh*kw)`` matrix; for a 2-D weight each slice is a vector, a
  one-column matrix, whose nuclear norm is its 2-norm.

For 2-D and the other cases ``torch.norm`` accepts, the values equal
``torch.norm(t, p=n, dim=<all other dims>)``, so masks equal torch's.
"""

from __future__ import annotations

import math
import numbers
from typing import Union

from torch import Tensor

from .._backend import TORCH, backend_of

__all__ = ["NormOrder", "channel_norms", "validate_norm_order"]

NormOrder = Union[int, float, str]


def validate_norm_order(n: NormOrder) -> None:
    """Raise a ``ValueError``/``TypeError`` for an order that is not a real number, 'fro' or 'nuc'.

    Examples:
        >>> validate_norm_order("fro")
        >>> validate_norm_order("l2")
        Traceback (most recent call last):
        ...
        ValueError: n='l2' is not a norm order; use a number (1, 2, 3, ...), float('inf'), float('-inf'), 'fro' or 'nuc'
    """
    if isinstance(n, str):
        if n not in ("fro", "nuc"):
            raise ValueError(
                f"n={n!r} is not a norm order; use a number (1, 2, 3, ...), "
                "float('inf'), float('-inf'), 'fro' or 'nuc'"
            )
    elif not isinstance(n, numbers.Real) or isinstance(n, bool):
        raise TypeError(f"n={n!r} ({type(n).__name__}) is not a norm order; use a number, 'fro' or 'nuc'")
    elif math.isnan(float(n)):
        raise ValueError("n=nan is not a norm order; use a number, float('inf'), 'fro' or 'nuc'")


def channel_norms(t: Tensor, n: NormOrder, dim: int) -> Tensor:
    """Norm of each slice of ``t`` along ``dim`` (see the module docstring for each order).

    Examples:
        >>> import torch
        >>> w = torch.tensor([[3.0, 4.0], [1.0, 0.0]])
        >>> channel_norms(w, 2, dim=0).tolist()
        [5.0, 1.0]
        >>> channel_norms(w, float("-inf"), dim=0).tolist()
        [3.0, 0.0]
    """
    validate_norm_order(n)
    b = backend_of(t) or TORCH
    dim = dim % t.dim()
    x = t.detach()
    if not x.is_floating_point():
        x = x.to(b.ns.get_default_dtype())
    if n == "nuc":
        c = x.movedim(dim, 0)
        mat = c.reshape(c.shape[0], c.shape[1] if c.dim() > 1 else 1, -1)
        return b.matrix_nuclear_norm(mat)
    order = 2.0 if n == "fro" else float(n)
    other = [d for d in range(x.dim()) if d != dim]
    # torch: the same reduction torch.norm runs, so equal inputs give bit-equal norms;
    # TensorPlay: the backend's fast path for several dims
    return b.vector_norm(x, order, other)
