"""Ties are broken by position, the same way by every method, on torch and on TensorPlay.

The rule (README, "Ties"): among entries (or channels, blocks, units) whose
scores are exactly equal, the one at the lowest position is pruned first --
flat row-major order within a tensor, tensors in the order given for global
pruning, layers in order for training's global budget. Every test below builds
weights whose scores tie exactly (small integers: sums and norms are exact), prunes
on each framework and checks the mask against the rule written out by hand.
The last tests cover near-ties: scores that are reductions (channel norms, block
means) are computed with torch's kernels on both frameworks, so weights whose
norms differ by one ulp in one framework's arithmetic cannot flip the choice.
"""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import prunekit as prune
from prunekit.kernels.norms import channel_norms
from prunekit.kernels.select import NaNScoresError, keep_mask_smallest_multi, select_lowest
from prunekit.training import prepare_pruning
from prunekit.training.allocation import global_counts
from prunekit.training.patterns import get_pattern


def pruned_positions(fw, mask):
    """Flat positions where ``mask`` (any framework) is zero."""
    return (fw.to_torch(mask).reshape(-1) == 0).nonzero().flatten().tolist()


# ------------------------------------------------------------------ the kernels
def test_select_lowest_takes_the_lowest_positions_among_equal_values(framework):
    fw = framework
    v = fw.tensor(torch.tensor([2.0, 1.0, 1.0, 0.0, 1.0, 1.0, -0.0, 3.0]))
    # 0.0 and -0.0 tie (positions 3 and 6), then the 1.0s in order
    assert fw.to_torch(select_lowest(v, 1)).nonzero().flatten().tolist() == [3]
    assert fw.to_torch(select_lowest(v, 2)).nonzero().flatten().tolist() == [3, 6]
    assert fw.to_torch(select_lowest(v, 4)).nonzero().flatten().tolist() == [1, 2, 3, 6]
    assert fw.to_torch(select_lowest(v, 5)).nonzero().flatten().tolist() == [1, 2, 3, 4, 6]
    signed = fw.tensor(torch.tensor([[math.inf, -1.0], [-math.inf, -1.0]]))
    assert fw.to_torch(select_lowest(signed, 2)).tolist() == [[False, True], [True, False]]
    assert fw.to_torch(select_lowest(signed, 4)).all()
    ints = fw.tensor(torch.tensor([5, 5, 5, 5]))
    assert fw.to_torch(select_lowest(ints, 2)).tolist() == [True, True, False, False]


def test_select_lowest_refuses_nan_and_bad_counts():
    with pytest.raises(NaNScoresError, match="1 NaN"):
        select_lowest(torch.tensor([1.0, math.nan]), 1)
    with pytest.raises(ValueError, match="k=3 entries out of 2"):
        select_lowest(torch.tensor([1.0, 2.0]), 3)
    with pytest.raises(TypeError, match="real numbers"):
        select_lowest(torch.tensor([True, False]), 1)
    assert not select_lowest(torch.tensor([1.0, 2.0]), 0).any()


def test_magnitude_kernel_ties_by_flat_position_tensor_after_tensor(framework):
    fw = framework
    a = fw.tensor(torch.tensor([[1.0, -1.0], [1.0, 2.0]]))
    b = fw.tensor(torch.tensor([-1.0, 1.0, 0.5]))
    keeps = [fw.to_torch(k) for k in keep_mask_smallest_multi([a, b], 4)]
    # 0.5 first, then the 1.0s: a's three (in flat order) before b's
    assert keeps[0].tolist() == [[False, False], [False, True]]
    assert keeps[1].tolist() == [True, True, False]


# ------------------------------------------------------------ the pruning methods
@pytest.mark.parametrize("amount", [1, 5, 11])
def test_l1_unstructured_prunes_the_first_tied_entries(framework, amount):
    fw = framework
    m = fw.set_params(fw.nn.Linear(4, 3, bias=False), {"weight": torch.tensor([[1.0, -1.0, 1.0, -1.0]] * 3)})
    prune.l1_unstructured(m, "weight", amount=amount)
    assert pruned_positions(fw, m.weight_mask) == list(range(amount))


def test_l1_unstructured_second_round_and_importance_scores_tie_by_position(framework):
    fw = framework
    m = fw.set_params(fw.nn.Linear(3, 2, bias=False), {"weight": torch.full((2, 3), 2.0)})
    prune.l1_unstructured(m, "weight", amount=2)  # entries 0 and 1
    prune.l1_unstructured(m, "weight", amount=2)  # then the first two still unpruned: 2 and 3
    assert pruned_positions(fw, m.weight_mask) == [0, 1, 2, 3]
    m2 = fw.set_params(fw.nn.Linear(3, 2, bias=False), {"weight": torch.arange(6.0).view(2, 3)})
    scores = fw.tensor(torch.tensor([[3.0, 1.0, 3.0], [1.0, 3.0, 1.0]]))
    prune.l1_unstructured(m2, "weight", amount=4, importance_scores=scores)
    assert pruned_positions(fw, m2.weight_mask) == [0, 1, 3, 5]  # the three 1s, then the first 3


@pytest.mark.parametrize("n", [1, 2, 3, 0, math.inf, -math.inf, "fro", "nuc"])
@pytest.mark.parametrize("dim", [0, 1, 3, -1])
def test_ln_structured_prunes_the_lowest_tied_channels(framework, n, dim):
    fw = framework
    # a conv weight [6, 6, 1, 6] of +-1: every channel along `dim` has the same norm, except channel 4
    # (three times larger, or with no zero for n=0); channel 1 is negated (norms ignore signs)
    w = torch.ones(6, 6, 1, 6)
    sl = [slice(None)] * 4
    sl[dim] = 4
    w[tuple(sl)] = 3.0
    if n == 0:  # the 0-"norm" counts non-zeros: one zero in every other channel
        w.movedim(dim, 0)[[0, 1, 2, 3, 5], 0, 0, 0] = 0.0
    sl[dim] = 1
    w[tuple(sl)] *= -1
    conv = fw.set_params(fw.nn.Conv2d(6, 6, (1, 6), bias=False), {"weight": w})
    norms = fw.to_torch(channel_norms(conv.weight, n, dim)).tolist()
    assert len({x for i, x in enumerate(norms) if i != 4}) == 1 and norms[4] != norms[0]  # a real tie
    prune.ln_structured(conv, "weight", amount=2, n=n, dim=dim)
    mask = fw.to_torch(conv.weight_mask).movedim(dim, 0).reshape(6, -1)
    assert (mask.sum(dim=1) == 0).nonzero().flatten().tolist() == [0, 1]
    prune.ln_structured(conv, "weight", amount=2, n=n, dim=dim)  # on top: the next tied channels
    mask = fw.to_torch(conv.weight_mask).movedim(dim, 0).reshape(6, -1)
    assert (mask.sum(dim=1) == 0).nonzero().flatten().tolist() == [0, 1, 2, 3]
    assert int((mask == 0).sum()) == 4 * mask.shape[1]


def test_global_unstructured_ties_go_tensor_after_tensor(framework):
    fw = framework
    a = fw.set_params(fw.nn.Linear(3, 2, bias=False), {"weight": torch.full((2, 3), -1.0)})
    b = fw.set_params(fw.nn.Linear(2, 2, bias=False), {"weight": torch.tensor([[1.0, 0.5], [1.0, 1.0]])})
    prune.global_unstructured([(b, "weight"), (a, "weight")], prune.L1Unstructured, amount=4)
    # 0.5 first, then the 1.0s in the order of the list: b's before a's
    assert pruned_positions(fw, b.weight_mask) == [0, 1, 2, 3]
    assert pruned_positions(fw, a.weight_mask) == []
    prune.global_unstructured([(b, "weight"), (a, "weight")], prune.L1Unstructured, amount=2)
    assert pruned_positions(fw, a.weight_mask) == [0, 1]


# ------------------------------------------------------------- training patterns
@pytest.mark.parametrize("pattern,amount,expected", [
    ("1x1", 3, [0, 1, 2]),                       # entries, flat order
    ("4x1", 2, [0, 8, 16, 24, 1, 9, 17, 25]),    # blocks of 4 rows x 1 column: the first two blocks
    ("1x4", 1, [0, 1, 2, 3]),
    ("2:4", 4, [0, 1, 4, 5]),                     # 2 of every 4; the first groups first
    ("1xchannel", 1, list(range(8))),             # whole output channels: row 0
    ("channelx1", 1, [0, 8, 16, 24, 32, 40, 48, 56]),  # whole input channels: column 0
])
def test_pattern_units_tie_by_position(framework, pattern, amount, expected):
    fw = framework
    scores = fw.tensor(torch.ones(8, 8))
    keep = get_pattern(pattern).mask_from_scores(scores, amount)
    assert pruned_positions(fw, keep) == sorted(expected)


def test_global_budget_ties_go_to_the_first_layer(framework):
    fw = framework
    s = [fw.tensor(torch.tensor([1.0, 1.0, 2.0])), fw.tensor(torch.tensor([1.0, 1.0, 2.0]))]
    assert global_counts(3, s, [1, 1], [0, 0], [3, 3]) == [2, 1]
    assert global_counts(1, s, [1, 1], [0, 0], [3, 3]) == [1, 0]


@pytest.mark.parametrize("scope", ["global", "local"])
@pytest.mark.parametrize("pattern,target", [("1x1", 0.5), ("4x1", 0.5), ("2:4", 0.5), ("1xchannel", 0.25)])
def test_magnitude_pruner_on_equal_weights_prunes_the_first_units(framework, scope, pattern, target):
    fw = framework
    model = fw.nn.Sequential(fw.nn.Linear(8, 8, bias=False), fw.nn.Linear(8, 8, bias=False))
    fw.set_params(model, {"0.weight": torch.ones(8, 8), "1.weight": -torch.ones(8, 8)})
    prepare_pruning(model, {"prune_type": "magnitude", "pattern": pattern, "target_sparsity": target,
                            "prune_domain": scope, "start_step": 0, "end_step": 0,
                            "max_sparsity_ratio_per_layer": 1.0}).step()
    masks = [fw.to_torch(model[i].weight_mask) for i in (0, 1)]
    expected = torch.ones(2, 8, 8)
    p = get_pattern(pattern)
    if scope == "local":  # each layer loses its first units
        for i in (0, 1):
            expected[i] = p.mask_from_scores(torch.ones(8, 8), round(target * p.n_units((8, 8))))
    else:  # one ranking over both layers: the first layer's units come first
        units = round(target * 2 * p.n_units((8, 8)))
        expected[0] = p.mask_from_scores(torch.ones(8, 8), min(units, p.max_units((8, 8))))
        expected[1] = p.mask_from_scores(torch.ones(8, 8), units - min(units, p.max_units((8, 8))))
    assert torch.equal(masks[0], expected[0]) and torch.equal(masks[1], expected[1])


# ----------------------------------------------------------------- near-ties
def test_near_tie_channel_norms_give_identical_masks_on_both_frameworks():
    tp = pytest.importorskip("tensorplay")
    # Found by search: the 2-norms of channels 6 and 11 of these weights are one ulp apart in torch
    # and tie in TensorPlay's own arithmetic, which once made the two frameworks prune different channels.
    g = torch.Generator().manual_seed(1226)
    mags = (torch.randperm(144, generator=g).float() + 1) / 144
    signs = torch.randint(0, 2, (144,), generator=g).float() * 2 - 1
    w = (mags * signs).view(16, 9)
    norms_torch = channel_norms(w, 2, 0)
    assert norms_torch[6] != norms_torch[11]  # torch: one ulp apart
    assert torch.equal(torch.from_dlpack(channel_norms(tp.from_dlpack(w.clone()), 2, 0)), norms_torch)
    for k in range(1, 16):
        a, b, c = tp.nn.Linear(9, 16), torch.nn.Linear(9, 16), torch.nn.Linear(9, 16)
        with tp.no_grad():
            a.weight.copy_(tp.from_dlpack(w.clone()))
        with torch.no_grad():
            b.weight.copy_(w)
            c.weight.copy_(w)
        prune.ln_structured(a, "weight", k, n=2, dim=0)
        prune.ln_structured(b, "weight", k, n=2, dim=0)
        torch.nn.utils.prune.ln_structured(c, "weight", k, n=2, dim=0)
        assert torch.equal(torch.from_dlpack(a.weight_mask), b.weight_mask), k
        assert torch.equal(b.weight_mask, c.weight_mask), k  # no exact tie here: torch's choice is defined


@settings(max_examples=40, deadline=None)
@given(shape=st.sampled_from([(6, 5), (16, 9), (8, 3, 3, 3), (4, 2, 1, 5), (3, 40)]), seed=st.integers(0, 10_000),
       n=st.sampled_from([1, 2, 3, 0.5, math.inf, -math.inf, "fro", "nuc"]), dim=st.integers(0, 1),
       dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16]))
def test_scores_are_bit_identical_across_frameworks(shape, seed, n, dim, dtype):
    tp = pytest.importorskip("tensorplay")
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g).to(dtype)
    w_tp = tp.from_dlpack(w.clone())
    if n != "nuc" or dtype != torch.bfloat16:  # torch has no bfloat16 SVD
        assert torch.equal(torch.from_dlpack(channel_norms(w_tp, n, dim)), channel_norms(w, n, dim))
    for spec in ("4x1", "1x1", "1xchannel", "channelx1"):
        p = get_pattern(spec)
        if len(shape) == 2 and p.check(shape) is None:
            assert torch.equal(torch.from_dlpack(p.unit_scores(w_tp.abs())), p.unit_scores(w.abs()))
