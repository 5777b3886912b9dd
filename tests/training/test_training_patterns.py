import pytest
import torch
from hypothesis import given, settings, strategies as st

from prunekit.kernels.patterns import from_2d, get_pattern, to_2d


def test_conv_layout_puts_input_channels_innermost():
    w = torch.arange(2 * 3 * 2 * 2).reshape(2, 3, 2, 2)
    m = to_2d(w)
    assert m.shape == (2, 12)
    # columns 0..2 are input channels 0..2 at kernel position (0, 0)
    assert m[0, :3].tolist() == [w[0, 0, 0, 0], w[0, 1, 0, 0], w[0, 2, 0, 0]]
    assert torch.equal(from_2d(m, w.shape), w)


@settings(max_examples=25, deadline=None)
@given(n=st.sampled_from([1, 2, 4]), m=st.sampled_from([1, 2, 4]), conv=st.booleans(),
       frac=st.floats(0.0, 1.0), seed=st.integers(0, 2**16))
def test_nxm_blocks_are_all_zero_or_untouched(framework, n, m, conv, frac, seed):
    g = torch.Generator().manual_seed(seed)
    shape = (8, 8, 3, 3) if conv else (8, 12)
    w = torch.randn(shape, generator=g)
    p = get_pattern(f"{n}x{m}")
    n_units = p.n_units(shape)
    k = int(round(frac * n_units))
    keep = framework.to_torch(p.mask_from_scores(framework.tensor(w.abs()), k))  # on the framework's tensors
    units = p.to_units(keep)
    assert units.shape == (n_units, n * m)
    # each block all kept or all pruned, exactly k pruned
    assert torch.all((units.sum(1) == 0) | (units.sum(1) == n * m))
    assert int((units.sum(1) == 0).sum()) == k
    assert int((keep == 0).sum()) == k * n * m
    # the pruned blocks are the ones of lowest mean |w|
    means = p.to_units(w.abs()).mean(1)
    pruned = units.sum(1) == 0
    if 0 < k < n_units:
        assert means[pruned].max() <= means[~pruned].min()


def test_1x4_block_runs_along_input_channels_of_a_conv():
    p = get_pattern("1x4")
    w = torch.ones(2, 8, 3, 3)
    w[1, 4:8, 2, 1] = 0.01  # one block: output 1, input channels 4..7, kernel position (2, 1)
    keep = p.mask_from_scores(w.abs(), 1)
    expected = torch.ones_like(w)
    expected[1, 4:8, 2, 1] = 0
    assert torch.equal(keep, expected)


def test_channel_patterns():
    w = torch.randn(6, 4, 3, 3)
    w[:, 2] *= 1e-3  # input channel 2 is tiny
    w[5] *= 1e-3  # output channel 5 is tiny
    keep_in = get_pattern("channelx1").mask_from_scores(w.abs(), 1)
    assert torch.equal((keep_in == 0).nonzero()[:, 1].unique(), torch.tensor([2]))
    assert int((keep_in == 0).sum()) == 6 * 9
    keep_out = get_pattern("1xchannel").mask_from_scores(w.abs(), 1)
    assert torch.equal((keep_out == 0).nonzero()[:, 0].unique(), torch.tensor([5]))
    assert int((keep_out == 0).sum()) == 4 * 9


@settings(max_examples=25, deadline=None)
@given(nm=st.sampled_from([(2, 4), (1, 4), (3, 4), (4, 8), (1, 2)]), conv=st.booleans(), seed=st.integers(0, 2**16))
def test_n_in_m_full_mask_has_at_most_n_nonzeros_per_group(framework, nm, conv, seed):
    n, m = nm
    g = torch.Generator().manual_seed(seed)
    shape = (4, 8, 3, 3) if conv else (6, 16)
    w = torch.randn(shape, generator=g)
    p = get_pattern(f"{n}:{m}")
    full = p.max_units(shape)
    keep = framework.to_torch(p.mask_from_scores(framework.tensor(w.abs()), full))
    groups = to_2d(keep).reshape(-1, m)
    assert torch.all(groups.sum(1) == n)  # exactly N non-zeros in every group of M
    # the kept ones are the N largest |w| of their group
    wg = to_2d(w.abs()).reshape(-1, m)
    kept_min = torch.where(groups.bool(), wg, torch.full_like(wg, float("inf"))).min(1).values
    dropped_max = torch.where(groups.bool(), torch.full_like(wg, -1.0), wg).max(1).values
    assert torch.all(kept_min >= dropped_max)
    assert p.fixed_sparsity == (m - n) / m


def test_n_in_m_partial_never_exceeds_group_limit(framework):
    p = get_pattern("2:4")
    w = framework.tensor(torch.tensor([[0.1, 0.2, 0.3, 0.4, 5.0, 6.0, 7.0, 8.0]]))
    keep = p.mask_from_scores(w, 3)  # the 3 smallest are all in group 0, which may lose only 2
    assert keep.tolist() == [[0.0, 0.0, 1.0, 1.0, 0.0, 1.0, 1.0, 1.0]]


def test_already_pruned_entries_stay_pruned_and_count(framework):
    p = get_pattern("1x1")
    w = framework.tensor(torch.tensor([[5.0, 1.0, 2.0, 3.0]]))
    pruned = framework.tensor(torch.tensor([[True, False, False, False]]))
    keep = p.mask_from_scores(w, 2, pruned=pruned)
    assert keep.tolist() == [[0.0, 0.0, 1.0, 1.0]]


def test_shape_checks_report_reasons():
    assert get_pattern("4x1").check((6, 8)) == "6 output channels are not a multiple of the block height 4"
    assert get_pattern("1x4").check((8, 3, 3, 3)) == "3 input channels are not a multiple of the block width 4"
    assert get_pattern("2:4").check((8, 6)) == "6 input channels are not a multiple of M=4"
    assert get_pattern("4x1").check((8, 6)) is None
    with pytest.raises(ValueError, match=r"does not fit a tensor of shape \(6, 8\)"):
        get_pattern("4x1").mask_from_scores(torch.ones(6, 8), 1)


@pytest.mark.parametrize("bad", ["4x", "2:2", "5:4", "block", "0x1"])
def test_bad_pattern_strings(bad):
    with pytest.raises(ValueError, match="pattern"):
        get_pattern(bad)
    with pytest.raises(TypeError, match="write a string"):
        get_pattern(4)
