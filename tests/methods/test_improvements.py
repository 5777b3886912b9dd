"""Each deliberate improvement over torch.nn.utils.prune: the fault in torch, and prunekit's behaviour."""

import copy
import io
import pickle

import pytest
import torch
import torch.nn.utils.prune as tprune
from torch import nn

import prunekit as prune
from prunekit import reparam
from helpers.torch_faults import torch_fault, torch_still


def held_bytes(module: nn.Module) -> int:
    """Bytes of the distinct storages a module keeps alive: parameters, buffers, attributes, hook state."""
    seen = {}

    def visit(obj, depth=0):
        if isinstance(obj, torch.Tensor):
            st = obj.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
        elif depth < 8 and isinstance(obj, (list, tuple)):
            for o in obj:
                visit(o, depth + 1)
        elif depth < 8 and isinstance(obj, dict):
            for o in obj.values():
                visit(o, depth + 1)
        elif depth < 8 and hasattr(obj, "__dict__") and not isinstance(obj, nn.Module):
            visit(vars(obj), depth + 1)

    for m in module.modules():
        visit(dict(m._parameters))
        visit(dict(m._buffers))
        visit({k: v for k, v in vars(m).items() if isinstance(v, torch.Tensor)})
        visit(list(m._forward_pre_hooks.values()))
        for entry in m.__dict__.get("_prunekit_cache", {}).values():
            visit(entry.value)
    return sum(seen.values())


# ------------------------------------------------------------ copy and save
def states():
    """A pruned model in each state torch users reach."""
    def fresh():
        m = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))
        prune.l1_unstructured(m[0], "weight", 0.5)
        prune.ln_structured(m[2], "weight", 1, n=2, dim=0)
        return m

    x = torch.randn(4, 6)
    m = fresh()
    yield "just pruned", m
    m = fresh(); m(x)
    yield "after a forward with grad", m
    m = fresh()
    with torch.no_grad():
        m(x)
    yield "after a no-grad forward", m
    m = fresh(); m(x).sum().backward()
    yield "after backward", m
    m = fresh(); prune.l1_unstructured(m[0], "weight", 0.5)
    yield "pruned twice", m


@pytest.mark.parametrize("how", ["deepcopy", "pickle", "torch.save"])
def test_copy_and_save_in_any_state(how):
    x = torch.randn(4, 6)
    for label, m in states():
        if how == "deepcopy":
            c = copy.deepcopy(m)
        elif how == "pickle":
            c = pickle.loads(pickle.dumps(m))
        else:
            buf = io.BytesIO()
            torch.save(m, buf)
            buf.seek(0)
            c = torch.load(buf, weights_only=False)
        assert prune.is_pruned(c), label
        assert torch.equal(c(x), m(x)), label
        assert c[0].weight_orig is not m[0].weight_orig, label
        # the copy is independent and keeps working: its masks still apply after an update
        with torch.no_grad():
            c[0].weight_orig.add_(1.0)
        assert torch.equal(c[0].weight, c[0].weight_orig * c[0].weight_mask), label
        assert type(c[0]).__name__ == "Linear" and isinstance(c[0], nn.Linear)
        prune.remove(c[0], "weight")
        assert type(c[0]) is nn.Linear


def test_torch_cannot_deepcopy_after_a_forward_with_grad():
    m = nn.Linear(4, 3)
    tprune.l1_unstructured(m, "weight", 0.5)
    m(torch.randn(2, 4))
    with torch_fault(RuntimeError, "deepcopy", "deepcopy of a pruned model fails after a forward with grad"):
        copy.deepcopy(m)


# -------------------------------------------------------------- channels_last
@pytest.mark.parametrize("method", ["l1", "random", "ln_then_l1"])
def test_channels_last_weights(method):
    torch.manual_seed(0)
    conv = nn.Conv2d(8, 16, 3)
    ref = copy.deepcopy(conv)  # contiguous twin for torch
    conv = conv.to(memory_format=torch.channels_last)
    assert not conv.weight.is_contiguous()
    if method == "l1":
        prune.l1_unstructured(conv, "weight", 0.5)
        tprune.l1_unstructured(ref, "weight", 0.5)
    elif method == "random":
        torch.manual_seed(1)
        prune.random_unstructured(conv, "weight", 0.5)
        torch.manual_seed(1)
        tprune.random_unstructured(ref, "weight", 0.5)
    else:
        prune.ln_structured(conv, "weight", 0.25, n=1, dim=0)
        tprune.ln_structured(ref, "weight", 0.25, n=1, dim=0)
        prune.l1_unstructured(conv, "weight", 0.5)
        tprune.l1_unstructured(ref, "weight", 0.5)
    assert torch.equal(conv.weight_mask, ref.weight_mask)
    # the mask follows the weight's layout, so the product stays channels_last
    assert conv.weight_mask.is_contiguous(memory_format=torch.channels_last)
    assert conv.weight.is_contiguous(memory_format=torch.channels_last)
    x = torch.randn(2, 8, 10, 10).to(memory_format=torch.channels_last)
    torch.testing.assert_close(conv(x), ref(x))


@pytest.mark.parametrize("fn", [tprune.l1_unstructured, tprune.random_unstructured])
def test_torch_fails_on_channels_last(fn):
    conv = nn.Conv2d(8, 16, 3).to(memory_format=torch.channels_last)
    with torch_fault(RuntimeError, "view size", f"{fn.__name__} fails on channels_last weights"):
        fn(conv, "weight", 0.5)


# ---------------------------------------------------------------- hook order
@pytest.mark.parametrize("lib", [prune, tprune], ids=["prunekit", "torch"])
def test_hook_keeps_its_place_when_pruning_twice(lib):
    m = nn.Linear(4, 3)
    seen = []
    m.register_forward_pre_hook(lambda mod, inp: seen.append("before"))
    lib.l1_unstructured(m, "weight", 0.25)
    m.register_forward_pre_hook(lambda mod, inp: seen.append("after"))
    order = lambda: ["pruning" if isinstance(h, (prune.BasePruningMethod, tprune.BasePruningMethod)) else "user"
                     for h in m._forward_pre_hooks.values()]
    assert order() == ["user", "pruning", "user"]
    lib.l1_unstructured(m, "weight", 0.25)
    if lib is prune:
        assert order() == ["user", "pruning", "user"]
    else:  # torch moves its hook to the end
        torch_still(order() == ["user", "user", "pruning"], "pruning a tensor twice moves its hook behind later ones")


# ------------------------------------------------------ MultiheadAttention
def test_pruned_out_proj_of_multihead_attention_trains():
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(8, 2)
    prune.l1_unstructured(mha.out_proj, "weight", 0.5)
    opt = torch.optim.SGD(mha.parameters(), lr=0.1)
    x = torch.randn(3, 2, 8)
    for _ in range(4):
        before = mha.out_proj.weight_orig.detach().clone()
        opt.zero_grad()
        y, _ = mha(x, x, x)
        y.pow(2).sum().backward()
        grad = mha.out_proj.weight_orig.grad
        assert torch.all(grad[mha.out_proj.weight_mask == 0] == 0)
        assert grad[mha.out_proj.weight_mask == 1].abs().sum() > 0
        opt.step()
        assert not torch.equal(before, mha.out_proj.weight_orig)
        w = mha.out_proj.weight
        assert torch.equal(w, mha.out_proj.weight_orig * mha.out_proj.weight_mask)
        assert int((w == 0).sum()) >= 32
    # the attention output uses the current masked weight
    with torch.no_grad():
        ref = nn.MultiheadAttention(8, 2)
        ref.load_state_dict(prune.dense_state_dict(mha))
        torch.testing.assert_close(mha(x, x, x)[0], ref(x, x, x)[0])


def test_torch_out_proj_goes_stale():
    mha = nn.MultiheadAttention(8, 2)
    tprune.l1_unstructured(mha.out_proj, "weight", 0.5)
    x = torch.randn(3, 2, 8)
    mha(x, x, x)[0].sum().backward()
    with torch_fault(RuntimeError, "backward through the graph a second time",
                     "a pruned out_proj of nn.MultiheadAttention goes stale"):
        mha(x, x, x)[0].sum().backward()


# ----------------------------------------------------------------- mask dtype
@pytest.mark.parametrize("scores_dtype", [torch.float16, torch.bfloat16, torch.float64, torch.int64])
def test_mask_dtype_is_the_weight_dtype_whatever_the_scores(scores_dtype):
    m = nn.Linear(6, 4)
    prune.l1_unstructured(m, "weight", 0.25)
    scores = (torch.randn(4, 6) * 10).to(scores_dtype)
    prune.l1_unstructured(m, "weight", 0.25, importance_scores=scores)
    prune.ln_structured(m, "weight", 1, n=2, dim=0, importance_scores=scores)
    assert m.weight_mask.dtype == torch.float32


def test_torch_mask_dtype_follows_the_scores():
    m = nn.Linear(6, 4)
    tprune.l1_unstructured(m, "weight", 0.25)
    tprune.l1_unstructured(m, "weight", 0.25, importance_scores=torch.randn(4, 6).half())
    torch_still(m.weight_mask.dtype == torch.float16, "the mask takes the dtype of the importance scores")


# ------------------------------------------------------ global pruning memory
@pytest.mark.parametrize("lib", [prune, tprune], ids=["prunekit", "torch"])
def test_repeated_global_pruning_keeps_no_copies(lib):
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 10))
    params = [(m, "weight") for m in model]
    sizes = []
    for _ in range(5):
        lib.global_unstructured(params, pruning_method=lib.L1Unstructured, amount=0.2)
        sizes.append(held_bytes(model))
    if lib is prune:
        assert sizes == [sizes[0]] * 5
    else:  # every call leaves a concatenated mask alive in the hooks
        torch_still(sizes[-1] > sizes[0] and sizes == sorted(sizes),
                    "every global_unstructured call leaves a concatenated mask alive")


# -------------------------------------------------------------- ln orders
ORDERS = [1, 2, 3, float("inf"), float("-inf"), "fro", "nuc"]


@pytest.mark.parametrize("n", ORDERS)
@pytest.mark.parametrize("shape", [(6, 5), (6, 5, 3), (6, 5, 3, 3)])
@pytest.mark.parametrize("dim", [0, 1, -1])
def test_ln_structured_every_order_and_rank(n, shape, dim):
    torch.manual_seed(0)
    w = torch.randn(shape)
    m = nn.Linear(1, 1)
    m.weight = nn.Parameter(w.clone())
    prune.ln_structured(m, "weight", 2, n=n, dim=dim)
    d = dim % len(shape)
    other = [i for i in range(len(shape)) if i != d]
    pruned = (m.weight_mask.sum(dim=other) == 0)
    assert int(pruned.sum()) == 2
    # the documented meaning of each order
    c = w.movedim(d, 0)
    if n == "nuc":
        expect = torch.linalg.matrix_norm(c.reshape(c.shape[0], c.shape[1], -1), ord="nuc")
    else:
        expect = torch.linalg.vector_norm(c.reshape(c.shape[0], -1), ord=2 if n == "fro" else n, dim=1)
    assert set(torch.topk(expect, 2, largest=False).indices.tolist()) == set(pruned.nonzero().view(-1).tolist())
    # where torch accepts the order, the masks are torch's
    ref = nn.Linear(1, 1)
    ref.weight = nn.Parameter(w.clone())
    try:
        tprune.ln_structured(ref, "weight", 2, n=n, dim=dim)
    except RuntimeError:
        assert (n in ("fro", "nuc")), "torch failed on an order it documents"
        return
    assert torch.equal(ref.weight_mask, m.weight_mask)


def test_torch_refuses_nuc_and_fro_on_conv_weights():
    for n in ("fro", "nuc"):
        conv = nn.Conv2d(3, 6, 3)
        with torch_fault(RuntimeError, "matrix_norm", f"ln_structured(n={n!r}) fails on conv weights"):
            tprune.ln_structured(conv, "weight", 2, n=n, dim=0)


# -------------------------------------------------------------- state dicts
def test_pruned_state_dict_into_dense_model_and_back():
    torch.manual_seed(0)
    src = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))
    prune.l1_unstructured(src[0], "weight", 0.5)
    prune.random_unstructured(src[2], "bias", 1)
    x = torch.randn(2, 6)

    dense = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))
    dense.load_state_dict(prune.dense_state_dict(src))  # baked: a plain dense model
    assert not prune.is_pruned(dense) and torch.equal(dense(x), src(x))

    again = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))
    prune.load_state_dict(again, src.state_dict())  # reparameterized as saved
    assert prune.is_pruned(again) and torch.equal(again(x), src(x))
    assert torch.equal(again[0].weight_mask, src[0].weight_mask)
    assert torch.equal(again[0].weight_orig, src[0].weight_orig)

    # and the reverse: a dense checkpoint into a pruned model keeps the model's masks
    other = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))
    prune.load_state_dict(src, other.state_dict())
    assert torch.equal(src[0].weight_orig, other[0].weight)
    assert torch.equal(src[0].weight, other[0].weight * src[0].weight_mask)


def test_torch_pruned_state_dict_does_not_load_into_a_dense_model():
    src = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))
    tprune.l1_unstructured(src[0], "weight", 0.5)
    with torch_fault(RuntimeError, "weight_orig", "a pruned state dict does not load into a dense model"):
        nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3)).load_state_dict(src.state_dict())


def test_load_state_dict_mismatch_is_clear_and_changes_nothing():
    src = nn.Linear(6, 5)
    prune.l1_unstructured(src, "weight", 0.5)
    sd = src.state_dict()
    sd["extra"] = torch.ones(1)
    dst = nn.Linear(6, 5)
    before = {k: v.clone() for k, v in dst.state_dict().items()}
    with pytest.raises(RuntimeError, match="Unexpected key.*extra"):
        prune.load_state_dict(dst, sd)
    assert not prune.is_pruned(dst) and type(dst) is nn.Linear
    assert all(torch.equal(before[k], v) for k, v in dst.state_dict().items())


# ------------------------------------------------------------- lean masks
def test_lean_boolean_masks():
    torch.manual_seed(0)
    a = nn.Linear(64, 32)
    b = copy.deepcopy(a)
    prune.l1_unstructured(a, "weight", 0.5, mask_dtype=torch.bool)
    prune.l1_unstructured(b, "weight", 0.5)
    assert a.weight_mask.dtype == torch.bool and b.weight_mask.dtype == torch.float32
    assert torch.equal(a.weight_mask, b.weight_mask.bool())
    x = torch.randn(3, 64)
    assert torch.equal(a(x), b(x))
    prune.ln_structured(a, "weight", 4, n=1, dim=0)  # a later prune keeps the lean dtype
    prune.ln_structured(b, "weight", 4, n=1, dim=0)
    assert a.weight_mask.dtype == torch.bool and torch.equal(a.weight_mask, b.weight_mask.bool())
    a(x).sum().backward()
    assert torch.all(a.weight_orig.grad[~a.weight_mask] == 0)
    assert held_bytes(a) < held_bytes(b)
    assert held_bytes(b) - held_bytes(a) == 32 * 64 * 3  # 1 byte per mask entry instead of 4
    prune.remove(a, "weight")
    assert torch.equal(a.weight, b.weight)
    prune.global_unstructured([(a, "weight"), (b, "weight")], prune.L1Unstructured, amount=0.1, mask_dtype=torch.bool)
    assert a.weight_mask.dtype == torch.bool and b.weight_mask.dtype == torch.bool


def test_bytes_held_after_pruning_against_torch():
    a, b = nn.Linear(256, 256, bias=False), nn.Linear(256, 256, bias=False)
    prune.l1_unstructured(a, "weight", 0.5)
    tprune.l1_unstructured(b, "weight", 0.5)
    w = 256 * 256 * 4
    assert held_bytes(a) == 2 * w  # orig + mask; the product is made on demand
    assert held_bytes(b) == 3 * w  # orig + mask + a stored product


# -------------------------------------------------------------- inference
def test_no_grad_forward_reuses_the_product(monkeypatch):
    calls = []
    real, real_masked = reparam.value.effective_with_grad, reparam.value.masked
    monkeypatch.setattr(reparam.value, "effective_with_grad", lambda o, m: calls.append(1) or real(o, m))  # with grad
    monkeypatch.setattr(reparam.value, "masked", lambda o, m, **k: calls.append(1) or real_masked(o, m, **k))  # no grad
    m = nn.Linear(16, 8)
    prune.l1_unstructured(m, "weight", 0.5)
    x = torch.randn(2, 16)
    with torch.no_grad():
        y1 = m(x)
        for _ in range(5):
            assert torch.equal(m(x), y1)
        assert len(calls) == 1
        # a reader outside the module's forward may write into what it gets (the write rule): while it
        # holds it, each later read checks it (one comparison with a fresh product), then serves it again
        first = m.weight
        assert m.weight is first
        del first
        calls.clear()
        m(x)  # the last check: nobody holds it any more
        m(x)
        m(x)
    assert len(calls) == 1
    calls.clear()
    with torch.inference_mode():
        m(x)
    assert len(calls) == 0
    calls.append(1)
    # an in-place change of the mask or of the weights is seen at once
    with torch.no_grad():
        m.weight_mask[0].zero_()
        assert torch.all(m(x)[:, 0] == m.bias[0])
        m.weight_orig.mul_(2)
        assert torch.equal(m.weight, m.weight_orig * m.weight_mask)
    assert len(calls) == 4  # the mask change, the weight change, and the check of the value handed out
    # with gradients on, every forward builds a fresh product
    m(x)  # (and checks, once, the value the test read above: one more comparison)
    m(x)
    assert len(calls) == 7


def test_training_gradients_reach_orig_and_are_zero_where_masked():
    torch.manual_seed(0)
    a = nn.Linear(10, 4)
    b = copy.deepcopy(a)
    prune.l1_unstructured(a, "weight", 0.6)
    tprune.l1_unstructured(b, "weight", 0.6)
    opt_a = torch.optim.SGD(a.parameters(), lr=0.1, momentum=0.9)
    opt_b = torch.optim.SGD(b.parameters(), lr=0.1, momentum=0.9)
    x = torch.randn(8, 10)
    for _ in range(3):
        for m, opt in ((a, opt_a), (b, opt_b)):
            opt.zero_grad()
            m(x).pow(2).mean().backward()
            opt.step()
        assert torch.equal(a.weight_orig.grad, b.weight_orig.grad)
        assert torch.all(a.weight_orig.grad[a.weight_mask == 0] == 0)
        assert torch.equal(a.weight, b.weight_orig * b.weight_mask)


def test_is_pruned_sees_torch_pruning_and_refuses_to_mix():
    m = nn.Linear(4, 3)
    tprune.l1_unstructured(m, "weight", 0.5)
    assert prune.is_pruned(m)
    with pytest.raises(ValueError, match="torch.nn.utils.prune"):
        prune.l1_unstructured(m, "weight", 0.5)
