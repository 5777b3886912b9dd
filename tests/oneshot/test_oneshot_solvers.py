"""Wanda and SparseGPT on one matrix, against slow, obviously-correct references written from the papers."""

import pytest
import torch

from prunekit.importance import dampened_hessian
from prunekit.oneshot.solvers import (
    hessian_inverse_cholesky,
    magnitude_prune,
    prune_count,
    refit_masked,
    reconstruction_error,
    sparsegpt_prune,
    wanda_prune,
)


def _data(rows=6, cols=16, tokens=80, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, cols, generator=g, dtype=torch.float64)
    x[:, 3] *= 5  # an outlier feature
    w = torch.randn(rows, cols, generator=g, dtype=torch.float64)
    return w, x


def wanda_reference(w, x, sparsity=None, nm=None):
    """Sun et al. 2023: S_ij = |W_ij| * ||X_j||_2; per output row drop the lowest (or per group of m)."""
    norms = [sum(float(x[t, j]) ** 2 for t in range(x.shape[0])) ** 0.5 for j in range(x.shape[1])]
    keep = torch.ones(w.shape, dtype=torch.bool)
    for i in range(w.shape[0]):
        score = [(abs(float(w[i, j])) * norms[j], j) for j in range(w.shape[1])]
        if nm is None:
            k = prune_count(w.shape[1], sparsity)
            for _, j in sorted(score)[:k]:
                keep[i, j] = False
        else:
            n, m = nm
            for g0 in range(0, w.shape[1], m):
                for _, j in sorted(score[g0:g0 + m])[: m - n]:
                    keep[i, j] = False
    return keep


def sparsegpt_reference(w, xtx, sparsity=None, nm=None, block_size=4, damp=0.01):
    """Column by column, the plain OBS formulas with explicit inverses of the sub-Hessians (float64).

    When column j is reached, the free columns are F = {j, j+1, ...}; removing w_rj moves row r's free
    weights by  -w_rj / [H_F^-1]_jj * [H_F^-1]_{:, j}  (Hassibi & Stork; Frantar & Alistarh eq. 3).
    The mask of a block of columns is chosen when the block starts, by the saliency
    w_rj^2 / [H_{F_j}^-1]_jj over the whole block (N:M: over each group of m when it starts).
    """
    w = w.clone().double()
    h = dampened_hessian(xtx, damp).double()
    rows, cols = w.shape
    sub_inv = [torch.linalg.inv(h[j:, j:]) for j in range(cols)]
    diag = torch.tensor([float(sub_inv[j][0, 0]) for j in range(cols)], dtype=torch.float64)
    keep = torch.ones(rows, cols, dtype=torch.bool)
    for b0 in range(0, cols, block_size):
        b1 = min(b0 + block_size, cols)
        if nm is None:
            k = prune_count(rows * b1, sparsity) - prune_count(rows * b0, sparsity)
            sal = [(float(w[r, j]) ** 2 / float(diag[j]), r * (b1 - b0) + j - b0, r, j)
                   for r in range(rows) for j in range(b0, b1)]
            for _, _, r, j in sorted(sal)[:k]:
                keep[r, j] = False
        for j in range(b0, b1):
            if nm is not None and (j - b0) % nm[1] == 0:
                n, m = nm
                for r in range(rows):
                    sal = sorted((float(w[r, c]) ** 2 / float(diag[c]), c) for c in range(j, j + m))
                    for _, c in sal[: m - n]:
                        keep[r, c] = False
            finv = sub_inv[j]
            for r in range(rows):
                if not keep[r, j]:
                    w[r, j:] -= float(w[r, j]) / float(finv[0, 0]) * finv[:, 0]
                    w[r, j] = 0.0
    return w, keep


@pytest.mark.parametrize("sparsity,nm", [(0.5, None), (0.3, None), (0.5, (2, 4)), (0.25, (1, 4))])
def test_wanda_matches_reference(sparsity, nm):
    w, x = _data()
    from prunekit.importance import ActivationStats
    st = ActivationStats(w.shape[1])
    st.add(x.float())
    keep = wanda_prune(w.float(), st.norm, sparsity, nm)
    assert torch.equal(keep, wanda_reference(w, x, sparsity, nm))


@pytest.mark.parametrize("sparsity,nm,block", [(0.5, None, 4), (0.6, None, 16), (0.5, (2, 4), 8), (0.5, (1, 4), 4)])
def test_sparsegpt_matches_reference(sparsity, nm, block):
    w, x = _data()
    xtx = x.t() @ x
    new, keep = sparsegpt_prune(w.float(), xtx.float(), sparsity, nm, block_size=block, damp=0.01)
    ref_w, ref_keep = sparsegpt_reference(w, xtx, sparsity, nm, block_size=block, damp=0.01)
    assert torch.equal(keep, ref_keep)
    assert torch.allclose(new.double(), ref_w, atol=1e-4, rtol=1e-4)
    assert int((~keep).sum()) == (prune_count(w.numel(), sparsity) if nm is None else w.numel() * (nm[1] - nm[0]) // nm[1])
    assert bool((new[~keep] == 0).all())


@pytest.mark.parametrize("nm", [None, (2, 4)])
def test_sparsegpt_matches_reference_across_sub_blocks_and_inverse_steps(nm):
    # 300 columns: blocks of 128 hold several sub-blocks of the sweep, and the factor of H^-1 is inverted in
    # more than one step of columns
    w, x = _data(rows=3, cols=300, tokens=700, seed=2)
    xtx = x.t() @ x
    new, keep = sparsegpt_prune(w.float(), xtx.float(), 0.5, nm, block_size=128, damp=0.01)
    ref_w, ref_keep = sparsegpt_reference(w, xtx, 0.5, nm, block_size=128, damp=0.01)
    assert torch.equal(keep, ref_keep)
    assert torch.allclose(new.double(), ref_w, atol=1e-4, rtol=1e-4)


def test_hessian_inverse_cholesky_is_the_upper_factor_of_the_inverse():
    _, x = _data(rows=1, cols=600, tokens=900, seed=4)
    xtx = x.t() @ x
    u = hessian_inverse_cholesky(xtx.float(), damp=0.01)
    ref = torch.linalg.cholesky(torch.linalg.inv(dampened_hessian(xtx, 0.01).double()), upper=True)
    assert bool((u.tril(-1) == 0).all())
    assert torch.allclose(u.double(), ref, atol=1e-6 * float(ref.abs().max()), rtol=1e-4)


def test_sparsegpt_beats_magnitude_and_wanda_on_its_objective():
    w, x = _data(rows=16, cols=32, tokens=200, seed=3)
    xtx = (x.t() @ x).float()
    w = w.float()
    new, keep = sparsegpt_prune(w, xtx, 0.5, block_size=8)
    err_sgpt = reconstruction_error(new, w, xtx)
    err_mag = reconstruction_error(w * magnitude_prune(w, 0.5), w, xtx)
    from prunekit.importance import ActivationStats
    st = ActivationStats(32)
    st.add(x.float())
    err_wanda = reconstruction_error(w * wanda_prune(w, st.norm, 0.5), w, xtx)
    assert err_sgpt < err_wanda < err_mag


def test_refit_is_the_masked_least_squares_solution():
    w, x = _data(rows=5, cols=12, tokens=100, seed=1)
    xtx = (x.t() @ x).float()
    w = w.float()
    keep = magnitude_prune(w, 0.5)
    fit = refit_masked(w * keep, keep, xtx, w, iters=100, damp=0.0, tol=0.0)
    for r in range(w.shape[0]):  # each row's normal equations over its kept entries, solved directly
        s = keep[r]
        ref = torch.linalg.solve(xtx.double()[s][:, s], (xtx.double() @ w[r].double())[s])
        assert torch.allclose(fit[r, s].double(), ref, atol=1e-3)
        assert bool((fit[r, ~s] == 0).all())


def test_dead_inputs_and_bad_arguments():
    w, x = _data()
    x[:, 5] = 0  # an input that is always zero
    new, keep = sparsegpt_prune(w.float(), (x.t() @ x).float(), 0.5, block_size=8)
    assert bool((new[:, 5] == 0).all())
    with pytest.raises(ValueError, match="needs in_features divisible by 4"):
        sparsegpt_prune(torch.ones(2, 6), torch.eye(6), nm=(2, 4))
    with pytest.raises(ValueError, match=r"sparsity must be in \[0, 1\)"):
        magnitude_prune(torch.ones(2, 4), 1.0)
    with pytest.raises(ValueError, match="2-D weights"):
        wanda_prune(torch.ones(2, 4, 1), torch.ones(4))
