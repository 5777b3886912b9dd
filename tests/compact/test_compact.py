"""Compaction: dependency groups, group pruning, compact(), save/reload, errors."""

from __future__ import annotations

import io
import json
import operator

import pytest
import torch
from torch import nn

import prunekit
from prunekit.compact import (
    ModuleHandler,
    Slot,
    Entry,
    HandlerRegistry,
    TraceError,
    build_dependency_graph,
    compact,
    compaction_description,
    count_macs,
    count_params,
    group_importance,
    load_compacted,
    prune_groups,
    register_handler,
    zero_units,
)
from helpers.compact_models import MLP, DWSeparable, EncoderBlock, ResNetLike


pytestmark = pytest.mark.usefixtures("one_thread")


def _run(m, x):
    return m(*x) if isinstance(x, tuple) else m(x)


def _rel(a, b):
    return float((a - b).norm() / b.norm())


def _roundtrip(small, make, x):
    """torch.save of the module, and state dict + JSON description into a fresh original."""
    buf = io.BytesIO()
    torch.save(small, buf)
    buf.seek(0)
    again = torch.load(buf, weights_only=False).eval()
    desc = json.loads(json.dumps(compaction_description(small)))
    sd_buf = io.BytesIO()
    torch.save(small.state_dict(), sd_buf)
    sd_buf.seek(0)
    rebuilt = load_compacted(make().eval(), torch.load(sd_buf, weights_only=True), desc).eval()
    with torch.no_grad():
        ref = _run(small, x)
        assert torch.equal(_run(again, x), ref)
        assert torch.equal(_run(rebuilt, x), ref)


def _check(make, x, expected_params, expected_macs, amount=0.5, **kw):
    model = make().eval()
    dense_params = count_params(model)
    prune_groups(model, x, amount, **kw)
    assert prunekit.is_pruned(model)
    assert count_params(model) == dense_params  # masks remove nothing yet
    small = compact(model, x).eval()
    with torch.no_grad():
        masked, out = _run(model, x), _run(small, x)
    assert out.shape == masked.shape
    assert _rel(out, masked) < 1e-5
    assert count_params(small) == expected_params
    assert count_macs(small, x) == expected_macs
    _roundtrip(small, make, x)
    return model, small


def test_mlp():
    x = torch.randn(4, 64)
    ref = MLP((64, 64, 48, 10))
    model, small = _check(MLP, x, count_params(ref), count_macs(ref, x))
    assert [l.out_features for l in small.layers] == [64, 48, 10]
    assert count_macs(model, x) == 4 * (64 * 128 + 128 * 96 + 96 * 10)


def test_resnet18_like():
    x = torch.randn(2, 3, 32, 32)
    ref = ResNetLike(widths=(8, 16, 32, 64))
    _, small = _check(ResNetLike, x, count_params(ref), count_macs(ref, x))
    assert small.fc.in_features == 64 and small.fc.out_features == 10


def test_resnet50_like():
    x = torch.randn(1, 3, 32, 32)
    make = lambda: ResNetLike(widths=(64, 128, 256, 512), bottleneck=True)  # noqa: E731
    ref = ResNetLike(widths=(32, 64, 128, 256), mids=(8, 16, 32, 64), bottleneck=True, stem=8)
    _check(make, x, count_params(ref), count_macs(ref, x))


def test_depthwise_separable_and_groupnorm():
    x = torch.randn(2, 3, 32, 32)
    ref = DWSeparable((8, 16, 32))
    _, small = _check(DWSeparable, x, count_params(ref), count_macs(ref, x))
    dw = small.blocks[0]
    assert dw.groups == dw.in_channels == dw.out_channels == 8
    assert small.blocks[4].num_groups == 4 and small.blocks[4].num_channels == 16


@pytest.mark.parametrize("seq_first", [False, True])
def test_encoder_block_heads_and_ffn(seq_first):
    B, T, d = 2, 7, 32
    ids = torch.randint(0, 50, (B, T))
    pad = torch.zeros(B, T, dtype=torch.bool)
    pad[1, -2:] = True
    x = (ids, pad)
    make = lambda: EncoderBlock(seq_first=seq_first)  # noqa: E731
    dense = make()
    n = B * T
    params = count_params(dense) - (3 * 16 * d + 3 * 16) - 16 * d - (32 * d + 32) - 32 * d
    macs = 3 * n * d * 16 + 2 * n * T * 16 + n * 16 * d + 2 * n * d * 32
    _, small = _check(make, x, params, macs)
    assert small.attn.num_heads == 2 and small.ff1.out_features == 32
    assert small.attn.out_proj.out_features == d  # residual stream untouched (LayerNorm)


def test_transformer_encoder_layer_uses_no_fast_path():
    layer = nn.TransformerEncoderLayer(16, 4, 32, batch_first=True, dropout=0.0).eval()
    x = torch.randn(2, 5, 16)
    prune_groups(layer, x, 0.5)
    small = compact(layer, x).eval()
    with torch.no_grad():
        assert _rel(small(x), layer(x)) < 1e-5
    assert small.self_attn.num_heads == 2 and small.linear1.out_features == 16


def test_grouped_conv_prunes_whole_groups():
    m = nn.Sequential(nn.Conv2d(3, 8, 1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1, groups=4), nn.ReLU(), nn.Conv2d(8, 4, 1)).eval()
    x = torch.randn(1, 3, 6, 6)
    g = build_dependency_graph(m, x)
    widths = sorted((len(gr.units), gr.units[0].width()) for gr in g.prunable_groups())
    # one group: conv0.out, conv2.in/out (a unit = one conv group of 2 channels), conv4.in
    assert widths == [(4, 2)]
    (grp,) = g.prunable_groups()
    assert sorted(grp.slots) == [("0", "out"), ("2", "in"), ("2", "out"), ("4", "in")]
    prune_groups(m, x, 0.5)
    small = compact(m, x)
    assert small[2].groups == 2 and small[2].in_channels == 4 and small[2].out_channels == 4
    with torch.no_grad():
        assert _rel(small(x), m(x)) < 1e-5


def test_global_scope_and_round_to():
    x = torch.randn(4, 64)
    m = MLP((64, 128, 96, 10))
    d = prune_groups(m, x, 0.3, round_to=8)
    assert [r.kept % 8 for r in d] == [0, 0]
    assert [r.kept for r in d] == [96, 72]  # 128*0.7=89.6 -> 90 -> 96; 96*0.7=67.2 -> 67 -> 72
    m2 = MLP((64, 128, 96, 10))
    d2 = prune_groups(m2, x, 0.5, scope="global", importance="l2")
    assert sum(len(r.removed) for r in d2) == round(0.5 * (128 + 96))


def test_importances():
    x = torch.randn(4, 64)
    m = MLP()
    with pytest.raises(ValueError, match="loss.backward"):
        prune_groups(m, x, 0.5, importance="taylor")
    assert not prunekit.is_pruned(m)
    m(x).sum().backward()
    d = prune_groups(m, x, 0.25, importance="taylor")
    assert [len(r.removed) for r in d] == [32, 24]
    with pytest.raises(ValueError, match="importance must be one of"):
        prune_groups(MLP(), x, 0.5, importance="l7")
    d = prune_groups(MLP(), x, 0.5, importance="random", generator=torch.Generator().manual_seed(1))
    assert [len(r.removed) for r in d] == [64, 48]


def test_l1_picks_smallest_units():
    m = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2))
    with torch.no_grad():
        m[0].weight.fill_(1.0)
        m[0].weight[[1, 4]] = 0.01
        m[0].bias.zero_()
        m[2].weight.fill_(1.0)
    d = prune_groups(m, torch.randn(1, 4), 2 / 6)
    assert d[0].removed == [1, 4]
    assert torch.equal(m[0].weight_mask[:, 0], torch.tensor([1.0, 0, 1, 1, 0, 1]))
    assert torch.equal(m[2].weight_mask[0], torch.tensor([1.0, 0, 1, 1, 0, 1]))


def test_ignored_layers_left_alone():
    x = torch.randn(4, 64)
    m = MLP((64, 128, 96, 80, 10))
    before = m.layers[1].weight.detach().clone()
    d = prune_groups(m, x, 0.5, ignored_layers=[m.layers[1]])
    assert [r.kept for r in d] == [40]
    assert not hasattr(m.layers[1], "weight_orig") and not hasattr(m.layers[0], "weight_orig")
    small = compact(m, x, ignored_layers=["layers.1"])
    assert torch.equal(small.layers[1].weight, before)
    assert small.layers[0].out_features == 128  # coupled with the ignored layer's input
    assert small.layers[2].out_features == 40
    with torch.no_grad():
        assert _rel(small(x), m(x)) < 1e-5
    with pytest.raises(ValueError, match="no module named 'nope'"):
        prune_groups(MLP(), x, 0.5, ignored_layers=["nope"])


def test_default_ignores_final_classifier_outputs():
    g = build_dependency_graph(ResNetLike(), torch.randn(1, 3, 16, 16))
    assert g.ignored == ("fc",)
    blocked = [gr for gr in g.groups if not gr.prunable]
    assert any(("fc", "out") in gr.slots and "model's output" in gr.blocked for gr in blocked)


def test_unstructured_masks_error():
    x = torch.randn(4, 64)
    m = MLP()
    for layer in m.layers:
        prunekit.l1_unstructured(layer, "weight", 0.5)
    with pytest.raises(ValueError) as e:
        compact(m, x)
    msg = str(e.value)
    assert "found 0 whole channels" in msg and "prunekit.sparsify_for_inference" in msg
    assert "zero 10720 of 21440 weights" in msg


def test_partial_channel_masks_error_points_to_prune_groups():
    # torch-style output-row masks on a conv read by a zero-padded conv: each masked channel holds
    # its bias, which the padding would make position-dependent -> nothing can go, and the error says why
    m = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 4, 3, padding=1)).eval()
    x = torch.randn(1, 3, 8, 8)
    with torch.no_grad():
        m[0].bias.uniform_(0.1, 1.0)  # positive: the masked channels are relu(bias) > 0, not zero
    prunekit.ln_structured(m[0], "weight", 0.5, n=2, dim=0)
    with pytest.raises(ValueError, match=r"prune_groups.*|pads with zeros") as e:
        compact(m, x, ignored_layers=[])
    assert "pads with zeros (padding=(1, 1))" in str(e.value) and "prune_groups" in str(e.value)


def test_unremovable_channels_keep_unstructured_masks():
    x = torch.randn(4, 64)
    m = MLP()
    prune_groups(m, x, 0.5)
    prunekit.l1_unstructured(m.layers[2], "weight", 0.3)
    small = compact(m, x)
    assert hasattr(small.layers[2], "weight_mask") and small.layers[2].weight_mask.shape == (10, 48)
    with torch.no_grad():
        assert _rel(small(x), m(x)) < 1e-5


class _Einsum(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 4)

    def forward(self, x):
        return self.b(torch.einsum("bi,bj->bi", self.a(x), x))


def test_unknown_op_blocks_and_names_op_and_module():
    g = build_dependency_graph(_Einsum(), torch.randn(2, 8))
    reasons = [gr.blocked for gr in g.groups if gr.blocked]
    assert any("'einsum'" in r and "module '<model>'" in r for r in reasons)
    assert not g.prunable_groups()


class _Outer(nn.Module):
    """An unknown op two modules deep, one of them called through a helper function."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(8, 8)
        self.blocks = nn.ModuleList([_Einsum()])

    def forward(self, x):
        return _call(self.blocks[0], self.stem(x))


def _call(module, x):
    return module(x)


def test_unknown_op_is_named_by_the_innermost_module_running_it():
    # hooks sit on handled modules only: the module of an op between them is found on the call stack
    g = build_dependency_graph(_Outer(), torch.randn(2, 8))
    reasons = [gr.blocked for gr in g.groups if gr.blocked and "einsum" in gr.blocked]
    assert reasons and all("in module 'blocks.0'" in r for r in reasons)


class _Broken(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(8, 8), nn.Linear(5, 2))

    def forward(self, x):
        return self.inner(x)


def test_forward_failure_names_op_and_module():
    with pytest.raises(TraceError, match=r"op 'linear' in module 'inner\.1'"):
        build_dependency_graph(_Broken(), torch.randn(2, 8))


def test_a_forward_hook_that_replaces_the_output_is_traced_through():
    # leaves without forward hooks are traced from forward()'s result; a hook's replacement
    # output must carry the labels instead (the hooks path)
    m = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    replacement = torch.ones(3, 8)  # made outside the trace: no labels unless the leaf's own
    m[0].register_forward_hook(lambda mod, args, out: replacement)
    (g,) = build_dependency_graph(m, torch.randn(3, 4)).prunable_groups()
    assert g.n_units == 8 and set(g.slots) == {("0", "out"), ("1", "in")}
    assert "forward" not in m[0].__dict__ and len(m[0]._forward_hooks) == 1


def test_tracing_leaves_a_modules_own_forward_attribute_as_it_was():
    m = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    calls = []
    own = m[0].forward

    def logged(x):
        calls.append(x.shape)
        return own(x)

    m[0].forward = logged  # e.g. what accelerate's hooks do
    (g,) = build_dependency_graph(m, torch.randn(3, 4)).prunable_groups()
    assert g.n_units == 8 and calls == [torch.Size([3, 4])]
    assert m[0].__dict__["forward"] is logged and "forward" not in m[2].__dict__
    with pytest.raises(TraceError, match=r"op 'linear' in module '0'"):
        build_dependency_graph(m, torch.randn(3, 5))  # fails in the first Linear, named by its op
    assert m[0].__dict__["forward"] is logged and "forward" not in m[2].__dict__


def test_custom_handler_registry():
    class Scale(nn.Module):
        def __init__(self, n):
            super().__init__()
            self.s = nn.Parameter(torch.rand(n) + 0.5)

        def forward(self, x):
            return x * self.s

    reg = HandlerRegistry()
    from prunekit.compact.handlers import REGISTRY, LinearHandler

    reg.register(nn.Linear, LinearHandler())

    @register_handler(Scale, registry=reg)
    class ScaleHandler(ModuleHandler):
        def slots(self, m):
            return {"f": Slot(m.s.numel(), [Entry("s", 0, role="norm")], role="norm")}

        def trace(self, m, name, tracer, args, kwargs, output):
            ids = tracer.slot(name, "f")
            tracer.bind(args[0], -1, ids)
            tracer.emit(output, -1, ids)

    m = nn.Sequential(nn.Linear(4, 8), Scale(8), nn.Linear(8, 2))
    x = torch.randn(3, 4)
    assert not build_dependency_graph(m, x).prunable_groups()  # default registry: Scale's parameter blocks
    g = build_dependency_graph(m, x, registry=reg)
    assert [sorted(gr.slots) for gr in g.prunable_groups()] == [[("0", "out"), ("1", "f"), ("2", "in")]]
    assert REGISTRY.lookup(Scale(2)) is None


def test_failed_prune_leaves_model_unchanged():
    m = MLP()
    with pytest.raises(ValueError, match=r"amount must be in \[0, 1\)"):
        prune_groups(m, torch.randn(2, 64), 1.5)
    with pytest.raises(TypeError):
        prune_groups(m, torch.randn(2, 64), "half")
    assert not prunekit.is_pruned(m)


def test_compact_keeps_original_and_training_flags():
    x = torch.randn(4, 64)
    m = MLP().train()
    prune_groups(m, x, 0.5)
    small = compact(m, x)
    assert m.training and small.training
    assert m.layers[0].weight_orig.shape == (128, 64)
    assert small.layers[0].weight.shape == (64, 64)


def _reference_l1(graph, group):
    """Per-unit loop over every tensor the unit spans (the definition of the "l1" score)."""
    scores = []
    for unit in group.units:
        s = 0.0
        for (mname, sname), idx in unit.members.items():
            module = graph.module(mname)
            for e in graph.slots[(mname, sname)].spec.entries:
                if e.role != "buffer":
                    t = operator.attrgetter(e.path)(module).detach()
                    s += float(t.index_select(e.axis, idx + e.offset).abs().sum())
        scores.append(s)
    return torch.tensor(scores)


@pytest.mark.parametrize("make,x", [
    (lambda: ResNetLike(widths=(8, 16, 16, 32)), torch.randn(1, 3, 32, 32)),
    (lambda: EncoderBlock(), (torch.randint(0, 50, (2, 7)), torch.zeros(2, 7, dtype=torch.bool))),
])
def test_group_importance_matches_per_unit_reference(make, x):
    m = make().eval()
    g = build_dependency_graph(m, x)
    assert g.prunable_groups()
    for grp in g.prunable_groups():
        assert torch.allclose(group_importance(g, grp, "l1"), _reference_l1(g, grp), rtol=1e-5)


def test_shared_graph_gives_the_same_compacted_model():
    x = torch.randn(1, 3, 32, 32)
    make = lambda: ResNetLike(widths=(8, 16, 16, 32)).eval()
    torch.manual_seed(0)
    a = make()
    torch.manual_seed(0)
    b = make()
    g = build_dependency_graph(b, x)
    da = prune_groups(a, x, 0.5)
    db = prune_groups(b, x, 0.5, graph=g)
    assert [d.removed for d in da] == [d.removed for d in db]
    small_a, small_b = compact(a, x), compact(b, x, graph=g)
    assert prunekit.is_pruned(b)  # not inplace: b keeps its masks and shapes
    assert [tuple(p.shape) for p in small_a.parameters()] == [tuple(p.shape) for p in small_b.parameters()]
    assert compaction_description(small_a) == compaction_description(small_b)
    with torch.no_grad():
        assert torch.equal(small_a(x), small_b(x))


def test_graph_for_another_or_changed_model_is_refused():
    x = torch.randn(2, 64)
    m, other = MLP(), MLP()
    g = build_dependency_graph(m, x)
    with pytest.raises(ValueError, match="another model"):
        prune_groups(other, x, 0.5, graph=g)
    with pytest.raises(ValueError, match="ignored_layers"):
        prune_groups(m, x, 0.5, graph=g, ignored_layers=[m.layers[0]])
    with pytest.raises(TypeError, match="DependencyGraph"):
        compact(m, x, graph="g")
    assert not prunekit.is_pruned(m)
    prune_groups(m, x, 0.5, graph=g)
    compact(m, x, graph=g, inplace=True)
    with pytest.raises(ValueError, match=r"stale: slot 'out' of module 'layers.0' had 128 channels .* has 64 now"):
        compact(m, x, graph=g)


def test_zero_units_reports_units_zero_in_every_reader():
    m = nn.Sequential(nn.Linear(8, 5), nn.ReLU(), nn.Linear(5, 3), nn.ReLU(), nn.Linear(3, 2))
    with torch.no_grad():
        m[2].weight[:, [0, 3]] = 0  # units 0 and 3 of the first group: read by nothing
        m[0].weight[1] = 0  # unit 1: zero where it is produced, still read by m[2]
        m[4].weight[:, 2] = 0
    g = build_dependency_graph(m, torch.randn(1, 8))
    assert [len(grp.units) for grp in g.groups if grp.prunable] == [5, 3]
    assert zero_units(g) == {1: [0, 3], 2: [2]}  # group 0 (the model input) is not prunable


def test_rebuild_with_an_unknown_module_leaves_the_model_unchanged():
    x = torch.randn(2, 64)
    m = MLP()
    prune_groups(m, x, 0.5)
    desc = compaction_description(compact(m, x))
    desc["modules"]["nope"] = {"tensors": {}, "attrs": {}}
    fresh = MLP()
    before = {k: v.shape for k, v in fresh.state_dict().items()}
    with pytest.raises(ValueError, match="names module 'nope'"):
        load_compacted(fresh, {}, desc)
    assert {k: v.shape for k, v in fresh.state_dict().items()} == before


def test_handler_interface_is_checked_at_registration():
    from prunekit.compact import TracerAPI
    from prunekit.compact.trace.tracer import Tracer

    class Half(ModuleHandler):
        def slots(self, m):
            return {}

    reg = HandlerRegistry()
    with pytest.raises(TypeError, match="Half must implement trace"):
        register_handler(nn.Linear, registry=reg)(Half)
    assert reg.lookup(nn.Linear(2, 2)) is None
    # the tracer handed to handlers provides the documented interface
    assert isinstance(Tracer(nn.Linear(2, 2), reg), TracerAPI)


class _UpBlock(nn.Module):
    """Encoder conv -> BN -> ConvTranspose upsampling, concatenated with a skip branch (UNet-like)."""

    def __init__(self, dims=2):
        super().__init__()
        conv, bn, up = {1: (nn.Conv1d, nn.BatchNorm1d, nn.ConvTranspose1d),
                        2: (nn.Conv2d, nn.BatchNorm2d, nn.ConvTranspose2d)}[dims]
        self.down = conv(3, 16, 3, stride=2, padding=1)
        self.bn = bn(16)
        self.up = up(16, 8, 2, stride=2)
        self.skip = conv(3, 8, 1)
        self.head = conv(16, 2, 1)

    def forward(self, x):
        u = torch.relu(self.up(torch.relu(self.bn(self.down(x)))))
        return self.head(torch.cat([u, self.skip(x)], 1))


@pytest.mark.parametrize("dims", [1, 2])
def test_conv_transpose_input_and_output_channels(dims):
    x = torch.randn((2, 3) + (16,) * dims, generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    k = 3 ** dims
    t = 2 ** dims  # transposed kernel positions
    n_out = 2 * 2 * 16 ** dims  # head's output elements
    n_half = 2 * 8 ** dims  # one channel of the downsampled map
    params = (3 * 8 * k + 8) + 2 * 8 + (8 * 4 * t + 4) + (3 * 4 + 4) + (8 * 2 + 2)
    macs = n_half * 8 * 3 * k + n_half * 8 * 4 * t + n_out // 2 * 4 * 3 + n_out * 8
    _, small = _check(lambda: _UpBlock(dims), x, params, macs)
    assert (small.up.in_channels, small.up.out_channels, small.head.in_channels) == (8, 4, 8)


def test_count_macs_counts_transposed_convolutions():
    up = nn.ConvTranspose2d(4, 6, 3, stride=2)
    x = torch.randn(2, 4, 5, 5)
    assert count_macs(up, x) == 2 * 4 * 5 * 5 * 6 * 3 * 3  # every input element meets out x kernel weights


class _ScalarGated(nn.Module):
    """An FFN whose output is scaled per position by a one-channel gate (Qwen2-MoE's shared expert)."""

    def __init__(self, conv: bool = False):
        super().__init__()
        self.up = nn.Conv1d(8, 16, 1) if conv else nn.Linear(8, 16)
        self.gate = nn.Conv1d(8, 1, 1) if conv else nn.Linear(8, 1)
        self.down = nn.Conv1d(16, 8, 1) if conv else nn.Linear(16, 8)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)) * torch.sigmoid(self.gate(x)))


@pytest.mark.parametrize("conv", [False, True])
def test_a_single_output_channel_gates_without_coupling_the_channels_it_scales(conv):
    m = _ScalarGated(conv)
    x = torch.randn(3, 8, 5) if conv else torch.randn(3, 8)
    g = build_dependency_graph(m, x)
    ffn = [grp for grp in g.groups if ("up", "out") in grp.slots]
    assert len(ffn) == 1 and ffn[0].prunable and ffn[0].n_units == 16
    assert set(ffn[0].slots) == {("up", "out"), ("down", "in")}
    gate = [grp for grp in g.groups if ("gate", "out") in grp.slots]
    assert len(gate) == 1 and gate[0].slots == (("gate", "out"),)
    assert not gate[0].prunable and "'gate' has a single output channel" in gate[0].blocked
    prune_groups(m, x, 0.5)
    small = compact(m, x)
    assert small.up.weight.shape[0] == 8 and small.gate.weight.shape[0] == 1
    assert torch.allclose(small(x), m(x), atol=1e-6)
