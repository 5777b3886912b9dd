"""Structured one-shot pruning from calibration data with least-squares reconstruction."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import prunekit
from prunekit.compact import compact, prune_groups, prune_with_calibration
from helpers.compact_models import MLP


pytestmark = pytest.mark.usefixtures("one_thread")


def _data(n=6, rows=64, d=32, seed=0):
    # correlated inputs (8 directions in 32 features, one fixed basis): what makes a refit worth it
    basis = torch.randn(8, d, generator=torch.Generator().manual_seed(123))
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(rows, 8, generator=g) @ basis + 0.1 * torch.randn(rows, d, generator=g) for _ in range(n)]


def _err(model, dense, xs):
    with torch.no_grad():
        num = sum(float((model(x) - dense(x)).pow(2).sum()) for x in xs)
        den = sum(float(dense(x).pow(2).sum()) for x in xs)
    return (num / den) ** 0.5


def test_reconstruction_reduces_the_output_error_and_compacts_exactly():
    cal, held = _data(), _data(seed=1)
    make = lambda: MLP((32, 128, 64, 8)).eval()  # noqa: E731
    torch.manual_seed(0)
    dense = make()
    plain, refit = make(), make()
    plain.load_state_dict(dense.state_dict())
    refit.load_state_dict(dense.state_dict())
    r0 = prune_with_calibration(plain, cal, 0.5, reconstruct=False)
    r1 = prune_with_calibration(refit, cal, 0.5)
    # the first group sees the same inputs either way; later ones see the refitted layers' outputs
    assert r0.decisions[0].removed == r1.decisions[0].removed
    assert [len(d.removed) for d in r1.decisions] == [64, 32]
    assert all(f.error_after < f.error_before for f in r1.fits)
    assert all(f.error_after == f.error_before for f in r0.fits)
    assert _err(refit, dense, held) < 0.5 * _err(plain, dense, held)  # held-out data, not the calibration set
    small = compact(refit, cal[0])
    assert [layer.out_features for layer in small.layers] == [64, 32, 8]
    with torch.no_grad():
        assert float((small(held[0]) - refit(held[0])).norm() / refit(held[0]).norm()) < 1e-5


def test_activation_importance_differs_from_weight_norms_when_inputs_are_skewed():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2))
    with torch.no_grad():
        m[0].weight.copy_(torch.eye(6, 4) + 0.01)
        m[0].bias.zero_()
        m[2].weight.fill_(1.0)
        m[2].weight[:, 0] = 0.1  # small weights, but neuron 0 carries the large inputs
    cal = [torch.cat([100 * torch.rand(32, 1), torch.rand(32, 3)], dim=1)]
    by_weight = prune_groups(_clone(m), cal[0], 1 / 6)
    by_acts = prune_with_calibration(_clone(m), cal, 1 / 6, reconstruct=False)
    assert by_weight[0].removed == [0]  # l1 on weights: column 0 is the smallest
    assert by_acts.decisions[0].removed != [0]  # wanda sees that neuron 0 carries the signal


def _clone(m):
    import copy

    return copy.deepcopy(m)


def test_failure_leaves_the_model_unchanged(monkeypatch):
    import prunekit.compact.reconstruct as rc

    m = MLP((32, 64, 48, 8)).eval()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    real = rc._refit
    calls = [0]

    def boom(*a, **k):
        calls[0] += 1
        if calls[0] == 2:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(rc, "_refit", boom)
    with pytest.raises(KeyboardInterrupt):
        prune_with_calibration(m, _data(2), 0.5)
    assert not prunekit.is_pruned(m)
    after = m.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)


def test_bad_arguments():
    m = MLP((32, 64, 8))
    with pytest.raises(ValueError, match=r"amount must be a float in \[0, 1\)"):
        prune_with_calibration(m, _data(1), 1.0)
    with pytest.raises(ValueError, match="calibration is empty"):
        prune_with_calibration(m, [], 0.5)
    with pytest.raises(ValueError, match="nope"):
        prune_with_calibration(m, _data(1), 0.5, importance="nope")
    assert not prunekit.is_pruned(m)


def test_report_counts_rows_and_non_linear_readers_are_refused_for_activation_scores():
    m = MLP((32, 64, 8)).eval()
    assert prune_with_calibration(m, _data(3), 0.5).tokens == 3 * 64
    conv = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 4, 3))
    cal = [torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(0))]
    with pytest.raises(ValueError, match=r"importance 'wanda' .* 1 group\(s\) have no such reader"):
        prune_with_calibration(conv, cal, 0.5)
    assert not prunekit.is_pruned(conv)
    report = prune_with_calibration(conv, cal, 0.5, importance="l1")  # weights only: no refit of a conv reader
    assert [len(d.removed) for d in report.decisions] == [4] and report.fits == []
    assert compact(conv, cal[0])[0].out_channels == 4
