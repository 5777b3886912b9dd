"""Invariants that hold for any weights, any chain of methods, any amounts (in each framework)."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import prunekit as prune

METHODS = ["l1", "random_u", "ln", "random_s", "custom"]


def step(m, method, amount, dim, seed, fw):
    fw.manual_seed(seed)
    if method == "l1":
        prune.l1_unstructured(m, "weight", amount)
    elif method == "random_u":
        prune.random_unstructured(m, "weight", amount)
    elif method == "ln":
        prune.ln_structured(m, "weight", amount, n=1, dim=dim)
    elif method == "random_s":
        prune.random_structured(m, "weight", amount, dim=dim)
    else:
        shape = tuple(m.weight_orig.shape if prune.is_pruned(m) else m.weight.shape)
        prune.custom_from_mask(m, "weight", fw.tensor(torch.rand(shape) > amount))


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(2, 12), cols=st.integers(2, 12), seed=st.integers(0, 999),
       chain=st.lists(st.tuples(st.sampled_from(METHODS), st.floats(0, 1), st.integers(0, 1)), min_size=1, max_size=5),
       lean=st.booleans())
def test_masks_only_lose_ones_and_counts_are_exact(framework, rows, cols, seed, chain, lean):
    fw = framework
    torch.manual_seed(seed)
    # heavy ties on purpose: magnitudes from a few levels
    m = fw.set_params(fw.nn.Linear(cols, rows), {"weight": torch.randint(-2, 3, (rows, cols)).float()})
    previous = torch.ones(rows, cols, dtype=torch.bool)
    for i, (method, amount, dim) in enumerate(chain):
        ones_before = int(previous.sum())
        step(m, method, amount, dim, seed + i, fw)
        mask = fw.to_torch(m.weight_mask) != 0
        assert not torch.any(mask & ~previous), "a pruned entry came back"
        if method in ("l1", "random_u"):
            assert int(mask.sum()) == ones_before - round(amount * ones_before)
        if method in ("ln", "random_s"):
            other = 1 - dim
            alive_before = int((previous.sum(dim=other) != 0).sum())
            alive = int((mask.sum(dim=other) != 0).sum())
            assert alive == alive_before - round(amount * alive_before)
        assert fw.equal(m.weight, m.weight_orig * m.weight_mask)
        previous = mask
    if lean:
        prune.l1_unstructured(m, "weight", 0, mask_dtype=fw.dtype(torch.bool))
        assert m.weight_mask.dtype == fw.dtype(torch.bool) and torch.equal(fw.to_torch(m.weight_mask), previous)
    baked = m.weight.detach().clone()
    param = m.weight_orig
    prune.remove(m, "weight")
    assert m.weight is param and fw.equal(m.weight, baked) and not prune.is_pruned(m)
    # permanent: training cannot bring back what remove baked in (the zeros are values now)
    assert int((m.weight == 0).sum()) >= int((~previous).sum())


@settings(max_examples=30, deadline=None)
@given(sizes=st.lists(st.integers(1, 40), min_size=1, max_size=4), amount=st.floats(0, 1), seed=st.integers(0, 99),
       rounds=st.integers(1, 3))
def test_global_prunes_exactly_k_of_what_remains(framework, sizes, amount, seed, rounds):
    torch.manual_seed(seed)
    mods = [framework.set_params(framework.nn.Linear(s, 3), {"weight": torch.randint(-3, 4, (3, s)).float()})
            for s in sizes]
    params = [(mod, "weight") for mod in mods]
    remaining = sum(mod.weight.numel() for mod in mods)
    for _ in range(rounds):
        prune.global_unstructured(params, prune.L1Unstructured, amount=amount)
        now = sum(int(mod.weight_mask.sum()) for mod in mods)
        assert now == remaining - round(amount * remaining)
        remaining = now
