"""Compaction from masks placed anywhere: one propagation decides what is dead.

A channel goes when nothing reads it, when its value is provably zero, or when it is a
provable constant a reader folds exactly into its bias; every masked channel that stays
gets a reason. Sources: torch-style ``ln_structured(dim=0)``, masks on a normalization's
affine parameters, training patterns (``"1xchannel"`` output rows, ``"channelx1"`` input
columns), a SwiGLU gate, masked attention values, and ``prune_groups``.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import prunekit
from prunekit.compact import build_dependency_graph, compact, compaction_description, count_params, prune_groups
from helpers.compact_models import MLP, ResNetLike


pytestmark = pytest.mark.usefixtures("one_thread")


def _rel(a, b):
    return float((a - b).norm() / b.norm())


def _same(small, model, x):
    with torch.no_grad():
        a = small(*x) if isinstance(x, tuple) else small(x)
        b = model(*x) if isinstance(x, tuple) else model(x)
    assert a.shape == b.shape and _rel(a, b) < 1e-5


class ConvBN(nn.Module):
    def __init__(self, k2=3, pad2=1, bias1=False):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1, bias=bias1)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 6, k2, padding=pad2)
        self.fc = nn.Linear(6, 3)

    def forward(self, x):
        y = torch.relu(self.bn1(self.conv1(x)))
        return self.fc(torch.relu(self.conv2(y)).mean(dim=(2, 3)))


def _trained_bn(m):
    with torch.no_grad():
        m.bn1.running_mean.uniform_(-0.5, 0.5)
        m.bn1.running_var.uniform_(0.5, 2.0)
        m.bn1.weight.uniform_(0.5, 1.5)
        m.bn1.bias.copy_(torch.tensor([0.3, -0.2, 0.5, -0.4, 0.1, 0.2, -0.3, 0.4]))
    return m.eval()


X = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(0))


def test_ln_structured_on_conv_then_bn_folds_into_an_unpadded_consumer():
    m = _trained_bn(ConvBN(k2=1, pad2=0))
    prunekit.ln_structured(m.conv1, "weight", 0.5, n=2, dim=0)  # torch-style: rows only, no BN mask
    small = compact(m, X)
    # every masked channel is the constant relu(bn1(0)), which the 1x1 conv takes into its bias
    assert small.conv1.out_channels == 4 and small.bn1.num_features == 4 and small.conv2.in_channels == 4
    assert not torch.equal(small.conv2.bias, m.conv2.bias[:6])  # the constants went into the bias
    _same(small, m, X)
    assert compaction_description(small)["kept"] == []


def test_ln_structured_on_conv_then_bn_read_by_a_padded_conv_says_why():
    m = _trained_bn(ConvBN(k2=3, pad2=1))
    prunekit.ln_structured(m.conv1, "weight", 0.5, n=2, dim=0)
    masked = (m.conv1.weight_mask.flatten(1) == 0).all(dim=1).nonzero().view(-1).tolist()
    bias = m.bn1.bias.detach()
    shift = bias - m.bn1.running_mean * m.bn1.weight.detach() / torch.sqrt(m.bn1.running_var + m.bn1.eps)
    # channels whose constant is <= 0 are zero after the ReLU: they go; the others stay with a reason
    gone = [c for c in masked if shift[c] <= 0]
    stays = [c for c in masked if shift[c] > 0]
    assert gone and stays
    small = compact(m, X)
    assert small.conv1.out_channels == 8 - len(gone)
    _same(small, m, X)
    kept = compaction_description(small)["kept"]
    assert sorted(k["channels"]["conv1.out"][0] for k in kept) == stays
    for k in kept:
        assert "holds the constant" in k["reason"] and "pads with zeros (padding=(1, 1))" in k["reason"]


def test_masked_bn_affine_makes_the_channel_zero_for_any_consumer():
    m = _trained_bn(ConvBN(k2=3, pad2=1))
    rows = torch.ones(8, 1, 1, 1)
    rows[[1, 4, 6]] = 0
    prunekit.custom_from_mask(m.bn1, "weight", rows.view(-1))
    prunekit.custom_from_mask(m.bn1, "bias", rows.view(-1))
    small = compact(m, X)  # conv1's rows are untouched: the BN's zero scale and shift decide
    assert small.conv1.out_channels == 5 and small.conv2.in_channels == 5
    _same(small, m, X)


def test_mlp_output_rows_masked_fold_into_the_next_layers_bias():
    x = torch.randn(4, 64)
    m = MLP((64, 32, 16, 10))
    prunekit.ln_structured(m.layers[0], "weight", 0.5, n=1, dim=0)
    prunekit.ln_structured(m.layers[1], "weight", 0.25, n=1, dim=0)
    small = compact(m, x)
    assert [layer.out_features for layer in small.layers] == [16, 12, 10]
    assert count_params(small) == 64 * 16 + 16 + 16 * 12 + 12 + 12 * 10 + 10
    _same(small, m, x)


@pytest.mark.parametrize("pattern", ["1xchannel", "channelx1"])
def test_training_channel_patterns(pattern):
    x = torch.randn(8, 64)
    m = MLP((64, 32, 24, 10))
    opt = torch.optim.SGD(m.parameters(), lr=0.0)  # masks only: weights stay
    cfg = {"prune_type": "magnitude", "pattern": pattern, "target_sparsity": 0.5, "end_step": 0,
           "op_names": ["layers.0", "layers.1"]}
    prunekit.prepare_pruning(m, cfg, opt)
    opt.zero_grad()
    m(x).sum().backward()
    opt.step()
    assert prunekit.is_pruned(m)
    small = compact(m, x)
    _same(small, m, x)
    if pattern == "1xchannel":  # masked output rows hold their bias, which folds into the next layer
        rows = [int((layer.weight_mask != 0).any(dim=1).sum()) for layer in m.layers[:2]]
        assert [layer.out_features for layer in small.layers] == rows + [10]
        assert sum(rows) < 32 + 24
    else:  # masked input columns: layers.0's channels that layers.1 no longer reads
        w1 = m.layers[1].weight_mask
        assert small.layers[0].out_features == 32 - int((w1 == 0).all(dim=0).sum()) < 32


class SwiGLU(nn.Module):
    def __init__(self, d=16, f=32):
        super().__init__()
        self.gate = nn.Linear(d, f, bias=False)
        self.up = nn.Linear(d, f, bias=False)
        self.down = nn.Linear(f, d, bias=False)
        self.head = nn.Linear(d, 4)

    def forward(self, x):
        return self.head(x + self.down(nn.functional.silu(self.gate(x)) * self.up(x)))


def test_swiglu_gate_rows_alone_make_the_neuron_zero():
    x = torch.randn(3, 16)
    m = SwiGLU().eval()
    prunekit.ln_structured(m.gate, "weight", 0.5, n=2, dim=0)  # silu(0) * anything = 0
    small = compact(m, x)
    assert small.gate.out_features == small.up.out_features == small.down.in_features == 16
    _same(small, m, x)


def test_masked_attention_values_remove_their_heads():
    from helpers.compact_models import EncoderBlock

    m = EncoderBlock().eval()
    ids = torch.randint(0, 50, (2, 7))
    mask = torch.ones(96, 32)
    mask[64 + 8:64 + 16] = 0  # value rows of head 1 (head dim 8)
    prunekit.custom_from_mask(m.attn, "in_proj_weight", mask)
    prunekit.custom_from_mask(m.attn, "in_proj_bias", mask[:, 0].clone())
    small = compact(m, ids)
    assert small.attn.num_heads == 3
    _same(small, m, (ids,))


def test_prune_groups_masks_still_compact_through_the_same_propagation():
    x = torch.randn(1, 3, 16, 16)
    m = ResNetLike(widths=(8, 8, 16, 16), blocks=(1, 1, 1, 1)).eval()
    g = build_dependency_graph(m, x)
    prune_groups(m, x, 0.5, graph=g)
    small = compact(m, x)  # traced again, with the masks: the same units go
    assert small.conv1.out_channels == 4
    _same(small, m, x)


def test_unread_nonconstant_channels_are_kept_with_a_reason():
    x = torch.randn(4, 64)
    m = MLP((64, 32, 10))
    prunekit.ln_structured(m.layers[0], "weight", 0.25, n=1, dim=0)
    with torch.no_grad():
        m.layers[0].bias.zero_()
    prunekit.l1_unstructured(m.layers[1], "weight", 0.1)
    # rows masked + bias 0: the channels are gelu(0) = 0 -> go; nothing else is constant
    small = compact(m, x)
    assert small.layers[0].out_features == 24
    _same(small, m, x)


def test_kept_lists_only_masked_units_when_batchnorm_biases_are_zero():
    # BatchNorm's bias starts at 0: a channel prune_groups left alone is zero there, but never masked
    m = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 6, 3), nn.BatchNorm2d(6),
                      nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(6, 4)).eval()
    x = torch.randn(2, 3, 12, 12)
    assert all(not bn.bias.detach().any() for bn in (m[1], m[4]))
    prune_groups(m, x, 0.5)
    small = compact(m, x)
    assert (small[0].out_channels, small[3].out_channels) == (4, 3)
    _same(small, m, x)
    assert compaction_description(small)["kept"] == []
    # (a masked unit that stays is still listed: test_ln_structured_on_conv_then_bn_read_by_a_padded_conv_says_why)
