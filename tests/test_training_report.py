import pytest
import torch

import prunekit
from prunekit.training import MagnitudePruner, sparsity_report


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
