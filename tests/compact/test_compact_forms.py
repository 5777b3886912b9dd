"""Layers written the way model zoos write them: subclasses with a forward of their own, channel cuts.

* a ``LayerNorm`` subclass run channels-first (ConvNeXt's, PoolFormer's, EdgeNeXt's ``LayerNorm2d``),
  a ``BatchNorm2d`` with its activation (timm's ``BatchNormAct2d``), a padded ``Conv2d`` (timm's
  ``Conv2dSame``): followed op by op, the handler applied to the layer's functional call;
* a handler that fails on a call blocks that module's channels, never the whole trace;
* ``y[:, :k]``, ``split``, ``chunk`` with bounds written in the model's code (ReXNet's partial
  residual): the channels a cut would move are blocked, the others stay prunable.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from prunekit.compact import (
    REGISTRY,
    HandlerRegistry,
    ModuleHandler,
    Slot,
    build_dependency_graph,
    compact,
    prune_groups,
)
from prunekit.compact.handlers import LinearHandler
from prunekit.compact.trace.cuts import cuts
from prunekit.compact.trace.graph import traced_dependency_graph

pytestmark = pytest.mark.usefixtures("one_thread")


def _rel(a, b):
    return float((a - b).norm() / b.norm())


def _prune_compact(m, x, amount=0.3, **kw):
    prune_groups(m, x, amount, importance="l2", **kw)
    small = compact(m, x, **kw)
    with torch.no_grad():
        return small, _rel(small(x), m(x))


def _group_of(g, key, index=None):
    """The group holding slot ``key`` (its index ``index`` when given)."""
    return next(gr for gr in g.groups if key in gr.slots
                and (index is None or index in gr.member_index()[key][0].tolist()))


# ------------------------------------------------------------------ a forward of their own


class LayerNorm2d(nn.LayerNorm):
    """ConvNeXt's: a LayerNorm over the channels of an NCHW tensor."""

    def forward(self, x):
        return F.layer_norm(x.permute(0, 2, 3, 1), self.normalized_shape, self.weight, self.bias, self.eps).permute(0, 3, 1, 2)


class ConvNeXtBlock(nn.Module):
    def __init__(self, c, layer_scale=True):
        super().__init__()
        self.dwconv = nn.Conv2d(c, c, 7, padding=3, groups=c)
        self.norm = nn.LayerNorm(c)
        self.pwconv1 = nn.Linear(c, 4 * c)
        self.pwconv2 = nn.Linear(4 * c, c)
        self.gamma = nn.Parameter(torch.rand(c) + 0.5) if layer_scale else None

    def forward(self, x):
        y = self.pwconv2(F.gelu(self.pwconv1(self.norm(self.dwconv(x).permute(0, 2, 3, 1)))))
        if self.gamma is not None:
            y = self.gamma * y
        return x + y.permute(0, 3, 1, 2)


class TinyConvNeXt(nn.Module):
    def __init__(self, c=8, layer_scale=True):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, c, 4, 4), LayerNorm2d(c))
        self.block = ConvNeXtBlock(c, layer_scale)
        self.head_norm = LayerNorm2d(c)
        self.fc = nn.Linear(c, 5)

    def forward(self, x):
        return self.fc(self.head_norm(self.block(self.stem(x))).mean((2, 3)))


def test_a_subclass_with_its_own_forward_keeps_the_handler_for_its_tensors_only():
    assert REGISTRY.lookup(LayerNorm2d(4)) is REGISTRY.lookup(nn.LayerNorm(4))
    assert not REGISTRY.traces_forward(LayerNorm2d(4))
    assert REGISTRY.traces_forward(nn.LayerNorm(4)) and REGISTRY.traces_forward(nn.BatchNorm2d(4))  # _BatchNorm's forward


@pytest.mark.parametrize("side", [32, 40])  # 32: the width after the stem (8) equals the channels
def test_channels_first_layernorm_is_traced_over_its_channels(side):
    m = TinyConvNeXt().eval()
    x = torch.randn(2, 3, side, side)
    g = build_dependency_graph(m, x)  # the last-dim LayerNorm handler on NCHW failed the whole trace
    stream = _group_of(g, ("stem.1", "features"))
    assert {("stem.0", "out"), ("block.dwconv", "out"), ("block.norm", "features"), ("head_norm", "features"),
            ("fc", "in")} <= set(stream.slots)
    assert stream.n_units == 8 and "LayerNorm 'stem.1' normalizes over these features" in stream.blocked
    hidden = _group_of(g, ("block.pwconv1", "out"))
    assert hidden.prunable and set(hidden.slots) == {("block.pwconv1", "out"), ("block.pwconv2", "in")}
    small, err = _prune_compact(m, x)
    assert small.block.pwconv1.out_features == 22 and small.stem[1].weight.shape == (8,)
    assert err <= 1e-6


def test_channels_first_layernorm_is_sliced_when_pruned_inexactly():
    m = TinyConvNeXt(layer_scale=False).eval()  # a layer scale multiplies the stream: see the zoo's ConvNeXt
    x = torch.randn(2, 3, 32, 32)
    prune_groups(m, x, 0.5, importance="l2", exact=False)
    small = compact(m, x, exact=False)
    assert isinstance(small.stem[1], LayerNorm2d) and small.stem[1].normalized_shape == (4,)
    assert small.stem[1].weight.shape == small.head_norm.bias.shape == (4,) and small.block.dwconv.groups == 4
    with torch.no_grad():
        assert small(x).shape == (2, 5)


class BatchNormAct2d(nn.BatchNorm2d):
    """timm's: BatchNorm2d and its activation in one module."""

    def forward(self, x):
        return F.relu(F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0, self.eps))


class Conv2dSame(nn.Conv2d):
    """timm's: TensorFlow's "same" padding computed at run time, then the convolution."""

    def forward(self, x):
        return F.conv2d(F.pad(x, (0, 1, 0, 1)), self.weight, self.bias, self.stride, 0, self.dilation, self.groups)


class StdConv2d(nn.Conv2d):
    """Weight standardisation: the convolution runs a tensor computed from the weight."""

    def forward(self, x):
        w = self.weight
        w = (w - w.mean((1, 2, 3), keepdim=True)) / (w.std((1, 2, 3), keepdim=True) + 1e-5)
        return F.conv2d(x, w, self.bias, self.stride, self.padding)


def test_functional_calls_with_the_modules_own_tensors_are_its_layer():
    m = nn.Sequential(nn.Conv2d(3, 8, 3, stride=2), BatchNormAct2d(8), Conv2dSame(8, 12, 3), BatchNormAct2d(12),
                      nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(12, 4)).eval()
    for bn in (m[1], m[3]):
        bn.running_mean.uniform_(-1, 1)
        bn.running_var.uniform_(0.5, 2)
    x = torch.randn(2, 3, 16, 16)
    g = build_dependency_graph(m, x)
    groups = {tuple(sorted(gr.slots)): gr for gr in g.prunable_groups()}
    assert set(groups) == {(("0", "out"), ("1", "features"), ("2", "in")), (("2", "out"), ("3", "features"), ("6", "in"))}
    small, err = _prune_compact(m, x)
    assert (small[0].out_channels, small[1].num_features, small[2].out_channels, small[3].running_mean.shape[0]) == (6, 6, 8, 8)
    assert type(small[1]) is BatchNormAct2d and err <= 1e-6


def test_a_tensor_computed_from_the_weight_blocks_only_that_layers_channels():
    m = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), StdConv2d(8, 6, 3), nn.ReLU(), nn.Conv2d(6, 6, 1),
                      nn.Flatten(), nn.Linear(6 * 12 * 12, 4)).eval()
    x = torch.randn(2, 3, 16, 16)
    g = build_dependency_graph(m, x)
    first = _group_of(g, ("0", "out"))
    assert first.blocked == "op 'conv2d' in module '2' is not understood by the channel tracer"
    assert _group_of(g, ("4", "out")).prunable  # 4's input comes from no known layer: only its outputs
    small, err = _prune_compact(m, x)
    assert small[0].out_channels == 8 and small[4].out_channels == 4 and err <= 1e-6


class Gate(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.w = nn.Parameter(torch.ones(n))

    def forward(self, x):
        return x * self.w


class _FailingHandler(ModuleHandler):
    def slots(self, m):
        return {"f": Slot(m.w.numel(), [], role="norm")}

    def trace(self, m, name, tracer, args, kwargs, output):
        tracer.bind(args[0], -1, tracer.slot(name, "f"))
        raise RuntimeError("no idea")


def test_a_handler_that_fails_on_a_call_blocks_its_channels_not_the_trace():
    reg = HandlerRegistry()
    reg.register(nn.Linear, LinearHandler())
    reg.register(Gate, _FailingHandler())
    m = nn.Sequential(nn.Linear(4, 8), Gate(8), nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 2))
    g = build_dependency_graph(m, torch.randn(3, 4), registry=reg)
    gate = _group_of(g, ("1", "f"))
    assert set(gate.slots) == {("0", "out"), ("1", "f")}
    assert gate.blocked == ("the compaction handler _FailingHandler does not understand this call of module '1' (Gate): "
                            "RuntimeError: no idea")
    assert _group_of(g, ("2", "in")).blocked == "input of module '2' does not come from a prunable layer"
    assert [sorted(gr.slots) for gr in g.prunable_groups()] == [[("2", "out"), ("4", "in")]]


# ------------------------------------------------------------------ cuts


class PartialResidual(nn.Module):
    """ReXNet's: the first ``cin`` channels take the shortcut, the new ones are concatenated."""

    def __init__(self, cin, cout):
        super().__init__()
        self.cin = cin
        self.conv = nn.Conv2d(cin, cout, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(cout)

    def forward(self, x):
        y = self.bn(self.conv(x))
        return torch.cat([y[:, 0:self.cin] + x, y[:, self.cin:]], dim=1)


class TinyReXNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU())
        self.b1 = PartialResidual(8, 12)
        self.b2 = PartialResidual(12, 16)
        self.fc = nn.Linear(16, 4)

    def forward(self, x):
        return self.fc(self.b2(self.b1(self.stem(x))).mean((2, 3)))


def test_a_slice_with_bounds_in_the_code_blocks_the_channels_it_would_move():
    m = TinyReXNet().eval()
    x = torch.randn(2, 3, 12, 12)
    g = build_dependency_graph(m, x)
    first, new1, new2 = (_group_of(g, key, i) for key, i in ((("stem.0", "out"), 0), (("b1.conv", "out"), 8),
                                                              (("b2.conv", "out"), 12)))
    # b1 adds the stem's 8 channels to its first 8 (y[:, 0:8]): removing one would shift the cut
    assert first.n_units == 8 and "op '__getitem__' in module 'b1' takes [0:8] of 12 channels" in first.blocked
    # b1's 4 new channels are b2's input channels 8..11, inside b2's y[:, 0:12]
    assert new1 is not first and new1.n_units == 4 and "module 'b2' takes [0:12] of 16 channels" in new1.blocked
    assert sorted(new1.member_index()[("b1.conv", "out")][0].tolist()) == [8, 9, 10, 11]
    # b2's new channels come after every cut: prunable
    assert new2.prunable and set(new2.slots) == {("b2.conv", "out"), ("b2.bn", "features"), ("fc", "in")}
    assert sorted(new2.member_index()[("b2.conv", "out")][0].tolist()) == [12, 13, 14, 15]
    small, err = _prune_compact(m, x, 0.5)  # before: the compacted model failed compact's own check
    assert (small.b1.conv.out_channels, small.b2.conv.out_channels, small.fc.in_features) == (12, 14, 14)
    assert err <= 1e-6


class Halves(nn.Module):
    def __init__(self, how):
        super().__init__()
        self.how = how
        self.up = nn.Linear(6, 16)
        self.a = nn.Linear(8, 5)
        self.b = nn.Linear(8, 5)
        self.out = nn.Linear(8, 3)

    def forward(self, x):
        h = self.up(x)
        if self.how == "glu":  # the parts meet element by element: each unit has a channel in each
            p, q = h.chunk(2, dim=-1)
            return self.out(p * torch.sigmoid(q))
        p, q = h.chunk(2, dim=-1) if self.how == "chunk" else h.split(8, dim=-1)
        return self.a(F.relu(p)) + self.b(F.relu(q))


def test_chunk_into_equal_parts_keeps_units_that_lose_a_channel_in_each_part():
    x = torch.randn(4, 6)
    g = build_dependency_graph(Halves("glu"), x)
    (grp,) = g.prunable_groups()
    assert grp.n_units == 8 and grp.unit_width == 2 and sorted(grp.units[0].members[("up", "out")].tolist()) == [0, 8]
    m = Halves("glu")
    small, err = _prune_compact(m, x, 0.5)
    assert small.up.out_features == 8 and small.out.in_features == 4 and err <= 1e-6


@pytest.mark.parametrize("how", ["chunk", "split"])
def test_parts_used_apart_are_blocked_where_a_bound_would_move(how):
    x = torch.randn(4, 6)
    m = Halves(how)
    g = build_dependency_graph(m, x)
    up = _group_of(g, ("up", "out"))
    if how == "chunk":  # a unit lies in one half only: removing it would unbalance the halves
        halves = [gr for gr in g.groups if ("up", "out") in gr.slots]
        assert [(gr.n_units, set(gr.slots)) for gr in halves] == [(8, {("up", "out"), ("a", "in")}),
                                                                  (8, {("up", "out"), ("b", "in")})]
        assert all("op 'chunk' in module '<model>' cuts 16 channels into 2 equal parts" in gr.blocked for gr in halves)
        assert not g.prunable_groups()
        with pytest.raises(ValueError, match="found 0 whole channels/heads to remove among 0 prunable units"):
            _prune_compact(m, x, 0.5)
        return
    # split(8): the second part runs to the end, its channels may go
    assert "takes split(8) of 16 channels" in up.blocked and up.n_units == 8
    (free,) = [gr for gr in g.prunable_groups() if ("up", "out") in gr.slots]
    assert set(free.slots) == {("up", "out"), ("b", "in")} and free.n_units == 8
    small, err = _prune_compact(m, x, 0.5)
    assert small.up.out_features == 12 and err <= 1e-6


@pytest.mark.parametrize("index, unsafe", [
    ((slice(None), slice(2, 5)), [0, 1, 2, 3, 4]),
    ((slice(None), slice(3, None)), [0, 1, 2]),
    ((slice(None), slice(-3, None)), [7, 8, 9]),
    ((slice(None), slice(None, -2)), [8, 9]),
    ((slice(None), slice(0, 10)), []),
    ((slice(None), slice(None, None, 2)), list(range(10))),
    ((Ellipsis, 4), [0, 1, 2, 3, 4]),
    ((slice(None), -1), [9]),
    ((slice(None), torch.tensor([1, 3])), list(range(10))),
])
def test_unsafe_positions_of_a_slice(index, unsafe):
    (cut,) = [c for c in cuts("__getitem__", (torch.zeros(2, 10), index), {}, None) if c.dim == 1]
    assert cut.unsafe.nonzero().view(-1).tolist() == unsafe


def test_unsafe_positions_of_split_narrow_and_chunk():
    x = torch.zeros(3, 10)
    (c,) = cuts("split", (x, 4, 1), {}, x.split(4, 1))
    assert c.unsafe.nonzero().view(-1).tolist() == list(range(8))
    (c,) = cuts("split", (x, [4, 6], 1), {}, x.split([4, 6], 1))
    assert bool(c.unsafe.all())
    (c,) = cuts("narrow", (x, 1, 2, 3), {}, None)
    assert c.unsafe.nonzero().view(-1).tolist() == [0, 1, 2, 3, 4]
    (c,) = cuts("chunk", (x, 2), {"dim": 1}, x.chunk(2, 1))
    assert c.unsafe is None and c.parts == 2
    (c,) = cuts("chunk", (x, 3), {"dim": 1}, x.chunk(3, 1))  # 4 + 4 + 2: the parts are not equal
    assert bool(c.unsafe.all())
    (c,) = cuts("unbind", (x, 0), {}, x.unbind(0))
    assert c.dim == 0 and bool(c.unsafe.all())


def test_a_group_norm_without_bias_is_sliced_without_one():
    gn = nn.GroupNorm(4, 8)
    gn.bias = None  # timm's GroupNorm1NoBias
    m = nn.Sequential(nn.Conv2d(3, 8, 3), gn, nn.ReLU(), nn.Conv2d(8, 4, 3), nn.Flatten(), nn.Linear(4 * 8 * 8, 3)).eval()
    x = torch.randn(2, 3, 12, 12)
    small, err = _prune_compact(m, x, 0.5)
    assert small[1].num_groups == 2 and small[1].weight.shape == (4,) and small[1].bias is None and err <= 1e-6


class MatmulLinear(nn.Linear):
    """transformers' FalconLinear: a Linear written as a matmul and an add."""

    def forward(self, x):
        return x @ self.weight.T + self.bias


def test_a_forward_of_its_own_that_computes_the_parents_layer_is_that_layer():
    m = nn.Sequential(MatmulLinear(6, 16), nn.GELU(), MatmulLinear(16, 6), nn.ReLU(), nn.Linear(6, 3))
    x = torch.randn(4, 6)
    g = build_dependency_graph(m, x)  # op by op, the matmul with a fixed weight would block every channel
    assert sorted(sorted(gr.slots) for gr in g.prunable_groups()) == [[("0", "out"), ("2", "in")],
                                                                        [("2", "out"), ("4", "in")]]
    small, err = _prune_compact(m, x, 0.5)
    assert type(small[0]) is MatmulLinear and small[0].weight.shape == (8, 6) and small[2].in_features == 8
    assert err <= 1e-6


class InplaceScale(nn.Linear):
    """A forward that scales its input in place, per channel, before the layer runs."""

    def __init__(self, n_in, n_out):
        super().__init__(n_in, n_out)
        self.scale = nn.Parameter(torch.rand(n_in) + 0.5)

    def forward(self, x):
        return F.linear(x.mul_(self.scale), self.weight, self.bias)


def test_trying_a_forward_of_its_own_leaves_the_input_as_the_model_would():
    m = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), InplaceScale(8, 6), nn.ReLU(), nn.Linear(6, 2))
    x = torch.randn(3, 4)
    with torch.no_grad():
        want = m(x)
    g, traced = traced_dependency_graph(m, x)
    assert torch.equal(traced, want)
    # tried on its own copy of the input, the forward is not Linear's: followed op by op, the scale it
    # owns (no slot of the Linear handler) blocks the channels it multiplies
    assert _group_of(g, ("0", "out")).blocked == "op 'mul_' in module '2' combines channels with a fixed tensor that varies along them"
    assert sorted(sorted(gr.slots) for gr in g.prunable_groups()) == [[("2", "out"), ("4", "in")]]
    small, err = _prune_compact(m, x, 0.5)
    assert small[2].in_features == 8 and small[2].out_features == 3 and err <= 1e-6
