"""Layer solvers: a weight and its inputs' statistics in, a pruned weight and its mask out.

Pure tensor math on one ``(out_features, in_features)`` matrix -- nothing here
knows about modules -- so each solver is checked against a slow reference on
small matrices (``tests/test_oneshot_solvers.py``).

* :func:`magnitude_prune`: the smallest ``|w|`` of the whole matrix (unstructured)
  or of every group of ``m`` (N:M).
* :func:`wanda_prune`: Wanda (Sun et al. 2023): ``|w_ij| * ||X_j||_2`` compared
  within each output row (unstructured) or group of ``m`` (N:M); weights unchanged.
* :func:`sparsegpt_prune`: SparseGPT (Frantar & Alistarh 2023): columns are
  processed left to right in blocks; at the start of each block the mask of
  the block is chosen by the OBS saliency ``w^2 / [H^-1]_jj`` (given the
  columns not yet fixed), and every pruned weight's error is compensated on the
  not-yet-processed columns with the rows of the Cholesky factor of ``H^-1``
  (lazy blocked updates: within a block, then once for the rest).
* :func:`refit_masked`: with the mask fixed, the least-squares weights
  ``min ||X (W - T)^T||^2`` over the kept entries (``T`` the target weights),
  by preconditioned conjugate gradients, every row at once.

Patterns: ``nm=None`` is unstructured at ``sparsity``; ``nm=(n, m)`` keeps at
most ``n`` of every ``m`` consecutive input weights (PyTorch's and NVIDIA's
2:4 convention). Masks are boolean, ``True`` = kept.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
from torch import Tensor

from ..importance import dampened_hessian
from ..kernels.select import keep_mask_smallest

__all__ = [
    "prune_count",
    "nm_keep_mask",
    "row_keep_mask",
    "magnitude_prune",
    "wanda_prune",
    "sparsegpt_prune",
    "refit_masked",
    "hessian_inverse_cholesky",
    "reconstruction_error",
]

NM = Optional[Tuple[int, int]]


def prune_count(numel: int, sparsity: float) -> int:
    """How many of ``numel`` entries ``sparsity`` prunes (round half to even, as torch's amounts).

    Examples:
        >>> prune_count(10, 0.25)
        2
    """
    return int(round(float(sparsity) * numel))


def _check(weight: Tensor, sparsity: float, nm: NM) -> None:
    if weight.dim() != 2:
        raise ValueError(f"a layer solver prunes 2-D weights (out, in), got shape {tuple(weight.shape)}")
    if nm is None:
        if not 0.0 <= float(sparsity) < 1.0:
            raise ValueError(f"sparsity must be in [0, 1), got {sparsity}")
    else:
        n, m = nm
        if weight.shape[1] % m:
            raise ValueError(f"N:M {n}:{m} needs in_features divisible by {m}, got {weight.shape[1]}")


def nm_keep_mask(scores: Tensor, n: int, m: int) -> Tensor:
    """Keep the ``n`` highest scores of every ``m`` consecutive entries of each row (ties: the earlier one).

    Examples:
        >>> import torch
        >>> nm_keep_mask(torch.tensor([[4., 1., 3., 2., 1., 5., 6., 0.]]), 2, 4).int()
        tensor([[1, 0, 1, 0, 0, 1, 1, 0]], dtype=torch.int32)
    """
    rows, cols = scores.shape
    g = scores.reshape(rows, cols // m, m)
    # stable descending order: equal scores keep the earlier entry
    idx = torch.sort(g, dim=-1, descending=True, stable=True).indices[..., :n]
    keep = torch.zeros_like(g, dtype=torch.bool)
    keep.scatter_(-1, idx, True)
    return keep.reshape(rows, cols)


def row_keep_mask(scores: Tensor, sparsity: float) -> Tensor:
    """Prune the ``round(sparsity * in)`` lowest scores of every row (ties: the earlier one goes).

    Examples:
        >>> import torch
        >>> row_keep_mask(torch.tensor([[3., 1., 2., 0.]]), 0.5).int()
        tensor([[1, 0, 1, 0]], dtype=torch.int32)
    """
    rows, cols = scores.shape
    k = prune_count(cols, sparsity)
    keep = torch.ones_like(scores, dtype=torch.bool)
    if k:
        idx = torch.sort(scores, dim=1, stable=True).indices[:, :k]
        keep.scatter_(1, idx, False)
    return keep


def _matrix_keep_mask(scores: Tensor, k: int) -> Tensor:
    # exact k smallest (ties by position) in linear time: the kernels' selection
    return keep_mask_smallest(scores, k)


def magnitude_prune(weight: Tensor, sparsity: float = 0.5, nm: NM = None) -> Tensor:
    """Keep-mask of magnitude pruning: the whole matrix's smallest ``|w|``, or per group of ``m``.

    Examples:
        >>> import torch
        >>> magnitude_prune(torch.tensor([[1., -4.], [3., 2.]]), 0.5).int()
        tensor([[0, 1],
                [1, 0]], dtype=torch.int32)
    """
    _check(weight, sparsity, nm)
    s = weight.detach().abs().float()
    if nm is not None:
        return nm_keep_mask(s, *nm)
    return _matrix_keep_mask(s, prune_count(s.numel(), sparsity))


def wanda_prune(weight: Tensor, input_norm: Tensor, sparsity: float = 0.5, nm: NM = None) -> Tensor:
    """Wanda's keep-mask: ``|w_ij| * ||X_j||_2`` compared per output row (or per group of ``m``).

    Examples:
        >>> import torch
        >>> wanda_prune(torch.tensor([[1., -2.], [3., 1.]]), torch.tensor([4., 1.]), 0.5).int()
        tensor([[1, 0],
                [1, 0]], dtype=torch.int32)
    """
    _check(weight, sparsity, nm)
    s = weight.detach().float().abs() * input_norm.to(weight.device).float().unsqueeze(0)
    if nm is not None:
        return nm_keep_mask(s, *nm)
    return row_keep_mask(s, sparsity)


def hessian_inverse_cholesky(xtx: Tensor, damp: float = 0.01) -> Tensor:
    """Upper Cholesky factor ``U`` of ``H^-1`` (``H`` dampened): ``U^T U = H^-1``.

    Row ``i`` of ``U`` divided by ``U_ii`` is the OBS update direction for
    removing weight ``i`` when only columns ``i..`` are free, and ``U_ii^2`` is
    ``[H_F^-1]_ii`` of that sub-problem.

    Examples:
        >>> import torch
        >>> u = hessian_inverse_cholesky(torch.tensor([[4., 0.], [0., 1.]]), damp=0.0)
        >>> torch.allclose(u, torch.tensor([[0.5, 0.0], [0.0, 1.0]]))
        True
    """
    # each intermediate freed as soon as the next exists: two in_features^2 matrices at a time, not four
    h = dampened_hessian(xtx, damp)
    lower = torch.linalg.cholesky(h)
    del h
    hinv = torch.cholesky_inverse(lower)
    del lower
    return torch.linalg.cholesky(hinv, upper=True)


def sparsegpt_prune(
    weight: Tensor,
    xtx: Tensor,
    sparsity: float = 0.5,
    nm: NM = None,
    *,
    block_size: int = 128,
    damp: float = 0.01,
) -> Tuple[Tensor, Tensor]:
    """SparseGPT on one layer: the pruned, compensated weight (float32) and its keep-mask.

    ``xtx`` is the inputs' ``X^T X`` (any positive scale; damping is relative
    to its mean diagonal). Unstructured: every block of ``block_size`` columns
    loses exactly its share of ``round(sparsity * numel)`` (so the layer's count
    is exact), chosen across all rows of the block by OBS saliency. N:M: the
    saliency picks the ``n`` kept weights of each group of ``m`` when the group's
    first column is reached. Inputs that were always zero get weight 0.

    Examples:
        >>> import torch
        >>> _ = torch.manual_seed(0)
        >>> x = torch.randn(64, 8); w = torch.randn(4, 8)
        >>> new, keep = sparsegpt_prune(w, x.t() @ x, 0.5)
        >>> int(keep.sum()), bool((new[~keep] == 0).all())
        (16, True)
    """
    _check(weight, sparsity, nm)
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    # H^-1's factor first: its two transient in^2 matrices are the peak, the float32 weights come after it
    u = hessian_inverse_cholesky(xtx.to(weight.device), damp)
    w = weight.detach().float()
    if w.data_ptr() == weight.data_ptr():  # already float32: work on a copy (a lower precision converted above)
        w = w.clone()
    rows, cols = w.shape
    dead = xtx.diagonal().to(w.device) == 0
    w[:, dead] = 0
    keep = torch.ones(rows, cols, dtype=torch.bool, device=w.device)
    total = prune_count(rows * cols, sparsity) if nm is None else 0
    for i1 in range(0, cols, block_size):
        i2 = min(i1 + block_size, cols)
        w1 = w[:, i1:i2].clone()
        u1 = u[i1:i2, i1:i2]
        d = u1.diagonal()
        err = torch.zeros_like(w1)
        keep1 = torch.ones_like(w1, dtype=torch.bool)
        if nm is None:
            # this block's share of the exact total, cumulative so the counts add up
            k = prune_count(rows * i2, sparsity) - prune_count(rows * i1, sparsity) if total else 0
            if k:
                keep1 = _matrix_keep_mask(w1.pow(2) / d.pow(2).unsqueeze(0), k)
        n, m = nm if nm is not None else (0, 0)
        for i in range(i2 - i1):
            if nm is not None and i % m == 0:
                sal = w1[:, i:i + m].pow(2) / d[i:i + m].pow(2).unsqueeze(0)
                keep1[:, i:i + m] = nm_keep_mask(sal, n, m)
            col = w1[:, i]
            e = torch.where(keep1[:, i], torch.zeros_like(col), col) / d[i]
            w1[:, i:] -= e.unsqueeze(1) * u1[i, i:].unsqueeze(0)
            err[:, i] = e
        w1[~keep1] = 0.0
        w[:, i1:i2] = w1
        keep[:, i1:i2] = keep1
        if i2 < cols:
            w[:, i2:] -= err @ u[i1:i2, i2:]
    return w, keep


def refit_masked(
    weight: Tensor,
    keep: Tensor,
    xtx: Tensor,
    target: Optional[Tensor] = None,
    *,
    iters: int = 30,
    damp: float = 0.01,
    tol: float = 1e-6,
) -> Tensor:
    """Least-squares refit of the kept weights: ``min_W tr((W - T) H (W - T)^T)`` with ``W = 0`` off ``keep``.

    ``H`` is ``xtx`` dampened as SparseGPT does; ``T`` (``target``, default
    ``weight``) the weights whose outputs to match. Solved by conjugate
    gradients restricted to the kept entries, all rows at once, with a Jacobi
    preconditioner, starting from ``weight`` (so ``iters=0`` returns it masked).

    Examples:
        >>> import torch
        >>> _ = torch.manual_seed(0)
        >>> x = torch.randn(256, 6); t = torch.randn(3, 6); keep = torch.rand(3, 6) > 0.5
        >>> w = refit_masked(t * keep, keep, x.t() @ x, t, iters=50, damp=0.0)
        >>> # the exact solution of row 0, by solving its normal equations directly
        >>> s = keep[0]; h = x.t() @ x
        >>> ref = torch.linalg.solve(h[s][:, s], (h @ t[0])[s])
        >>> bool(torch.allclose(w[0, s], ref, atol=1e-3))
        True
    """
    keepf = keep.to(torch.float32)
    w = weight.detach().float() * keepf
    t = (weight if target is None else target).detach().float()
    h = dampened_hessian(xtx.to(w.device), damp)
    diag = h.diagonal().clamp_min(1e-12).unsqueeze(0)
    r = ((t - w) @ h) * keepf  # minus the gradient (up to 2), restricted to the kept entries
    z = r / diag
    p = z.clone()
    rz = (r * z).sum(dim=1, keepdim=True)
    r0 = rz.abs().max().item()
    for _ in range(int(iters)):
        if r0 == 0 or rz.abs().max().item() <= tol * r0:
            break
        hp = (p @ h) * keepf
        php = (p * hp).sum(dim=1, keepdim=True)
        alpha = torch.where(php > 0, rz / php.clamp_min(1e-30), torch.zeros_like(php))
        w += alpha * p
        r -= alpha * hp
        z = r / diag
        rz_new = (r * z).sum(dim=1, keepdim=True)
        beta = torch.where(rz > 0, rz_new / rz.clamp_min(1e-30), torch.zeros_like(rz))
        p = z + beta * p
        rz = rz_new
    return w * keepf


def reconstruction_error(new: Tensor, dense: Tensor, xtx: Tensor) -> float:
    """Relative output error on the calibration inputs: ``||X (W - D)^T||^2 / ||X D^T||^2``.

    Examples:
        >>> import torch
        >>> reconstruction_error(torch.zeros(1, 2), torch.ones(1, 2), torch.eye(2))
        1.0
    """
    d = dense.detach().float()
    delta = new.detach().float() - d
    h = xtx.to(d.device).float()
    num = float(((delta @ h) * delta).sum())
    den = float(((d @ h) * d).sum())
    return num / den if den > 0 else (0.0 if num == 0 else math.inf)
