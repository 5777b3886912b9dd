import pytest
import torch
from torch import nn

import prunekit
from prunekit.training import MagnitudePruner, sparsity_report


def test_report_elementwise_and_blockwise():
    model = nn.Sequential(nn.Linear(8, 4), nn.ReLU(), nn.Linear(4, 2, bias=False))
    with torch.no_grad():
        model[0].weight.fill_(1.0)
        model[0].bias.fill_(1.0)
        model[2].weight.fill_(1.0)
    mask = torch.ones(4, 8)
    mask[:, :4] = 0  # 16 zeros: 4 of the 8 "1x4" blocks are empty
    mask[0, 4] = 0  # one more zero, in a block that stays partly non-zero
    prunekit.custom_from_mask(model[0], "weight", mask)
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


def test_boolean_masks_are_supported():
    fc = nn.Linear(16, 8)
    keep = torch.rand(8, 16) > 0.25
    prunekit.custom_from_mask(fc, "weight", keep, mask_dtype=torch.bool)
    assert fc.weight_mask.dtype == torch.bool
    p = MagnitudePruner({"fc": fc}, {"prune_type": "magnitude", "pattern": "1x1", "target_sparsity": 0.5})
    p.on_step_end()
    assert fc.weight_mask.dtype == torch.bool
    assert int((~fc.weight_mask).sum()) == 64
    assert torch.all(~fc.weight_mask[~keep])  # what was pruned stays pruned
    assert torch.all(fc.weight_orig[~fc.weight_mask] == 0)
