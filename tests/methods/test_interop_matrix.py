"""Pruned models go wherever dense models go: the write rule and the compatibility matrix.

Every row prunes a small conv + batchnorm + linear model (or one layer) with
``l1_unstructured`` and checks the operation's result against the
dense-equivalent model (the same weights with the masks baked in by
``prunekit.remove``). Where torch.nn.utils.prune fails the same operation,
the row says so in ``TORCH``.
"""

import copy

import pytest
import torch
from torch import nn

import prunekit
from prunekit import reparam

# torch.nn.utils.prune's column where it differs (recorded from torch 2.13, for the README's table)
TORCH = {
    "write through name": "discarded at the next forward (the hook recomputes name)",
    "nn.Parameter assigned to name": "TypeError at the next forward",
    "torch.jit.script": "fails",
    "torch.ao.quantization.fuse_modules": "fails after a forward with gradients (deepcopy of the hook's product)",
}


def _model(seed=0):
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 5))
    with torch.no_grad():
        m[1].running_mean.uniform_(-1, 1)
        m[1].running_var.uniform_(0.5, 2)
    return m.eval()


def _pruned(seed=0):
    m = _model(seed)
    prunekit.l1_unstructured(m[0], "weight", 0.5)
    prunekit.l1_unstructured(m[4], "weight", 0.5)
    return m


def _dense_equivalent(m):
    d = copy.deepcopy(m)
    for _, sub, name in list(reparam.iter_masked(d)):
        prunekit.remove(sub, name)
    return d


X = torch.randn(2, 3, 8, 8)


# ------------------------------------------------------------------ the write rule
WRITES = {
    "mul_": lambda lin: lin.weight.mul_(2),
    ".data +=": lambda lin: lin.weight.data.__iadd__(0.5),
    ".data.copy_": lambda lin: lin.weight.data.copy_(torch.full_like(lin.weight_orig, 3.0)),
    ".data =": lambda lin: setattr(lin.weight, "data", torch.full_like(lin.weight_orig, 4.0)),
    "= nn.Parameter": lambda lin: setattr(lin, "weight", nn.Parameter(torch.full_like(lin.weight_orig, 5.0))),
}


def _expected(kind, before):
    """What name_orig holds after the write, at the unpruned entries."""
    return {"mul_": before * 2, ".data +=": before + 0.5, ".data.copy_": torch.full_like(before, 3.0),
            ".data =": torch.full_like(before, 4.0), "= nn.Parameter": torch.full_like(before, 5.0)}[kind]


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
@pytest.mark.parametrize("kind", list(WRITES))
def test_a_write_through_the_pruned_name_lands_in_orig_and_stays_pruned(kind, grad):
    lin = nn.Linear(6, 4)
    prunekit.l1_unstructured(lin, "weight", 0.5)
    x = torch.randn(3, 6)
    with torch.no_grad():
        lin(x)  # a cached value exists (the forward's own)
    orig, mask = lin.weight_orig, lin.weight_mask
    before = orig.detach().clone()
    keep = mask != 0
    if grad and kind == "mul_":
        kind_op = WRITES[".data +="]  # in-place on a tensor that requires grad: torch refuses mul_ itself
        want = before + 0.5
    else:
        kind_op, want = WRITES[kind], _expected(kind, before)
    with torch.set_grad_enabled(grad):
        kind_op(lin)
    with torch.no_grad():
        y = lin(x)
    assert lin.weight_orig is orig and lin.weight_mask is mask  # the same Parameter: optimizers keep working
    assert torch.equal(orig.detach()[keep], want[keep])  # written where unpruned...
    assert torch.equal(orig.detach()[~keep], before[~keep])  # ...and pruned entries keep what they held
    eff = reparam.masked(orig.detach(), mask)
    assert torch.equal(lin.weight.detach(), eff) and int((lin.weight == 0).sum()) >= int((~keep).sum())
    assert torch.equal(y, nn.functional.linear(x, eff, lin.bias))
    assert torch.equal(lin.state_dict()["weight_orig"], orig.detach())
    assert torch.equal(prunekit.dense_state_dict(lin)["weight"], eff)


def test_writes_are_seen_by_state_dict_copy_and_remove_without_a_forward():
    lin = nn.Linear(4, 3)
    prunekit.custom_from_mask(lin, "weight", torch.tensor([[1, 0, 1, 0]] * 3))
    with torch.no_grad():
        lin.weight.data.copy_(torch.ones(3, 4))
    assert lin.state_dict()["weight_orig"][:, 0].tolist() == [1.0, 1.0, 1.0]
    assert copy.deepcopy(lin).weight_orig[:, 2].tolist() == [1.0, 1.0, 1.0]
    with torch.no_grad():
        lin.weight.data.mul_(3)
    prunekit.remove(lin, "weight")
    assert lin.weight.tolist() == [[3.0, 0.0, 3.0, 0.0]] * 3


def test_assigning_the_wrong_shape_is_a_clear_error_and_changes_nothing():
    lin = nn.Linear(4, 3)
    prunekit.l1_unstructured(lin, "weight", 0.5)
    before = lin.weight_orig.detach().clone()
    with pytest.raises(TypeError, match=r"Linear.*weight.*\(3, 4\).*\(4, 4\).*prunekit.remove"):
        lin.weight = nn.Parameter(torch.ones(4, 4))
    assert torch.equal(lin.weight_orig, before)


def test_no_grad_forward_stays_cached_while_nobody_else_reads():
    lin = nn.Linear(8, 8)
    prunekit.l1_unstructured(lin, "weight", 0.5)
    x = torch.randn(2, 8)
    with torch.no_grad():
        lin(x)
        first = lin.__dict__["_prunekit_cache"]["weight"].value
        for _ in range(3):
            lin(x)
        assert lin.__dict__["_prunekit_cache"]["weight"].value is first
        assert not lin.__dict__["_prunekit_cache"]["weight"].exposed


# ------------------------------------------------------------------ the matrix
def test_jit_trace_with_default_checks():
    m = _pruned()
    traced = torch.jit.trace(m, X)  # check_trace=True: two traces must agree (the cache is never a constant)
    assert torch.equal(traced(X), _dense_equivalent(m)(X))
    with torch.no_grad():
        m[4].weight_orig.mul_(2)  # the traced graph reads weight_orig and weight_mask, not a frozen copy
        assert torch.allclose(traced(X), m(X))


def test_jit_script_is_a_clear_error():
    m = _pruned()
    with pytest.raises(TypeError, match=r"torch.jit.script.*Conv2d.*\['weight'\].*torch.jit.trace.*torch.export.*remove"):
        torch.jit.script(m)


def test_fuse_conv_bn_eval_keeps_the_conv_pruned_with_the_same_zeros():
    m = _pruned()
    fused = torch.nn.utils.fusion.fuse_conv_bn_eval(m[0], m[1])
    assert prunekit.is_pruned(fused) and torch.equal(fused.weight_mask, m[0].weight_mask)
    with torch.no_grad():
        assert torch.equal(fused.weight == 0, m[0].weight_mask == 0) or bool(
            ((fused.weight == 0) >= (m[0].weight_mask == 0)).all())
        assert torch.allclose(fused(X), m[1](m[0](X)), atol=1e-5)
        dense = _dense_equivalent(m)
        assert torch.allclose(fused(X), dense[1](dense[0](X)), atol=1e-5)


def _fusable(seed=0):
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 5),
                      nn.ReLU())
    with torch.no_grad():
        m[1].running_mean.uniform_(-1, 1)
        m[1].running_var.uniform_(0.5, 2)
        m[1].weight.uniform_(-2, 2)  # negative scales too: pruned zeros must stay +0 / zero after the fold
    m.eval()
    prunekit.l1_unstructured(m[0], "weight", 0.5)
    prunekit.l1_unstructured(m[4], "weight", 0.5)
    return m


FUSIONS = {
    "conv+bn+relu": ([["0", "1", "2"]], "ConvReLU2d"),
    "conv+bn": ([["0", "1"]], "Conv2d"),
    "linear+relu": ([["4", "5"]], "LinearReLU"),
    "both": ([["0", "1", "2"], ["4", "5"]], "ConvReLU2d"),
}


def test_torch_fuse_modules_refuses_a_pruned_layer():
    """torch looks the fuser method up by the exact class; the pruned subclass is not in its table."""
    for groups, _ in FUSIONS.values():
        with pytest.raises(AssertionError, match="did not find fuser method"):
            torch.ao.quantization.fuse_modules(_fusable(), groups)


def _head(fused, path):
    mod = fused.get_submodule(path)
    return mod[0] if isinstance(mod, nn.Sequential) else mod  # nni.ConvReLU2d / LinearReLU hold it at [0]


@pytest.mark.parametrize("via", ["prunekit.fuse_modules", "fuser_func"])
@pytest.mark.parametrize("what", list(FUSIONS))
def test_fuse_modules_keeps_the_fused_layers_pruned_and_equals_fusing_the_dense_equivalent(what, via):
    m = _fusable()
    groups, kind = FUSIONS[what]
    masks = {p: reparam.get_mask(m.get_submodule(p), "weight").clone() for p in ("0", "4")}
    if via == "fuser_func":
        fused = torch.ao.quantization.fuse_modules(m, groups, fuser_func=prunekit.fuse_known_modules)
    else:
        fused = prunekit.fuse_modules(m, groups)
    reference = torch.ao.quantization.fuse_modules(_dense_equivalent(m), groups)  # torch on the dense model
    assert type(fused.get_submodule(groups[0][0])).__name__ == kind
    with torch.no_grad():
        assert torch.equal(fused(X), reference(X))
        for group in groups:
            head = _head(fused, group[0])
            mask = masks[group[0]]
            assert prunekit.is_pruned(head) and torch.equal(head.weight_mask, mask)  # the same zeros
            assert torch.equal(head.weight, _head(reference, group[0]).weight)
            assert int((head.weight[mask == 0] != 0).sum()) == 0
            assert type(reparam.find_hook(head, "weight")[1]).__name__ == "L1Unstructured"  # its own method
    assert prunekit.is_pruned(m[0]) and type(m[1]).__name__ == "BatchNorm2d"  # inplace=False: m untouched


def test_fuse_modules_inplace_keeps_the_pruned_module_itself_where_fusion_keeps_it():
    m = _fusable()
    lin, orig = m[4], m[4].weight_orig
    with torch.no_grad():
        expected = m(X)
    out = prunekit.fuse_modules(m, [["0", "1", "2"], ["4", "5"]], inplace=True)
    assert out is m and m[4][0] is lin and lin.weight_orig is orig  # LinearReLU holds the pruned Linear
    assert type(m[5]).__name__ == "Identity" and prunekit.is_pruned(m[0][0])
    with torch.no_grad():
        assert torch.allclose(m(X), expected, atol=1e-5)
    # a pruned tensor that fusion shifts (a conv bias folded with the batchnorm) is fused as its value
    m = _fusable()
    prunekit.l1_unstructured(m[0], "bias", 2)
    fused = prunekit.fuse_modules(m, [["0", "1"]])
    assert reparam.pruned_names(fused[0]) == frozenset({"weight"})
    with torch.no_grad():
        assert torch.equal(fused(X), torch.ao.quantization.fuse_modules(_dense_equivalent(m), [["0", "1"]])(X))


def test_fuse_modules_qat_keeps_the_pruned_conv_in_the_qat_group():
    m = _fusable().train()
    conv = m[0]
    fused = prunekit.fuse_modules_qat(m, [["0", "1", "2"]])
    assert type(fused[0]).__name__ == "ConvBnReLU2d" and prunekit.is_pruned(fused[0][0])
    assert torch.equal(fused[0][0].weight_mask, conv.weight_mask) and fused[0][0] is not conv  # a copy


def test_fuse_modules_inplace_is_all_or_nothing():
    m = _fusable()
    before = (list(m._modules.items()), m[0].weight_orig.detach().clone())
    with pytest.raises(AssertionError, match="did not find fuser method"):  # the second group cannot fuse
        prunekit.fuse_modules(m, [["0", "1", "2"], ["3", "4"]], inplace=True)
    assert list(m._modules.items()) == before[0] and torch.equal(m[0].weight_orig, before[1])


@pytest.mark.parametrize("param", ["weight_norm", "spectral_norm", "orthogonal"])
def test_parametrizing_name_orig_of_a_pruned_tensor_keeps_it_pruned(param):
    torch.manual_seed(0)
    lin = nn.Linear(4, 4)
    prunekit.l1_unstructured(lin, "weight", 0.5)
    zeros = lin.weight_mask == 0
    getattr(nn.utils.parametrizations, param)(lin, "weight_orig")
    lin.eval()  # spectral_norm runs a power iteration at each read while training
    with torch.no_grad():
        w = lin.weight
        assert bool((w[zeros] == 0).all())
        x = torch.randn(2, 4)
        assert torch.allclose(lin(x), nn.functional.linear(x, lin.weight_orig * lin.weight_mask, lin.bias))


def test_parametrizing_the_pruned_name_and_pruning_a_parametrized_tensor_are_clear_errors():
    lin = nn.Linear(4, 3)
    prunekit.l1_unstructured(lin, "weight", 0.5)
    with pytest.raises(ValueError, match="weight"):  # torch's own message: 'weight' is not a parameter
        nn.utils.parametrizations.weight_norm(lin, "weight")
    other = nn.Linear(4, 3)
    nn.utils.parametrizations.weight_norm(other, "weight")
    with pytest.raises(ValueError, match=r"Linear.*weight is parametrized.*parametrizations.weight.*original"):
        prunekit.l1_unstructured(other, "weight", 0.5)
    assert not prunekit.is_pruned(other)
    prunekit.l1_unstructured(other.parametrizations.weight, "original0", 0.5)  # the way the error names
    assert prunekit.is_pruned(other)


def test_functional_call_export_and_load_assign():
    m = _pruned()
    dense = _dense_equivalent(m)
    params = {k: v.detach() * 1 for k, v in m.state_dict().items()}
    assert torch.equal(torch.func.functional_call(m, params, (X,)), dense(X))
    ep = torch.export.export(m, (X,))
    assert torch.allclose(ep.module()(X), dense(X), atol=1e-6)
    fresh = _pruned(seed=1)
    fresh.load_state_dict(m.state_dict(), assign=True)
    with torch.no_grad():
        assert torch.equal(fresh(X), dense(X))


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_torch_compile_fullgraph_inference_and_training(backend):
    """No graph break (the pruned property never inspects frames while compiling); a compiled training step
    gives the eager step's gradients."""
    torch._dynamo.reset()
    m = _pruned()
    dense = _dense_equivalent(m)
    compiled = torch.compile(m, fullgraph=True, backend=backend)
    with torch.no_grad():
        assert torch.equal(compiled(X), dense(X))
    compiled(X).square().sum().backward()
    grads = [m[0].weight_orig.grad.clone(), m[4].weight_orig.grad.clone()]
    m.zero_grad()
    m(X).square().sum().backward()
    assert torch.allclose(grads[0], m[0].weight_orig.grad) and torch.allclose(grads[1], m[4].weight_orig.grad)
    assert int((grads[1][m[4].weight_mask == 0] != 0).sum()) == 0  # no gradient reaches pruned entries
    torch._dynamo.reset()


def test_torch_compile_sees_writes_through_the_pruned_name_once_they_are_synced():
    """The compiled graph reads weight_orig and weight_mask. An assignment (``m.weight = ...``) lands in
    weight_orig at once; an in-place write into a value read from ``m.weight`` (``mul_``, ``.data.copy_``)
    lands there at the module's next eager access (a read of weight/weight_orig, state_dict, an eager
    forward) or at ``prunekit.reparam.sync(module)`` -- the compiled model runs no Python that could see it."""
    torch._dynamo.reset()
    m = _pruned()
    compiled = torch.compile(m, fullgraph=True, backend="eager")
    with torch.no_grad():
        compiled(X)
        m[4].weight = nn.Parameter(m[4].weight * 2)  # an assignment: weight_orig changes now
        assert torch.equal(compiled(X), _dense_equivalent(m)(X))
        before = compiled(X)
        m[4].weight.mul_(3)  # an in-place write into the handed-out value: pending until the next access
        assert torch.equal(compiled(X), before)  # the compiled graph has not seen it yet (documented)
        reparam.sync(m[4])
        after = compiled(X)
        assert not torch.equal(after, before) and torch.equal(after, _dense_equivalent(m)(X))
        assert prunekit.is_pruned(m[4]) and int((m[4].weight[m[4].weight_mask == 0] != 0).sum()) == 0
    torch._dynamo.reset()


def test_accelerate_empty_weights_then_a_pruned_state_dict():
    accelerate = pytest.importorskip("accelerate")
    src = _pruned()
    sd = src.state_dict()
    with torch.no_grad():
        want = src(X)
    # a dense model built without weights: prunekit.load_state_dict(assign=True) installs the saved masks
    with accelerate.init_empty_weights():
        empty = _model()
    assert empty[0].weight.is_meta
    prunekit.load_state_dict(empty, sd, assign=True)
    assert prunekit.is_pruned(empty[0]) and not empty[0].weight_orig.is_meta
    with torch.no_grad():
        assert torch.equal(empty.eval()(X), want)
    # pruning by value needs values: a clear error naming what to do; the structure can be installed on meta
    with accelerate.init_empty_weights():
        empty = _model()
    with pytest.raises(ValueError, match=r"Conv2d.*weight.*meta device.*custom_from_mask.*assign=True"):
        prunekit.l1_unstructured(empty[0], "weight", 0.5)
    assert not prunekit.is_pruned(empty[0])
    for i in (0, 4):
        prunekit.custom_from_mask(empty[i], "weight", torch.ones_like(empty[i].weight))
    empty.load_state_dict(sd, assign=True)  # torch's own loader, now that the keys match
    with torch.no_grad():
        assert torch.equal(empty.eval()(X), want)


def test_accelerate_load_checkpoint_and_dispatch_of_a_pruned_checkpoint(tmp_path):
    accelerate = pytest.importorskip("accelerate")
    safetensors_torch = pytest.importorskip("safetensors.torch")
    src = _pruned()
    path = str(tmp_path / "pruned.safetensors")
    safetensors_torch.save_file({k: v.contiguous() for k, v in src.state_dict().items()}, path)
    with torch.no_grad():
        want = src(X)
    with accelerate.init_empty_weights():
        empty = _model()
    for i in (0, 4):  # the pruning structure first (meta masks), then accelerate fills every tensor
        prunekit.custom_from_mask(empty[i], "weight", torch.ones_like(empty[i].weight))
    model = accelerate.load_checkpoint_and_dispatch(empty, path, device_map={"": "cpu"})
    with torch.no_grad():
        assert torch.equal(model.eval()(X), want)
    assert torch.equal(model[4].weight_mask, src[4].weight_mask)


def test_lora_on_a_pruned_base_trains_and_merges_sparse():
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    prunekit.l1_unstructured(base[0], "weight", 0.5)
    zeros = base[0].weight_mask == 0
    model = peft.get_peft_model(base, peft.LoraConfig(r=2, target_modules=["0"], lora_alpha=4))
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    x, y = torch.randn(16, 8), torch.randn(16, 4)
    for _ in range(3):
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    layer = model.base_model.model[0]
    delta = layer.get_delta_weight("default").detach()
    assert bool((delta != 0).any())
    merged = model.merge_and_unload()
    lin = merged[0]
    assert prunekit.is_pruned(lin) and torch.equal(lin.weight_mask == 0, zeros)
    with torch.no_grad():
        assert bool((lin.weight[zeros] == 0).all())  # the merged update is masked: the base stays sparse
        # the merge landed in weight_orig where unpruned
        expected = reparam.masked(base[0].weight_orig.detach(), base[0].weight_mask)
        assert torch.equal(lin.weight, expected)


def _lora_model(peft, masked):
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    pruned = prunekit.l1_unstructured(base[0], "weight", 0.5)
    model = peft.get_peft_model(base, peft.LoraConfig(r=2, target_modules=["0"], lora_alpha=4))
    if masked:
        from prunekit.compat.peft import mask_lora_updates

        assert mask_lora_updates(model) == 1
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    x, y = torch.randn(16, 8), torch.randn(16, 4)
    for _ in range(3):
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return pruned, model, x


def test_lora_unmerged_differs_from_merged_by_the_update_at_pruned_entries():
    """Plain LoRA trains the dense update ΔW; the merge keeps the base sparse, so it drops ΔW at pruned entries:
    merged - unmerged = -(ΔW ⊙ (1 - M)) x at the adapted layer."""
    peft = pytest.importorskip("peft")
    pruned, model, x = _lora_model(peft, masked=False)
    layer = model.base_model.model[0]
    delta = layer.get_delta_weight("default").detach()
    mask = pruned.weight_mask
    with torch.no_grad():
        hidden_unmerged = layer(x)
        assert bool((delta[mask == 0] != 0).any())  # the adapter learned updates at pruned entries...
        merged = model.merge_and_unload()
        hidden_merged = merged[0](x)
    dropped = nn.functional.linear(x, delta * (1 - mask))  # ...which the merge drops
    assert torch.allclose(hidden_unmerged - hidden_merged, dropped, atol=1e-5)
    assert not torch.allclose(hidden_unmerged, hidden_merged, atol=1e-3)


def test_lora_with_masked_updates_gives_the_merged_output_before_the_merge():
    """The issue's flow: pruned base at 50%, a few adapter steps, merge: the merged weight has exactly the base's
    zeros and the model's output equals the unmerged adapted model's (prunekit.compat.peft.mask_lora_updates)."""
    peft = pytest.importorskip("peft")
    pruned, model, x = _lora_model(peft, masked=True)
    layer = model.base_model.model[0]
    zeros = pruned.weight_mask == 0
    assert layer.lora_A["default"].weight.grad is not None  # the adapter trained
    with torch.no_grad():
        unmerged = model(x)
        merged_model = model.merge_and_unload()
        merged = merged_model(x)
        lin = merged_model[0]
        assert prunekit.is_pruned(lin) and torch.equal(lin.weight_mask == 0, zeros)
        assert int((lin.weight[zeros] != 0).sum()) == 0 and int((lin.weight == 0).sum()) == int(zeros.sum())
    assert torch.allclose(unmerged, merged, atol=1e-6)


def test_mask_lora_updates_refuses_merged_or_variant_adapters():
    peft = pytest.importorskip("peft")
    from prunekit.compat.peft import mask_lora_updates

    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(8, 8))
    prunekit.l1_unstructured(base[0], "weight", 0.5)
    dora = peft.get_peft_model(base, peft.LoraConfig(r=2, target_modules=["0"], use_dora=True))
    with pytest.raises(ValueError, match=r"0: adapter 'default' already uses the LoRA variant Dora"):
        mask_lora_updates(dora)
    base = nn.Sequential(nn.Linear(8, 8))
    prunekit.l1_unstructured(base[0], "weight", 0.5)
    model = peft.get_peft_model(base, peft.LoraConfig(r=2, target_modules=["0"]))
    model.merge_adapter()
    with pytest.raises(ValueError, match="merged into the pruned base; unmerge them first"):
        mask_lora_updates(model)
    assert "default" not in model.base_model.model[0].lora_variant
