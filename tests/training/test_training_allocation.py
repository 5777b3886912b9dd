import pytest
import torch
from hypothesis import given, settings, strategies as st

from prunekit.training.allocation import check_feasible, global_counts, local_counts


def test_local_equal_ratio_and_exact_total():
    counts = local_counts(301, [100, 200, 300], [1, 1, 1], [0, 0, 0], [100, 200, 300])
    assert sum(counts) == 301
    assert all(abs(c - n * 301 / 600) <= 1 for c, n in zip(counts, [100, 200, 300]))


def test_local_cap_redistributes_to_others():
    # target 80 % of 300; layer 0 capped at 50 % -> the other two take its share
    counts = local_counts(240, [100, 100, 100], [1, 1, 1], [0, 0, 0], [50, 100, 100])
    assert counts == [50, 95, 95]


def test_local_minimum_respected():
    counts = local_counts(60, [100, 100], [1, 1], [40, 0], [100, 100])
    assert counts == [40, 20]


@settings(max_examples=50, deadline=None)
@given(sizes=st.lists(st.integers(1, 60), min_size=1, max_size=6), target=st.floats(0, 1),
       caps=st.lists(st.floats(0.2, 1.0), min_size=6, max_size=6), block=st.sampled_from([1, 4]))
def test_local_hits_budget_when_feasible(sizes, target, caps, block):
    hi = [int(c * n) for c, n in zip(caps, sizes)]
    budget_units = int(round(target * sum(hi)))  # always feasible
    counts = local_counts(budget_units * block, sizes, [block] * len(sizes), [0] * len(sizes), hi)
    assert sum(counts) == budget_units
    assert all(0 <= c <= h for c, h in zip(counts, hi))


def test_global_picks_lowest_across_layers_with_caps(framework):
    a = framework.tensor(torch.tensor([0.1, 0.2, 0.3, 0.4]))
    b = framework.tensor(torch.tensor([0.01, 0.02, 0.03, 0.04]))
    assert global_counts(4, [a, b], [1, 1], [0, 0], [4, 4]) == [0, 4]
    assert global_counts(4, [a, b], [1, 1], [0, 0], [4, 2]) == [2, 2]  # b capped at 2: a takes the rest
    assert global_counts(4, [a, b], [1, 1], [1, 0], [4, 4]) == [1, 3]  # a must lose at least one


def test_global_respects_already_pruned_and_ineligible(framework):
    inf = float("inf")
    a = framework.tensor(torch.tensor([-inf, 5.0, 6.0, inf]))  # first already pruned, last not allowed
    b = framework.tensor(torch.tensor([1.0, 2.0, 3.0, 4.0]))
    assert global_counts(6, [a, b], [1, 1], [1, 0], [3, 4]) == [2, 4]
    # unit sizes that differ between layers: one stable ranking, then whole units
    assert global_counts(6, [a, b], [2, 1], [1, 0], [3, 4]) == [1, 4]


@settings(max_examples=30, deadline=None)
@given(n=st.lists(st.integers(1, 40), min_size=1, max_size=5), frac=st.floats(0, 1), seed=st.integers(0, 999))
def test_global_exact_budget(framework, n, frac, seed):
    g = torch.Generator().manual_seed(seed)
    scores = [framework.tensor(torch.rand(k, generator=g)) for k in n]
    hi = [k // 2 + 1 for k in n]
    budget = int(round(frac * sum(hi)))
    counts = global_counts(budget, scores, [1] * len(n), [0] * len(n), hi)
    assert sum(counts) == budget
    assert all(c <= h for c, h in zip(counts, hi))


def test_infeasible_targets_are_explained():
    with pytest.raises(ValueError, match=r"cannot prune 90 of 100 weights: the per-layer maxima allow at most 80 \(fc: 80/100\)"):
        check_feasible(90, [100], [0], [80], [1], ["fc"])
    with pytest.raises(ValueError, match=r"cannot prune only 10 of 100 weights: the per-layer minima already prune 50"):
        check_feasible(10, [100], [50], [100], [1], ["fc"])
