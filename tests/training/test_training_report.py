import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import prunekit
from prunekit.report import model_report
from prunekit.training import LayerSparsity, MagnitudePruner, sparsity_report


def test_report_elementwise_and_blockwise(framework):
    fw = framework
    model = fw.nn.Sequential(fw.nn.Linear(8, 4), fw.nn.ReLU(), fw.nn.Linear(4, 2, bias=False))
    with fw.no_grad():
        model[0].weight.fill_(1.0)
        model[0].bias.fill_(1.0)
        model[2].weight.fill_(1.0)
    mask = torch.ones(4, 8)
    mask[:, :4] = 0  # 16 zeros: 4 of the 8 "1x4" blocks are empty
    mask[0, 4] = 0  # one more zero, in a block that stays partly non-zero
    prunekit.custom_from_mask(model[0], "weight", fw.tensor(mask))
    rep = sparsity_report(model, {"0": "1x4", "2": None})
    a, b = rep.layers
    assert (a.numel, a.zeros, a.sparsity) == (32, 17, 17 / 32)
    assert (a.blocks, a.zero_blocks, a.block_sparsity) == (8, 4, 0.5)
    assert (b.zeros, b.blocks) == (0, None)
    assert rep.elementwise_over_layers == 17 / 40
    assert (rep.numel_all, rep.zeros_all) == (32 + 4 + 8, 17)
    assert rep.blockwise_over_layers == 0.5
    assert sparsity_report(model).layers[0].name == "0"  # default: every pruned module
    with pytest.raises(ValueError, match="no module named 'fc9'"):
        sparsity_report(model, {"fc9": None})


def test_boolean_masks_are_supported(framework):
    fw = framework
    fc = fw.nn.Linear(16, 8)
    keep = torch.rand(8, 16) > 0.25
    prunekit.custom_from_mask(fc, "weight", fw.tensor(keep), mask_dtype=fw.dtype(torch.bool))
    assert fc.weight_mask.dtype == fw.dtype(torch.bool)
    p = MagnitudePruner({"fc": fc}, {"prune_type": "magnitude", "pattern": "1x1", "target_sparsity": 0.5})
    p.on_step_end()
    mask = fw.to_torch(fc.weight_mask)
    assert fc.weight_mask.dtype == fw.dtype(torch.bool) and p.masks["fc"] is fc.weight_mask
    assert int((~mask).sum()) == 64
    assert torch.all(~mask[~keep])  # what was pruned stays pruned
    assert torch.all(fw.to_torch(fc.weight_orig)[~mask] == 0)
    assert torch.all(fw.to_torch(fc.weight)[~mask] == 0)


# ------------------------------------------------------------- agreement with prunekit.report.model_report
@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 2**16), boolean=st.booleans(), a0=st.integers(0, 288), a2=st.integers(0, 64))
def test_agrees_with_model_report_on_every_figure(seed, boolean, a0, a2):
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Conv2d(4, 8, 3), nn.ReLU(), nn.Linear(8, 8), nn.Linear(8, 4))
    dtype = torch.bool if boolean else None
    prunekit.random_unstructured(m[0], "weight", amount=a0, mask_dtype=dtype)
    prunekit.random_unstructured(m[2], "weight", amount=a2, mask_dtype=dtype)
    with torch.no_grad():
        m[3].weight[:2] = 0  # an unpruned layer with zeros of its own
    mr = model_report(m)
    sr = sparsity_report(m, {"0": "4x1", "2": "4x1", "3": "4x1"})
    assert sparsity_report(m).layers == [  # default: the pruned modules, element-wise
        LayerSparsity(e.name, e.shape, e.numel, e.zeros, e.sparsity) for e in sr.layers[:2]
    ]
    for s in sr.layers:
        e = mr.layer(s.name + ".weight")
        assert (s.shape, s.numel, s.zeros, s.sparsity) == (e.shape, e.numel, e.numel - e.nonzero, e.sparsity)
        assert s.block_sparsity == e.block_4x1_sparsity
    assert (sr.numel_layers, sr.numel_layers - sr.zeros_layers) == (mr.numel_layers, mr.nonzero_layers)
    assert (sr.numel_all, sr.numel_all - sr.zeros_all) == (mr.numel_all, mr.nonzero_all)
    assert sr.elementwise_over_layers == mr.sparsity_layers
    assert sr.elementwise_over_all == mr.sparsity_all
    assert sr.blockwise_over_layers == mr.block_4x1_sparsity
    assert sr.zeros_layers == a0 + a2 + int((m[3].weight == 0).sum())


def test_masked_entries_count_as_zero_even_over_inf_and_nan():
    fc = nn.Linear(4, 2)
    mask = torch.ones(2, 4)
    mask[0, :2] = 0
    prunekit.custom_from_mask(fc, "weight", mask)
    with torch.no_grad():
        fc.weight_orig[0, 0] = float("inf")
        fc.weight_orig[0, 1] = float("nan")
        fc.weight_orig[1, 0] = float("nan")  # kept: a NaN the model uses is not a zero
    rep = sparsity_report(fc, {"": None})
    assert (rep.layers[0].zeros, rep.zeros_all) == (2, 2 + int((fc.bias == 0).sum()))
    assert model_report(fc).layer("weight").nonzero == 6


def test_tied_weights_count_once_and_each_module_reports_its_own_view():
    enc, dec = nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False)
    dec.weight = enc.weight
    model = nn.Sequential(enc, dec)
    mask = torch.ones(4, 4)
    mask[:, 0] = 0
    prunekit.custom_from_mask(model[1], "weight", mask)  # dec prunes the tensor enc uses unmasked
    rep = sparsity_report(model, {"0": None, "1": "4x1"})
    assert [(e.name, e.zeros) for e in rep.layers] == [("0", 0), ("1", 4)]
    assert rep.layers[1].block_sparsity == 0.25
    assert rep.numel_all == 16 == model_report(model).numel_all  # the shared Parameter once
    with pytest.raises(AttributeError, match="weight"):
        sparsity_report(nn.Sequential(nn.ReLU()), {"0": None})


def test_agrees_with_model_report_on_tensorplay_models(framework):
    fw = framework
    fw.manual_seed(1)
    m = fw.nn.Sequential(fw.nn.Linear(8, 8), fw.nn.ReLU(), fw.nn.Linear(8, 4))
    keep = torch.rand(8, 8) > 0.5
    prunekit.custom_from_mask(m[0], "weight", fw.tensor(keep.float()))
    mr, sr = model_report(m), sparsity_report(m, {"0": "2:4", "2": None})
    assert sr.layers[0].zeros == int((~keep).sum()) == mr.layer("0.weight").numel - mr.layer("0.weight").nonzero
    assert sr.numel_all == mr.numel_all == 8 * 8 + 8 + 8 * 4 + 4
    assert sr.numel_all - sr.zeros_all == mr.nonzero_all
    assert model_report(m.state_dict()).layers == mr.layers  # a TensorPlay state dict reads the same
    assert sr.elementwise_over_layers == mr.sparsity_layers
    assert [e.masked for e in mr.layers] == [True, False]
