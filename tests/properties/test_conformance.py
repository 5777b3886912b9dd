"""prunekit against torch.nn.utils.prune as the oracle, on randomized inputs.

Every test runs once per framework (the ``framework`` fixture): prunekit prunes
``torch.nn`` or ``tensorplay.nn`` modules holding the same weights as the
torch modules that ``torch.nn.utils.prune`` prunes, and the results, brought
back to torch, must be identical.
"""

import copy

import pytest
import torch
import torch.nn.utils.prune as tprune
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch import nn

import prunekit as prune

SETTINGS = settings(max_examples=40, deadline=None)


def distinct_weights(shape, seed):
    """Values with distinct magnitudes (no ties), random signs and order."""
    g = torch.Generator().manual_seed(seed)
    n = int(torch.tensor(shape).prod())
    mags = (torch.randperm(n, generator=g).float() + 1) / n
    signs = torch.randint(0, 2, (n,), generator=g).float() * 2 - 1
    return (mags * signs).view(shape)


def twin_linears(shape, seed, fw):
    """(prunekit's module in ``fw``, torch's module), same weights."""
    def make(nn_):
        return nn_.Linear(shape[1], shape[0]) if len(shape) == 2 else nn_.Conv2d(shape[1], shape[0], tuple(shape[2:]))
    a = make(nn)
    with torch.no_grad():
        a.weight.copy_(distinct_weights(shape, seed))
    return fw.twin(a, make), copy.deepcopy(a)


shapes = st.sampled_from([(6, 5), (16, 9), (1, 7), (8, 3, 3, 3), (4, 2, 1, 5)])
amounts = st.one_of(st.floats(0.0, 1.0), st.integers(0, 6))


def call(lib, method, module, amount, n, dim, scores=None, seed=0, fw=None):
    """Run one method; ``fw`` (prunekit's side) moves the scores in and seeds its generator."""
    if fw is not None and scores is not None:
        scores = fw.tensor(scores)
    manual_seed = fw.manual_seed if fw is not None else torch.manual_seed
    if method == "l1":
        return lib.l1_unstructured(module, "weight", amount, importance_scores=scores)
    if method == "random_u":
        manual_seed(seed)
        return lib.random_unstructured(module, "weight", amount)
    if method == "ln":
        return lib.ln_structured(module, "weight", amount, n=n, dim=dim, importance_scores=scores)
    if method == "random_s":
        manual_seed(seed)
        return lib.random_structured(module, "weight", amount, dim=dim)
    if method == "identity":
        return lib.identity(module, "weight")
    raise AssertionError(method)


def assert_same(a, b, fw):
    """prunekit's module ``a`` (in ``fw``) equals torch's ``b``: masks, dtypes, values."""
    assert fw.equal(a.weight_mask, b.weight_mask)
    assert fw.equal(a.weight, b.weight)
    assert fw.equal(a.weight_orig, b.weight_orig)


def safe_amount(amount, units):
    return amount if isinstance(amount, float) else min(amount, units)


def torch_choice_was_a_tie(theirs, before_mask, scores, n, dim):
    """The mask prunekit must give after torch's ``ln_structured`` call, if torch chose among tied norms.

    ``torch.topk``'s choice among channels with equal norms is unspecified;
    prunekit's is documented: the lowest channel index is pruned first. This
    recomputes torch's norms (on the same slice torch ranks: the channels
    still unpruned, scored by ``scores`` -- the importance scores or the
    effective weight), and returns ``None`` when torch's choice is the rule's
    choice (compare with torch), else the rule's mask, after checking that
    torch's channels and the rule's have exactly the same norms (only a tie
    can explain the difference).
    """
    after = theirs.weight_mask.detach()
    red = [d for d in range(after.dim()) if d != dim]
    alive = (before_mask.sum(dim=red) != 0).nonzero().flatten()
    pruned_by_torch = ((before_mask.sum(dim=red) != 0) & (after.sum(dim=red) == 0)).nonzero().flatten()
    k = pruned_by_torch.numel()
    if k == 0:
        return None
    norms = torch.norm(scores.index_select(dim, alive), p=n, dim=red)  # what torch ranks
    order = sorted(range(alive.numel()), key=lambda j: (norms[j].item(), j))
    rule = alive[torch.tensor(order[:k])].sort().values
    if torch.equal(rule, pruned_by_torch):
        return None
    by_channel = dict(zip(alive.tolist(), norms.tolist()))
    assert sorted(by_channel[c] for c in rule.tolist()) == sorted(by_channel[c] for c in pruned_by_torch.tolist())
    expected = before_mask.clone()
    expected.index_fill_(dim, rule, 0)
    return expected


def assert_tie_rule(ours, expected, fw):
    """prunekit's module followed the lowest-index-first rule where torch's choice among ties differs."""
    assert fw.equal(ours.weight_mask, expected)
    assert fw.equal(ours.weight, fw.to_torch(ours.weight_orig) * expected)


@SETTINGS
@given(shape=shapes, seed=st.integers(0, 10_000),
       chain=st.lists(st.tuples(st.sampled_from(["l1", "random_u", "ln", "random_s", "identity"]), amounts,
                                st.sampled_from([1, 2, float("inf"), -float("inf")]), st.integers(-2, 1)),
                      min_size=1, max_size=4))
# after l1, every row holds a zero: all -inf norms tie at 0, torch's topk picks any two channels
@example(shape=(6, 5), seed=0, chain=[("l1", 0.5, 1, 0), ("ln", 0.25, -float("inf"), 0)])
def test_chains_equal_torch(framework, shape, seed, chain):
    fw = framework
    ours, theirs = twin_linears(shape, seed, fw)
    for i, (method, amount, n, dim) in enumerate(chain):
        dim = dim % len(shape) if len(shape) >= 2 else dim
        if method in ("l1", "random_u"):
            remaining = int(ours.weight_mask.sum()) if prune.is_pruned(ours) else ours.weight.numel()
            amount = safe_amount(amount, remaining)
        else:
            amount = safe_amount(amount, shape[dim])
        before = theirs.weight_mask.detach().clone() if i else torch.ones(shape)
        scores = theirs.weight.detach().clone()
        try:
            call(tprune, method, theirs, amount, n, dim, seed=seed + i)
        except (ValueError, IndexError, RuntimeError):
            # torch refuses (e.g. int amount above the channels still unpruned): so must we
            with pytest.raises((ValueError, IndexError)):
                call(prune, method, ours, amount, n, dim, seed=seed + i, fw=fw)
            return
        call(prune, method, ours, amount, n, dim, seed=seed + i, fw=fw)
        tie = torch_choice_was_a_tie(theirs, before, scores, n, dim) if method == "ln" else None
        if tie is not None:  # torch chose among equal norms; the two modules differ from here on
            assert_tie_rule(ours, tie, fw)
            return
        assert_same(ours, theirs, fw)


@SETTINGS
@given(shape=shapes, seed=st.integers(0, 10_000), amount=amounts,
       method=st.sampled_from(["l1", "ln"]), n=st.sampled_from([1, 2, 3, float("inf")]))
def test_importance_scores_equal_torch(framework, shape, seed, amount, method, n):
    fw = framework
    ours, theirs = twin_linears(shape, seed, fw)
    scores = distinct_weights(shape, seed + 1)
    units = shape[0] if method == "ln" else ours.weight.numel()
    amount = safe_amount(amount, units)
    call(tprune, method, theirs, amount, n, 0, scores=scores)
    call(prune, method, ours, amount, n, 0, scores=scores, fw=fw)
    # the channels' norms can tie (distinct entries, equal sums): then the rule decides, not torch
    tie = torch_choice_was_a_tie(theirs, torch.ones(shape), scores, n, 0) if method == "ln" else None
    if tie is not None:
        assert_tie_rule(ours, tie, fw)
        return
    assert_same(ours, theirs, fw)
    # a second round on top, scored by the pruned weights
    call(tprune, "l1", theirs, 0.5, n, 0)
    call(prune, "l1", ours, 0.5, n, 0, fw=fw)
    assert_same(ours, theirs, fw)


@SETTINGS
@given(seed=st.integers(0, 10_000), amount=st.one_of(st.floats(0.0, 1.0), st.integers(0, 60)),
       rounds=st.integers(1, 3), method=st.sampled_from(["l1", "random"]), use_scores=st.booleans())
def test_global_equal_torch(framework, seed, amount, rounds, method, use_scores):
    fw = framework

    def make(nn_):
        return nn_.Sequential(nn_.Linear(7, 5), nn_.ReLU(), nn_.Conv1d(5, 4, 3), nn_.Linear(3, 2))

    torch.manual_seed(seed)
    b = make(nn)
    with torch.no_grad():
        flat = distinct_weights((sum(p.numel() for p in b.parameters()),), seed)
        torch.nn.utils.vector_to_parameters(flat, b.parameters())
    a = fw.twin(b, make)
    pa = [(a[0], "weight"), (a[2], "weight"), (a[3], "weight"), (a[0], "bias")]
    pb = [(b[0], "weight"), (b[2], "weight"), (b[3], "weight"), (b[0], "bias")]
    cls_a = prune.L1Unstructured if method == "l1" else prune.RandomUnstructured
    cls_b = tprune.L1Unstructured if method == "l1" else tprune.RandomUnstructured
    for r in range(rounds):
        sa = sb = None
        if use_scores:
            # distinct across all tensors, so the global ranking has no ties
            pool = distinct_weights((sum(getattr(m, n).numel() for m, n in pa),), seed + r).split(
                [getattr(m, n).numel() for m, n in pa])
            sb = {(m, n): p.view(getattr(m, n).shape) for (m, n), p in zip(pb, pool)}
            sa = {(ma, n): fw.tensor(sb[(mb, n)]) for (ma, n), (mb, _) in zip(pa, pb)}
        torch.manual_seed(seed + r)
        try:
            tprune.global_unstructured(pb, cls_b, importance_scores=sb, amount=amount)
        except ValueError:
            with pytest.raises(ValueError):
                prune.global_unstructured(pa, cls_a, importance_scores=sa, amount=amount)
            return
        fw.manual_seed(seed + r)
        prune.global_unstructured(pa, cls_a, importance_scores=sa, amount=amount)
        for (ma, n), (mb, _) in zip(pa, pb):
            assert fw.equal(getattr(ma, n + "_mask"), getattr(mb, n + "_mask"))
            assert fw.equal(getattr(ma, n), getattr(mb, n))


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 3000), k_frac=st.floats(0, 1), levels=st.integers(1, 5), seed=st.integers(0, 999))
def test_ties_prune_exact_count(framework, n, k_frac, levels, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randint(0, levels, (n,), generator=g).float() - levels // 2  # heavy ties, both signs
    m = framework.set_params(framework.nn.Linear(n, 1), {"weight": w.view(1, n)})
    k = round(k_frac * n)
    prune.l1_unstructured(m, "weight", amount=k)
    mask = framework.to_torch(m.weight_mask).view(-1)
    assert int((mask == 0).sum()) == k
    # everything pruned is no larger than anything kept
    if 0 < k < n:
        assert w.abs()[mask == 0].max() <= w.abs()[mask == 1].min()


def test_large_tensor_uses_histogram_path_and_matches_torch(framework):
    # > 65536 entries: the radix/histogram selection path
    a, b = twin_linears((300, 400), 3, framework)
    prune.l1_unstructured(a, "weight", 0.37)
    tprune.l1_unstructured(b, "weight", 0.37)
    assert_same(a, b, framework)
    prune.l1_unstructured(a, "weight", 0.5)
    tprune.l1_unstructured(b, "weight", 0.5)
    assert_same(a, b, framework)


def test_float_amount_rounds_half_to_even_like_torch():
    for size, amount in [(10, 0.25), (10, 0.35), (6, 0.25), (2, 0.25)]:
        assert prune.compute_nparams_to_prune(amount, size) == tprune._compute_nparams_toprune(amount, size)
    assert prune._compute_nparams_toprune is prune.compute_nparams_to_prune
    assert prune._validate_pruning_amount_init is prune.validate_pruning_amount_init
    assert prune._validate_pruning_amount is prune.validate_pruning_amount


def test_custom_from_mask_and_container_history_like_torch(framework):
    a, b = twin_linears((4, 3), 1, framework)
    mask = torch.tensor([[1, 0, 1], [0, 1, 1], [1, 1, 1], [0, 0, 1]])
    prune.custom_from_mask(a, "weight", framework.tensor(mask))
    tprune.custom_from_mask(b, "weight", mask)
    assert_same(a, b, framework)
    prune.l1_unstructured(a, "weight", 2)
    tprune.l1_unstructured(b, "weight", 2)
    assert_same(a, b, framework)
    hook = next(iter(a._forward_pre_hooks.values()))
    assert isinstance(hook, prune.PruningContainer)
    assert [type(h).__name__ for h in hook] == ["CustomFromMask", "L1Unstructured"]
    assert len(hook) == 2 and hook[1]._tensor_name == "weight"


def test_remove_like_torch(framework):
    a, b = twin_linears((5, 4), 2, framework)
    prune.l1_unstructured(a, "weight", 0.5)
    tprune.l1_unstructured(b, "weight", 0.5)
    param = a.weight_orig
    prune.remove(a, "weight")
    tprune.remove(b, "weight")
    assert a.weight is param  # the same Parameter object, optimizers keep working
    assert framework.equal(a.weight, b.weight)
    assert set(dict(a.named_parameters())) == set(dict(b.named_parameters()))
    assert list(a.named_buffers()) == [] and not prune.is_pruned(a)
    with pytest.raises(ValueError, match="has to be pruned"):
        prune.remove(a, "weight")


# ------------------------------------------- faults found by torch's own test/nn/test_pruning.py
@pytest.mark.parametrize("method", [tprune.L1Unstructured(amount=2), tprune.LnStructured(amount=1, n=2, dim=0),
                                    tprune.RandomUnstructured(amount=1)], ids=lambda m: type(m).__name__)
def test_container_compute_mask_has_the_tensors_dtype_with_an_integer_default_mask(method):
    """torch's PruningContainer gives ``t``'s dtype; prunekit's L1 fast path returned the mask's (int64)."""
    t = torch.tensor([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0]])
    default_mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 1]])
    ours = getattr(prune, type(method).__name__)(**{k: v for k, v in vars(method).items() if not k.startswith("_")})
    results = []
    for lib, m in ((tprune, method), (prune, ours)):
        container = lib.PruningContainer()
        container._tensor_name = m._tensor_name = "test"
        container.add_pruning_method(m)
        torch.manual_seed(0)
        results.append(container.compute_mask(t, default_mask))
    assert results[1].dtype == results[0].dtype == torch.float32
    assert torch.equal(results[1], results[0])
    assert default_mask.dtype == torch.int64 and int(default_mask.sum()) == 6  # the input is not touched


def test_rnn_flat_weights_follow_the_pruned_tensor_at_once():
    """``nn.LSTM`` computes from ``_flat_weights``; after pruning it must hold the pruned value (torch: set by
    the hook's setattr), and after ``remove`` the Parameter again -- not the unpruned Parameter until a forward."""
    torch.manual_seed(0)
    a = nn.LSTM(8, 8)
    b = copy.deepcopy(a)
    prune.l1_unstructured(a, "weight_ih_l0", 0.5)
    tprune.l1_unstructured(b, "weight_ih_l0", 0.5)
    assert sum(isinstance(p, nn.Parameter) for p in a._flat_weights) == 3
    assert torch.equal(a._flat_weights[0], b._flat_weights[0])
    x = torch.randn(3, 2, 8)
    with torch.no_grad():
        assert torch.equal(a(x)[0], b(x)[0])
    assert torch.equal(copy.deepcopy(a)(x)[0], a(x)[0])  # also after a forward with gradients
    prune.remove(a, "weight_ih_l0")
    assert sum(isinstance(p, nn.Parameter) for p in a._flat_weights) == 4
    assert a._flat_weights[0] is a.weight_ih_l0
