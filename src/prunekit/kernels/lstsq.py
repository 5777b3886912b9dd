"""Least squares for removed inputs: refit a linear map's kept columns to what it computed before.

A layer ``y = A [x; 1]`` (``A = [W b]``) loses some input columns. With ``G = E[[x; 1][x; 1]^T]``
the second moment of its inputs, the kept columns ``K`` that best reproduce the old outputs are
``A' = A G[:, K] (G[K, K] + damp)^-1`` (ridge ``damp`` times the mean diagonal of ``G[K, K]``);
the relative output error of any ``A'`` is ``sqrt(tr((A - A') G (A - A')^T) / tr(A G A^T))``.
With another target ``t`` (the outputs another model computed on the same rows), the kept columns
fit it with the cross moment ``C = E[t [x; 1]^T]`` instead of ``A G``: :func:`fit_columns`, whose
error against ``t`` is :func:`target_error`.
Which columns to lose: :func:`obs_removal_order` (greedy structured Optimal Brain Surgeon).
"""

from __future__ import annotations

import math
from typing import List

import torch
from torch import Tensor

__all__ = ["fit_columns", "obs_removal_order", "output_error", "refit_columns", "target_error"]


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
    g64 = g.to(torch.float64)
    return fit_columns(g64, a.to(torch.float64) @ g64, kept, damp)


def fit_columns(g: Tensor, c: Tensor, kept: Tensor, damp: float = 0.01) -> Tensor:
    """The map on the columns ``kept`` (zeros elsewhere) that best gives the targets whose cross moment with
    the inputs is ``c`` (``E[t x^T]``, ``(out, n)``), the inputs' second moment being ``g``; float64.

    Examples:
        >>> import torch
        >>> torch.manual_seed(0); x = torch.randn(500, 3, dtype=torch.float64)
        <torch._C.Generator object at ...>
        >>> t = 2 * x[:, :1] - x[:, 1:2]             # a target only columns 0 and 1 explain
        >>> new = fit_columns(x.T @ x, t.T @ x, torch.tensor([0, 1]), damp=0.0)
        >>> [round(v, 6) for v in new[0].tolist()]
        [2.0, -1.0, 0.0]
    """
    g64, c64 = g.to(torch.float64), c.to(torch.float64)
    gk = g64.index_select(0, kept).index_select(1, kept)
    lam = damp * float(gk.diagonal().mean()) + 1e-12
    rhs = c64.index_select(1, kept).T
    sol = torch.linalg.solve(gk + lam * torch.eye(kept.numel(), dtype=torch.float64, device=gk.device), rhs).T
    out = torch.zeros(c64.shape, dtype=torch.float64, device=c64.device)
    out[:, kept] = sol
    return out


def target_error(a: Tensor, g: Tensor, c: Tensor, tt: float) -> float:
    """Relative error ``sqrt(E|t - A x|^2 / E|t|^2)`` of the map ``a`` against targets ``t``, from the moments
    ``g = E[x x^T]``, ``c = E[t x^T]`` and ``tt = E|t|^2``.

    Examples:
        >>> import torch
        >>> g, c = torch.eye(2, dtype=torch.float64), torch.eye(2, dtype=torch.float64)
        >>> target_error(torch.eye(2, dtype=torch.float64), g, c, 2.0), target_error(torch.zeros(2, 2), g, c, 2.0)
        (0.0, 1.0)
    """
    a64 = a.to(torch.float64)
    err = tt - 2 * float((a64 * c.to(torch.float64)).sum()) + float(torch.einsum("ij,jk,ik->", a64, g.to(torch.float64), a64))
    return math.sqrt(max(err, 0.0) / max(tt, 1e-30))


def obs_removal_order(a: Tensor, h: Tensor, units: Tensor, damp: float = 0.01) -> List[int]:
    """The order in which greedy structured OBS removes groups of a linear map's input columns.

    ``a`` is the map ``(out, n)``, ``h`` the second moment ``(n, n)`` of its inputs, ``units[j]`` the
    unit input column ``j`` belongs to (all units the same width; ``-1``: a column that always stays,
    such as the constant 1 of a bias). Each step removes the unit whose columns cost least to lose
    when the rest are refitted (``tr(A_S (H^-1)_SS^-1 A_S^T)``, the Optimal Brain Surgeon's error),
    then refits the rest and downdates ``H^-1`` (ZipLM's structured OBS). Returns every unit, the
    first removed first (the last one is the one that would stay alone).

    Examples:
        >>> import torch
        >>> torch.manual_seed(0); x = torch.randn(400, 3, dtype=torch.float64)
        <torch._C.Generator object at ...>
        >>> x[:, 2] = x[:, 0] + 0.01 * x[:, 2]        # column 2 is almost column 0
        >>> a = torch.tensor([[1.0, 1.0, 5.0]], dtype=torch.float64)
        >>> obs_removal_order(a, x.T @ x / 400, torch.tensor([0, 1, 2]))[0]  # 0 goes: column 2 carries it
        0
    """
    w = a.to(torch.float64).clone()
    n = h.shape[0]
    hd = h.to(torch.float64)
    hinv = torch.linalg.inv(hd + (damp * float(hd.diagonal().mean()) + 1e-12) * torch.eye(n, dtype=torch.float64,
                                                                                             device=hd.device))
    ids = sorted(set(units.tolist()) - {-1})
    cols = torch.stack([(units == u).nonzero().flatten() for u in ids])  # (U, width)
    alive = list(range(len(ids)))
    order: List[int] = []
    while len(alive) > 1:
        idx = cols[alive]  # (A, width)
        hs = hinv[idx[:, :, None], idx[:, None, :]]  # (A, width, width)
        ws = w[:, idx].permute(1, 0, 2)  # (A, out, width)
        inv = torch.linalg.inv(hs)
        cost = ((ws @ inv) * ws).sum(dim=(1, 2))
        pick = int(torch.argmin(cost))
        s, inv_s = idx[pick], inv[pick]
        rows = hinv.index_select(0, s)  # (width, n)
        w -= w[:, s] @ inv_s @ rows
        hinv -= rows.T @ inv_s @ rows
        w[:, s] = 0
        order.append(ids[alive.pop(pick)])
    order.extend(ids[u] for u in alive)
    return order
