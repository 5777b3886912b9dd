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
  (lazy blocked updates: within sub-blocks of 16 columns, then once for the
  rest of the block, then once for the rest of the matrix -- every update but
  the innermost is one matrix product). The factor is computed in place on one
  ``in_features^2`` matrix, without forming ``H^-1``.
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
#: columns per sub-block of the SparseGPT sweep: a column's update reaches the rest of its sub-block only
_SUB = 16


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

    ``H^-1`` itself is never formed: with ``P`` the order reversal, ``P H P = L L^T``
    gives ``H = V V^T`` for the upper ``V = P L P``, so ``U = V^-1`` -- one
    Cholesky factorisation and one triangular inverse, half the work of
    factorising, inverting and factorising again.

    Examples:
        >>> import torch
        >>> u = hessian_inverse_cholesky(torch.tensor([[4., 0.], [0., 1.]]), damp=0.0)
        >>> torch.allclose(u, torch.tensor([[0.5, 0.0], [0.0, 1.0]]))
        True
    """
    # everything in place on one in_features^2 matrix: the dampened copy of xtx becomes U
    h = dampened_hessian(xtx, damp).contiguous()  # symmetric: its transpose, stored by columns, is the same
    _reverse_in_place(h)  # P H P
    f = h.mT  # by columns, as LAPACK works: the factorisation happens where the matrix lies
    torch.linalg.cholesky(f, out=f)  # L
    _reverse_in_place(h)  # the same storage: V = P L P, upper
    _invert_upper_in_place(f)
    return f


#: columns per step of the triangular inverse
_STEP = 256


def _reverse_in_place(t: Tensor) -> None:
    """The contiguous ``t`` flipped in both dimensions, in place: its storage reversed, 64 Ki entries at a
    time."""
    flat = t.view(-1)
    n = flat.numel()
    step = 1 << 16
    for s in range(0, n // 2, step):
        e = min(s + step, n // 2)
        head = flat[s:e].clone()
        flat[s:e] = flat[n - e:n - s].flip(0)
        flat[n - e:n - s] = head.flip(0)


def _invert_upper_in_place(v: Tensor) -> None:
    """``v`` (upper triangular, zero below the diagonal) replaced by its inverse ``U``, a block of columns at a
    time: ``U_JJ = V_JJ^-1`` and ``U[:J, J] = -U[:J, :J] V[:J, J] U_JJ``, the columns before ``J`` already
    inverted where they lie (one block of columns held besides; the products skip ``U``'s zero blocks)."""
    n = v.shape[0]
    step = min(_STEP, n)
    # two column blocks of scratch for every step (not one of each size: freed blocks of growing sizes would
    # leave the allocator's heap growing)
    col = torch.empty(n, step, dtype=v.dtype, device=v.device)
    out = torch.empty_like(col)
    for j1 in range(0, n, step):
        j2 = min(j1 + step, n)
        eye = torch.eye(j2 - j1, dtype=v.dtype, device=v.device)
        ujj = torch.linalg.solve_triangular(v[j1:j2, j1:j2], eye, upper=True)
        if j1:
            c, o = col[:j1, :j2 - j1], out[:j1, :j2 - j1]
            for i1 in range(0, j1, step):
                i2 = min(i1 + step, j1)
                torch.matmul(v[i1:i2, i1:j1], v[i1:j1, j1:j2], out=c[i1:i2])
            torch.matmul(c, ujj, out=o)
            v[:j1, j1:j2] = o.neg_()
        v[j1:j2, j1:j2] = ujj


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
    # H^-1's factor first: its in^2 matrix (and a little scratch) is the peak, the float32 weights come after it
    u = hessian_inverse_cholesky(xtx.to(weight.device), damp)
    w = weight.detach().float()
    if w.data_ptr() == weight.data_ptr():  # already float32: work on a copy (a lower precision converted above)
        w = w.clone()
    rows, cols = w.shape
    dead = xtx.diagonal().to(w.device) == 0
    if bool(dead.any()):
        w[:, dead] = 0
    keep = torch.ones(rows, cols, dtype=torch.bool, device=w.device)
    total = prune_count(rows * cols, sparsity) if nm is None else 0
    for i1 in range(0, cols, block_size):
        i2 = min(i1 + block_size, cols)
        d = u[i1:i2, i1:i2].diagonal()
        if nm is None:
            # this block's share of the exact total, cumulative so the counts add up; ties by row-major position
            k = prune_count(rows * i2, sparsity) - prune_count(rows * i1, sparsity) if total else 0
            if not k:
                continue  # nothing pruned here: no error to spread
            keep[:, i1:i2] = _matrix_keep_mask(w[:, i1:i2].pow(2) / d.pow(2).unsqueeze(0), k)
        err = _sparsegpt_block(w, keep, u, i1, i2, nm)
        if i2 < cols:  # the lazy update of every later column: one product for the whole block
            w[:, i2:].addmm_(err.t(), u[i1:i2, i2:], alpha=-1)
    return w, keep


def _sparsegpt_block(w: Tensor, keep: Tensor, u: Tensor, i1: int, i2: int, nm: NM) -> Tensor:
    """Columns ``i1:i2`` of ``w`` pruned and compensated within the block, in place (pruned entries set to 0;
    the mask read from ``keep``, or with ``nm`` chosen group by group and written there); returns the block's
    scaled errors ``(i2 - i1, rows)``, row ``i`` the error of column ``i1 + i``.

    The block is worked on transposed (a column is a contiguous row) in sub-blocks: each column's rank-one
    update reaches only the rest of its sub-block, and one product per sub-block updates the rest of the
    block -- the same arithmetic as one update per column over the whole block, in another order.
    """
    u1 = u[i1:i2, i1:i2]
    wt = w[:, i1:i2].t().contiguous()  # (columns, rows)
    width = wt.shape[0]
    if nm is not None:
        n, m = nm
        prune = torch.zeros_like(wt, dtype=torch.bool)
        step = m * max(1, _SUB // m)  # a group of m never straddles two sub-blocks
    else:
        n = m = 0
        prune = (~keep[:, i1:i2]).t().contiguous()
        step = _SUB
    err = torch.zeros_like(wt)
    d = u1.diagonal()
    dl = d.tolist()
    for s1 in range(0, width, step):
        s2 = min(s1 + step, width)
        for i in range(s1, s2):
            if nm is not None and i % m == 0:
                sal = (wt[i:i + m].pow(2) / d[i:i + m].pow(2).unsqueeze(1)).t()
                prune[i:i + m] = ~nm_keep_mask(sal, n, m).t()
            e = torch.mul(wt[i], prune[i], out=err[i]).div_(dl[i])
            if i + 1 < s2:
                wt[i + 1:s2].addr_(u1[i, i + 1:s2], e, alpha=-1)
        if s2 < width:
            wt[s2:].addmm_(u1[s1:s2, s2:].t(), err[s1:s2], alpha=-1)
    wt.masked_fill_(prune, 0.0)
    w[:, i1:i2] = wt.t()
    if nm is not None:
        keep[:, i1:i2] = ~prune.t()
    return err


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
    h = xtx.to(dense.device).float()
    num = den = 0.0
    for r1 in range(0, dense.shape[0], _TRACE_STEP):  # a few rows at a time: no full-size copy of either matrix
        d = dense[r1:r1 + _TRACE_STEP].detach().float()
        num += _quadratic_trace(new[r1:r1 + _TRACE_STEP].detach().float() - d, h)
        den += _quadratic_trace(d, h)
    return num / den if den > 0 else (0.0 if num == 0 else math.inf)


#: rows and columns per step of :func:`reconstruction_error`
_TRACE_STEP = 256


def _quadratic_trace(a: Tensor, h: Tensor) -> float:
    """``tr(A H A^T)`` for a symmetric ``H``, from its upper triangle only: half the products of ``(A H) * A``.

    Column block ``J`` adds ``A_J H_JJ A_J^T`` and twice ``A_I H_IJ A_J^T`` for every block ``I`` before it.
    """
    cols = a.shape[1]
    total = 0.0
    for j1 in range(0, cols, _TRACE_STEP):
        j2 = min(j1 + _TRACE_STEP, cols)
        aj = a[:, j1:j2]
        p = aj @ h[j1:j2, j1:j2]
        if j1:
            p.addmm_(a[:, :j1], h[:j1, j1:j2], alpha=2)
        total += float((p * aj).sum(dtype=torch.float64))
    return total
