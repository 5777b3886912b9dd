"""Least squares for removed inputs: refit a linear map's kept columns to what it computed before.

A layer ``y = A [x; 1]`` (``A = [W b]``) loses some input columns. With ``G = E[[x; 1][x; 1]^T]``
the second moment of its inputs, the kept columns ``K`` that best reproduce the old outputs are
``A' = A G[:, K] (G[K, K] + damp)^-1`` (ridge ``damp`` times the mean diagonal of ``G[K, K]``);
the relative output error of any ``A'`` is ``sqrt(tr((A - A') G (A - A')^T) / tr(A G A^T))``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["output_error", "refit_columns"]


def output_error(a: Tensor, new: Tensor, g: Tensor) -> float:
    """Relative output error of ``new`` against ``a`` on inputs whose second moment is ``g``.

    Examples:
        >>> import torch
        >>> a = torch.eye(2, dtype=torch.float64); g = torch.eye(2, dtype=torch.float64)
        >>> round(output_error(a, torch.zeros_like(a), g), 6)
        1.0
    """
    ref = float(torch.einsum("ij,jk,ik->", a, g, a))
    d = a - new
    return math.sqrt(max(float(torch.einsum("ij,jk,ik->", d, g, d)), 0.0) / max(ref, 1e-30))


def refit_columns(a: Tensor, g: Tensor, kept: Tensor, damp: float = 0.01) -> Tensor:
    """``a`` refitted on the columns ``kept`` only (zeros elsewhere), in float64.

    Examples:
        >>> import torch
        >>> torch.manual_seed(0); x = torch.randn(500, 3, dtype=torch.float64)
        <torch._C.Generator object at ...>
        >>> x[:, 2] = x[:, 0] + x[:, 1]              # column 2 is redundant
        >>> a = torch.tensor([[1.0, 2.0, 3.0]], dtype=torch.float64)
        >>> new = refit_columns(a, x.T @ x / 500, torch.tensor([0, 1]), damp=0.0)
        >>> [round(v, 6) for v in new[0].tolist()]
        [4.0, 5.0, 0.0]
    """
    a64, g64 = a.to(torch.float64), g.to(torch.float64)
    gk = g64.index_select(0, kept).index_select(1, kept)
    lam = damp * float(gk.diagonal().mean()) + 1e-12
    rhs = (a64 @ g64.index_select(1, kept)).T
    sol = torch.linalg.solve(gk + lam * torch.eye(kept.numel(), dtype=torch.float64, device=gk.device), rhs).T
    out = torch.zeros_like(a64)
    out[:, kept] = sol
    return out
