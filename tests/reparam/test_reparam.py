"""The mask module (prunekit.reparam): one definition of mask application, used by every package."""

import math

import pytest
import torch
from torch import nn

import prunekit
from prunekit import methods, reparam
from prunekit.report import model_report
from prunekit.training.report import sparsity_report


def _awkward_layer():
    """A layer whose masked entries hold -x, inf and NaN, with a mask that scales one entry."""
    m = nn.Linear(4, 2, bias=False)
    with torch.no_grad():
        m.weight.copy_(torch.tensor([[-1.0, math.inf, 3.0, -4.0], [math.nan, 2.0, -5.0, 6.0]]))
    mask = torch.tensor([[0.0, 0.0, 1.0, 0.5], [0.0, 1.0, 1.0, 0.0]])
    return m, mask


EXPECTED = torch.tensor([[0.0, 0.0, 3.0, -2.0], [0.0, 2.0, -5.0, 0.0]])


def _bits(t):
    return t.contiguous().view(torch.int32)


def test_masked_is_plus_zero_where_the_mask_is_zero_and_scales_elsewhere():
    m, mask = _awkward_layer()
    out = reparam.masked(m.weight.detach(), mask)
    assert torch.equal(_bits(out), _bits(EXPECTED))  # bit-exact: +0.0, no NaN
    assert out.dtype == m.weight.dtype
    assert torch.equal(_bits(reparam.masked(m.weight.detach(), mask != 0)),
                       _bits(torch.where(mask != 0, m.weight.detach(), torch.zeros(()))))


def test_every_consumer_applies_the_mask_the_same_way(tmp_path):
    m, mask = _awkward_layer()
    prunekit.custom_from_mask(m, "weight", mask)
    # the no-grad value of the property, effective(), dense_state_dict, the reports
    with torch.no_grad():
        assert torch.equal(_bits(m.weight), _bits(EXPECTED))
    assert torch.equal(_bits(reparam.effective(m, "weight")), _bits(EXPECTED))
    assert torch.equal(_bits(prunekit.dense_state_dict(m)["weight"]), _bits(EXPECTED))
    assert model_report(m).layers[0].nonzero == 4
    assert sparsity_report(nn.Sequential(m)).zeros_layers == 4
    # compressed checkpoint with the masked values dropped: the effective weight is unchanged
    pytest.importorskip("safetensors")
    path = tmp_path / "m.safetensors"
    prunekit.save_compressed(m, path, drop_masked_values=True)
    sd = prunekit.load_compressed(path)
    assert torch.equal(_bits(reparam.masked(sd["weight_orig"], sd["weight_mask"])), _bits(EXPECTED))
    # remove() bakes the same values into the same Parameter object
    orig = m.weight_orig
    prunekit.remove(m, "weight")
    assert m.weight is orig and torch.equal(_bits(m.weight.detach()), _bits(EXPECTED))


def test_questions_and_surgery_on_prunekit_and_torch_pruned_modules():
    net = nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 2))
    prunekit.l1_unstructured(net[0], "weight", amount=2)
    torch.nn.utils.prune.l1_unstructured(net[1], "bias", amount=1)
    assert [(q, n) for q, _, n in reparam.iter_masked(net)] == [("0", "weight"), ("1", "bias")]
    assert reparam.is_masked(net[1], "bias") and not reparam.is_masked(net[1], "weight")
    assert reparam.stored(net[1], "bias") is net[1].bias_orig
    assert reparam.owner_of(net, "1.bias") == (net[1], "bias")
    orig_values = net[1].bias_orig.detach().clone()
    mask = reparam.unmask(net[1], "bias", bake=False)  # torch's reparameterization, undone
    assert int((mask == 0).sum()) == 1 and torch.equal(net[1].bias.detach(), orig_values)
    assert not prunekit.is_pruned(net[1])
    methods.apply_mask(net[1], "bias", torch.tensor([1, 0]))
    methods.apply_mask(net[1], "bias", torch.tensor([0, 1]))  # a mask only loses ones
    assert net[1].bias_mask.tolist() == [0.0, 0.0]
    with pytest.raises(ValueError, match="is not masked"):
        reparam.unmask(net[1], "weight")


def test_unmask_bake_is_remove():
    a, b = nn.Linear(5, 3), nn.Linear(5, 3)
    b.load_state_dict(a.state_dict())
    prunekit.l1_unstructured(a, "weight", 0.4)
    prunekit.l1_unstructured(b, "weight", 0.4)
    prunekit.remove(a, "weight")
    reparam.unmask(b, "weight")
    assert torch.equal(a.weight, b.weight) and type(a) is type(b) is nn.Linear
