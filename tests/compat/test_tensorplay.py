"""TensorPlay models with the same pruning API: cross-framework equality, copies, checkpoints, training.

The shared suites (conformance, invariants, error catalogue) already run on
TensorPlay through the ``framework`` fixture; this file covers what only makes
sense with two frameworks side by side: prunekit on torch against prunekit on
TensorPlay, TensorPlay's own save/load, mixing frameworks, and the
PyTorch-only parts refusing TensorPlay models.
"""

import copy
import io
import math
import pickle

import pytest
import torch
from torch import nn

import prunekit as prune
from prunekit._backend import FrameworkMismatchError, backend_of, require_torch

tp = pytest.importorskip("tensorplay")


def to_tp(t):
    return tp.from_dlpack(t.detach().contiguous().clone())


def to_torch(t):
    return torch.from_dlpack(t.detach().contiguous()).clone()


def same(a_tp, b_torch):
    a = to_torch(a_tp)
    return a.dtype == b_torch.dtype and torch.equal(a, b_torch)


def pair(factory, seed=0):
    """The same architecture and weights in torch and TensorPlay: (torch module, tensorplay module)."""
    torch.manual_seed(seed)
    a = factory(nn)
    b = factory(tp.nn)
    params = dict(b.named_parameters())
    with tp.no_grad():
        for name, p in a.named_parameters():
            params[name].copy_(to_tp(p))
    return a, b


ORDERS = [1, 2, 3, 0.5, 0, math.inf, -math.inf, "fro", "nuc"]


@pytest.mark.parametrize("n", ORDERS)
@pytest.mark.parametrize("shape,dim", [((6, 5), 0), ((6, 5), 1), ((8, 3, 3, 3), 0), ((8, 3, 3, 3), 1), ((8, 4, 5), -1)])
def test_ln_structured_every_order_equal_across_frameworks(n, shape, dim):
    # includes the multi-dim norms TensorPlay computes by hand and 'fro'/'nuc' on conv weights
    def make(nn_):
        if len(shape) == 2:
            return nn_.Linear(shape[1], shape[0])
        if len(shape) == 3:
            return nn_.Conv1d(shape[1], shape[0], shape[2])
        return nn_.Conv2d(shape[1], shape[0], shape[2])

    a, b = pair(make, seed=hash((shape, dim)) % 1000)
    prune.ln_structured(a, "weight", amount=0.4, n=n, dim=dim)
    prune.ln_structured(b, "weight", amount=0.4, n=n, dim=dim)
    assert same(b.weight_mask, a.weight_mask)
    assert same(b.weight, a.weight)


def test_every_method_chain_scores_and_global_equal_across_frameworks():
    def make(nn_):
        return nn_.Sequential(nn_.Conv2d(3, 8, 3), nn_.ReLU(), nn_.Conv1d(8, 6, 2), nn_.Linear(5, 4))

    a, b = pair(make, seed=7)
    scores = torch.rand(8, 3, 3, 3)
    steps = [
        lambda lib, m, s: lib.l1_unstructured(m[0], "weight", 0.3),
        lambda lib, m, s: lib.ln_structured(m[0], "weight", 2, n=2, dim=0, importance_scores=s(scores)),
        lambda lib, m, s: lib.random_unstructured(m[2], "weight", 0.25),
        lambda lib, m, s: lib.random_structured(m[2], "weight", 2, dim=1),
        lambda lib, m, s: lib.l1_unstructured(m[0], "weight", 0.2, importance_scores=s(scores)),
        lambda lib, m, s: lib.custom_from_mask(m[3], "bias", s(torch.tensor([1, 0, 1, 1]))),
        lambda lib, m, s: lib.identity(m[3], "weight"),
        lambda lib, m, s: lib.global_unstructured(
            [(m[0], "weight"), (m[2], "weight"), (m[3], "weight")], lib.L1Unstructured, amount=0.5),
        lambda lib, m, s: lib.global_unstructured(
            [(m[0], "bias"), (m[2], "bias")], lib.RandomUnstructured, amount=3),
        lambda lib, m, s: lib.global_unstructured(
            [(m[0], "weight"), (m[3], "weight")], lib.L1Unstructured, amount=0.1,
            importance_scores={(m[0], "weight"): s(scores)}),
    ]
    for i, step in enumerate(steps):
        torch.manual_seed(i)
        step(prune, a, lambda t: t)
        tp.manual_seed(i)
        step(prune, b, to_tp)
        for name, buf in a.named_buffers():
            assert same(dict(b.named_buffers())[name], buf), (i, name)
        for (qual, mod_a), (_, mod_b) in zip(a.named_modules(), b.named_modules()):
            for name in prune.reparam.pruned_names(mod_a):
                assert same(getattr(mod_b, name), getattr(mod_a, name)), (i, qual, name)
    def history(m):
        return [(h._tensor_name, [type(x).__name__ for x in getattr(h, "_pruning_methods", (h,))])
                for h in m._forward_pre_hooks.values()]

    assert history(b[0]) == history(a[0]) == [
        ("weight", ["L1Unstructured", "LnStructured", "L1Unstructured", "CustomFromMask", "CustomFromMask"]),
        ("bias", ["CustomFromMask"])]
    x = torch.randn(2, 5)
    assert torch.allclose(to_torch(b[3](to_tp(x))), a[3](x).detach())


def test_lean_bool_masks_and_torch_dtype_spelling():
    a, b = pair(lambda nn_: nn_.Linear(16, 8))
    prune.l1_unstructured(a, "weight", 0.5, mask_dtype=torch.bool)
    prune.l1_unstructured(b, "weight", 0.5, mask_dtype=torch.bool)  # torch spelling, taken as tensorplay.bool
    assert b.weight_mask.dtype == tp.bool
    assert same(b.weight_mask, a.weight_mask) and same(b.weight, a.weight)
    prune.l1_unstructured(b, "weight", 0.5, mask_dtype=tp.bool)
    assert b.weight_mask.dtype == tp.bool and int((b.weight_mask == 0).sum()) == 96


def test_tensors_stay_tensorplay_and_the_class_is_a_subclass():
    m = prune.l1_unstructured(tp.nn.Linear(64, 32, bias=False), name="weight", amount=0.3)
    for t in (m.weight, m.weight_mask, m.weight_orig):
        assert isinstance(t, tp.Tensor) and backend_of(t).name == "tensorplay"
    assert isinstance(m.weight_orig, tp.nn.Parameter)
    assert isinstance(m, tp.nn.Linear) and type(m) is not tp.nn.Linear and type(m).__name__ == "Linear"
    assert prune.base_class(m) is tp.nn.Linear and prune.is_pruned(m)
    assert int((m.weight_mask == 0).sum()) == 614
    with pytest.raises(AttributeError, match="tensorplay.no_grad"):
        m.weight = tp.ones(32, 64)


@pytest.mark.parametrize("how", ["deepcopy", "pickle", "tp.save module state", "tp.save file"])
def test_copy_save_load_and_remove(how, tmp_path):
    src = tp.nn.Sequential(tp.nn.Conv2d(3, 4, 3), tp.nn.Flatten(), tp.nn.Linear(64, 5))
    prune.ln_structured(src[0], "weight", 1, n=2, dim=0)
    prune.l1_unstructured(src[2], "weight", 0.5, mask_dtype=tp.bool)
    x = tp.randn(2, 3, 6, 6)
    expected = to_torch(src(x))
    if how == "deepcopy":
        dst = copy.deepcopy(src)
    elif how == "pickle":
        dst = pickle.loads(pickle.dumps(src))
    else:
        buf = io.BytesIO() if how == "tp.save module state" else str(tmp_path / "ckpt.pt")
        tp.save(src.state_dict(), buf)
        if isinstance(buf, io.BytesIO):
            buf.seek(0)
        sd = tp.load(buf)
        assert sorted(sd) == sorted(src.state_dict())
        dst = tp.nn.Sequential(tp.nn.Conv2d(3, 4, 3), tp.nn.Flatten(), tp.nn.Linear(64, 5))
        prune.load_state_dict(dst, sd)
    assert prune.is_pruned(dst) and dst[2].weight_mask.dtype == tp.bool
    assert torch.equal(to_torch(dst(x)), expected)
    assert same(dst[0].weight_mask, to_torch(src[0].weight_mask))
    # the copy is independent: changing it leaves the source alone
    with tp.no_grad():
        dst[0].weight_orig.copy_(tp.ones(4, 3, 3, 3))
    assert torch.equal(to_torch(src(x)), expected)
    # remove bakes the mask in, same Parameter object
    param = dst[2].weight_orig
    baked = to_torch(dst[2].weight)
    prune.remove(dst[2], "weight")
    prune.remove(dst[0], "weight")
    assert dst[2].weight is param and torch.equal(to_torch(dst[2].weight), baked)
    assert not prune.is_pruned(dst) and int((dst[2].weight == 0).sum()) == 160  # 0.5 of 5 x 64
    assert sorted(dst.state_dict()) == sorted(tp.nn.Sequential(
        tp.nn.Conv2d(3, 4, 3), tp.nn.Flatten(), tp.nn.Linear(64, 5)).state_dict())


def test_dense_state_dict_loads_into_a_plain_tensorplay_model():
    m = prune.l1_unstructured(tp.nn.Linear(4, 2), "weight", amount=3)
    sd = prune.dense_state_dict(m)
    assert sorted(sd) == ["bias", "weight"] and int((sd["weight"] == 0).sum()) == 3
    plain = tp.nn.Linear(4, 2)
    plain.load_state_dict(sd)
    assert torch.equal(to_torch(plain.weight), to_torch(m.weight))


def test_cached_product_follows_in_place_changes():
    m = prune.l1_unstructured(tp.nn.Linear(6, 4), "weight", amount=12)
    with tp.no_grad():
        first = m.weight
        assert m.weight is first  # reused under no_grad
        m.weight_orig.copy_(tp.ones(4, 6))
        assert int((m.weight == 1).sum()) == 12  # recomputed after the in-place change
        m.weight_mask.copy_(tp.ones(4, 6))
        assert int((m.weight == 1).sum()) == 24
    with tp.inference_mode():
        assert int((m.weight == 1).sum()) == 24


def test_training_keeps_pruned_entries_at_zero_and_gradients_masked():
    tp.manual_seed(0)
    model = tp.nn.Sequential(tp.nn.Linear(8, 16), tp.nn.ReLU(), tp.nn.Linear(16, 2))
    prune.global_unstructured([(model[0], "weight"), (model[2], "weight")], prune.L1Unstructured, amount=0.6)
    pruned = [to_torch(model[0].weight_mask) == 0, to_torch(model[2].weight_mask) == 0]
    opt = tp.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = tp.randn(32, 8), tp.randn(32, 2)
    losses = []
    for _ in range(20):
        opt.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        grad = to_torch(model[0].weight_orig.grad)
        assert torch.all(grad[pruned[0]] == 0)
        opt.step()
        losses.append(float(loss.item()))
    assert losses[-1] < losses[0]
    for layer, p in zip((model[0], model[2]), pruned):
        assert torch.all(to_torch(layer.weight)[p] == 0)
        assert isinstance(layer.weight_orig, tp.nn.Parameter)


def test_lstm_and_embedding_weights():
    lstm = tp.nn.LSTM(4, 5)
    prune.l1_unstructured(lstm, "weight_hh_l0", 0.5)
    prune.ln_structured(lstm, "weight_ih_l0", 5, n=1, dim=0)
    out = lstm(tp.randn(3, 2, 4))[0]
    assert tuple(out.shape) == (3, 2, 5)
    assert int((lstm.weight_hh_l0 == 0).sum()) == 50
    rows_zero = (to_torch(lstm.weight_ih_l0) == 0).all(dim=1)
    assert int(rows_zero.sum()) == 5 and int((to_torch(lstm.weight_ih_l0) == 0).sum()) == 5 * 4
    emb = prune.random_structured(tp.nn.Embedding(10, 4), "weight", 3, dim=0)
    assert int((to_torch(emb.weight_mask).sum(1) == 0).sum()) == 3


@pytest.mark.parametrize("call,words", [
    (lambda m: prune.l1_unstructured(m, "weight", 0.5, importance_scores=torch.ones(3, 4)),
     ["Linear", "weight", "torch tensor", "tensorplay module", "tensorplay.from_dlpack"]),
    (lambda m: prune.custom_from_mask(m, "weight", torch.ones(3, 4)), ["Linear", "weight", "torch tensor"]),
    (lambda m: prune.global_unstructured([(m, "weight"), (nn.Linear(2, 2), "weight")], prune.L1Unstructured, amount=1),
     ["parameters[1]", "torch", "tensorplay"]),
    (lambda m: prune.global_unstructured([(m, "weight")], prune.L1Unstructured, amount=1,
                                         importance_scores={(m, "weight"): torch.ones(3, 4)}),
     ["Linear", "weight", "torch tensor"]),
])
def test_mixing_frameworks_is_refused_clearly_and_changes_nothing(call, words):
    m = tp.nn.Linear(4, 3)
    prune.l1_unstructured(m, "weight", 2)
    before = (type(m), dict(m._parameters), dict(m._buffers), dict(m._forward_pre_hooks), to_torch(m.weight_mask))
    with pytest.raises(TypeError) as info:
        call(m)
    assert isinstance(info.value, FrameworkMismatchError)
    for word in words:
        assert word in str(info.value), (word, str(info.value))
    after = (type(m), dict(m._parameters), dict(m._buffers), dict(m._forward_pre_hooks), to_torch(m.weight_mask))
    assert before[:4] == after[:4] and torch.equal(before[4], after[4])


def test_pytorch_only_parts_say_so():
    m = tp.nn.Linear(4, 3)
    with pytest.raises(TypeError, match="prunekit.compact works on PyTorch models only; got a tensorplay Linear"):
        require_torch(m, "prunekit.compact")
    require_torch(nn.Linear(4, 3), "prunekit.compact")  # torch models pass


@pytest.mark.parametrize("feature", ["compact", "prune_groups", "sparsify_for_inference", "save_compressed"])
def test_pytorch_only_packages_refuse_tensorplay_models(feature, tmp_path):
    m = prune.l1_unstructured(tp.nn.Linear(4, 3), "weight", 0.5)
    if feature == "compact":
        from prunekit.compact import compact as fn
        call = lambda: fn(m, tp.randn(1, 4))  # noqa: E731
    elif feature == "prune_groups":
        from prunekit.compact import prune_groups as fn
        call = lambda: fn(m, tp.randn(1, 4), 0.5)  # noqa: E731
    elif feature == "sparsify_for_inference":
        from prunekit.sparse import sparsify_for_inference as fn
        call = lambda: fn(m)  # noqa: E731
    else:
        from prunekit.sparse import save_compressed as fn
        call = lambda: fn(m, tmp_path / "x.safetensors")  # noqa: E731
    with pytest.raises(TypeError, match="works on PyTorch models only; got a tensorplay Linear"):
        call()
    assert prune.is_pruned(m) and int((m.weight_mask == 0).sum()) == 6
