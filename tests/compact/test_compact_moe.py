"""Compaction of transformers-5 mixture-of-experts blocks (Mixtral, Qwen2-MoE, Qwen3-MoE, GPT-OSS).

The router (``mlp.gate``, a bare ``weight [E, H]``) and the experts module (3-D
``gate_up_proj [E, 2I, H]`` / ``down_proj [E, H, I]``) are leaves: their hidden-size axes
belong to the hidden group; the experts' FFN neurons are one blocked group (prunekit.shrink
removes them). The hidden size stays a multiple of 8: ``torch._grouped_mm``, the default
experts implementation, needs rows of a multiple of 16 bytes.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed")

from helpers import shrink_models as sm  # noqa: E402
from prunekit.compact import (  # noqa: E402
    build_dependency_graph,
    compact,
    compaction_description,
    load_compacted,
    prune_groups,
    save_compacted,
)

pytestmark = pytest.mark.usefixtures("one_thread", "quiet_transformers")

LAYERS = 2
HIDDEN, EXPERTS = 32, 4
EXPERT_FFN = {"mixtral": 48, "qwen2_moe": 24, "qwen3_moe": 24}


def _make(family):
    return sm.build(family, num_hidden_layers=LAYERS)


def _x(family):
    return sm.batches(family, n=1)[0]


def _rel(a, b):
    return float((a - b).norm() / b.norm())


def _group_of(graph, key):
    found = [g for g in graph.groups if key in g.slots]
    assert len(found) == 1, key
    return found[0]


@pytest.mark.parametrize("family", sm.MOE)
def test_router_and_experts_read_and_write_the_hidden_size(family):
    model = _make(family)
    x = _x(family)
    dense = sm.output(model, x)
    graph = build_dependency_graph(model, x, exact=False)
    assert torch.equal(sm.output(model, x), dense)  # tracing changed nothing
    hidden = _group_of(graph, ("model.norm", "features"))
    assert hidden.prunable and hidden.n_units == HIDDEN
    for i in range(LAYERS):
        mlp = f"model.layers.{i}.mlp"
        assert {(f"{mlp}.gate", "in"), (f"{mlp}.experts", "in"), (f"{mlp}.experts", "out")} <= set(hidden.slots)
        ffn = _group_of(graph, (f"{mlp}.experts", "down_in"))
        assert set(ffn.slots) == {(f"{mlp}.experts", "up"), (f"{mlp}.experts", "down_in")}
        n = EXPERT_FFN[family]
        assert ffn.n_units == n
        index = ffn.member_index()
        for slot, want in (("up", [3, n + 3]), ("down_in", [3])):  # neuron 3: gate row 3, up row n + 3, column 3
            idx, unit_of = index[(f"{mlp}.experts", slot)]
            assert sorted(idx[unit_of == unit_of[idx == 3][0]].tolist()) == want
        assert not ffn.prunable and "prunekit.shrink.shrink_expert_ffn" in ffn.blocked
    # exact=True: the same group, blocked by the RMS norms it passes through
    exact = _group_of(build_dependency_graph(model, x), ("model.norm", "features"))
    assert not exact.prunable and "normalizes over these features" in exact.blocked
    assert ("model.layers.0.mlp.gate", "in") in exact.slots


def test_qwen2_moe_shared_expert_gate_stays_and_does_not_couple_the_hidden_size():
    model = _make("qwen2_moe")
    graph = build_dependency_graph(model, _x("qwen2_moe"), exact=False)
    hidden = _group_of(graph, ("model.norm", "features"))
    assert hidden.n_units == HIDDEN and hidden.prunable
    for i in range(LAYERS):
        mlp = f"model.layers.{i}.mlp"
        assert (f"{mlp}.shared_expert_gate", "in") in hidden.slots
        gate_out = _group_of(graph, (f"{mlp}.shared_expert_gate", "out"))
        assert gate_out.slots == ((f"{mlp}.shared_expert_gate", "out"),) and not gate_out.prunable
        assert "single output channel" in gate_out.blocked
        shared = _group_of(graph, (f"{mlp}.shared_expert.gate_proj", "out"))
        assert shared.prunable and shared.n_units == 40
        assert (f"{mlp}.shared_expert.down_proj", "in") in shared.slots


def _check_moe_shapes(small, family, hidden, ffn):
    for i in range(LAYERS):
        mlp = small.model.layers[i].mlp
        assert tuple(mlp.gate.weight.shape) == (EXPERTS, hidden) and mlp.gate.hidden_dim == hidden
        assert tuple(mlp.experts.gate_up_proj.shape) == (EXPERTS, 2 * ffn, hidden)
        assert tuple(mlp.experts.down_proj.shape) == (EXPERTS, hidden, ffn)
        assert mlp.experts.hidden_dim == hidden and mlp.experts.intermediate_dim == ffn
        if family == "qwen2_moe":
            assert tuple(mlp.shared_expert_gate.weight.shape) == (1, hidden)


@pytest.mark.parametrize("family", sm.MOE)
def test_approximate_hidden_size_compacts_router_and_experts(family, tmp_path):
    model = _make(family)
    x = _x(family)
    graph = build_dependency_graph(model, x, exact=False)
    decisions = prune_groups(model, x, 0.25, graph=graph)
    assert (HIDDEN, 8) in {(d.total, len(d.removed)) for d in decisions}  # the hidden size: 32 -> 24
    small = compact(model, x, graph=graph)
    _check_moe_shapes(small, family, 24, EXPERT_FFN[family])
    masked = sm.output(model, x)
    err = _rel(sm.output(small, x), masked)
    desc = compaction_description(small)
    assert 1e-3 < err == pytest.approx(desc["approximate"]["output_relative_error"], rel=1e-3)
    assert desc["hf_config"] == "updated" and small.config.hidden_size == 24  # the experts keep their widths
    # every experts implementation runs the compacted experts alike
    grouped = sm.output(small, x)
    for impl in ("eager", "batched_mm"):
        small.config._experts_implementation = impl
        assert _rel(sm.output(small, x), grouped) < 1e-5
    small.config._experts_implementation = "grouped_mm"
    # the description rebuilds the 3-D expert tensors and the routers from the original class
    save_compacted(small, tmp_path / "small.pt")
    saved = torch.load(tmp_path / "small.pt", weights_only=True)
    again = load_compacted(_make(family), saved["state_dict"], saved["description"])
    _check_moe_shapes(again, family, 24, EXPERT_FFN[family])
    assert torch.equal(sm.output(again, x), grouped)


@pytest.mark.parametrize("family", sm.MOE)
def test_heads_and_shared_expert_compact_exactly_and_experts_stay(family):
    model = _make(family)
    x = _x(family)
    dense = sm.output(model, x)
    decisions = prune_groups(model, x, 0.5, uniform=True)
    shared = [(40, 20)] * LAYERS if family == "qwen2_moe" else []
    assert sorted((d.total, len(d.removed)) for d in decisions) == [(2, 1)] * LAYERS + shared
    masked = sm.output(model, x)
    assert not torch.equal(masked, dense)
    small = compact(model, x)
    assert _rel(sm.output(small, x), masked) < 1e-5
    _check_moe_shapes(small, family, HIDDEN, EXPERT_FFN[family])
    attn = small.model.layers[0].self_attn
    assert attn.q_proj.out_features == 2 * attn.head_dim and attn.k_proj.out_features == attn.head_dim
    if family == "qwen2_moe":
        assert small.model.layers[0].mlp.shared_expert.gate_proj.out_features == 20


def test_masked_expert_neurons_stay_and_say_why():
    model = _make("mixtral")
    x = _x("mixtral")
    with torch.no_grad():
        model.model.layers[0].mlp.experts.down_proj[:, :, 4:8] = 0  # neurons 4..7 read by no expert
    prune_groups(model, x, 0.5, uniform=True)  # heads, so that compact has something to remove
    small = compact(model, x)
    assert tuple(small.model.layers[0].mlp.experts.down_proj.shape) == (EXPERTS, HIDDEN, 48)
    kept = [k for k in compaction_description(small)["kept"] if "model.layers.0.mlp.experts.down_in" in k["channels"]]
    assert len(kept) == 1 and kept[0]["units"] == [4, 5, 6, 7]
    assert "shrink_expert_ffn" in kept[0]["reason"]
    assert _rel(sm.output(small, x), sm.output(model, x)) < 1e-5


def _gpt_oss():
    cfg = transformers.GptOssConfig(vocab_size=64, hidden_size=HIDDEN, intermediate_size=32, num_hidden_layers=LAYERS,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=EXPERTS,
                                    num_experts_per_tok=2, max_position_embeddings=64)
    torch.manual_seed(0)
    return transformers.GptOssForCausalLM(cfg).eval()


def test_gpt_oss_transposed_biased_experts_and_attention_sinks():
    x = _x("mixtral")
    model = _gpt_oss()
    experts = model.model.layers[0].mlp.experts  # gate_up_proj [E, H, 2I] with biases: its input axis is 1
    assert tuple(experts.gate_up_proj.shape) == (EXPERTS, HIDDEN, 64) and experts.is_transposed
    decisions = prune_groups(model, x, 0.5, uniform=True)
    assert sorted((d.total, len(d.removed)) for d in decisions) == [(2, 1)] * LAYERS
    masked = sm.output(model, x)
    small = compact(model, x)
    assert _rel(sm.output(small, x), masked) < 1e-5
    assert tuple(small.model.layers[0].self_attn.sinks.shape) == (2,)  # one attention sink per query head left
    # the hidden size through transposed expert weights and per-expert biases
    model = _gpt_oss()
    graph = build_dependency_graph(model, x, exact=False)
    up, unit_of = _group_of(graph, ("model.layers.0.mlp.experts", "up")).member_index()[("model.layers.0.mlp.experts", "up")]
    assert sorted(up[unit_of == unit_of[up == 6][0]].tolist()) == [6, 7]  # interleaved: neuron 3 is gate/up rows 6, 7
    prune_groups(model, x, 0.25, graph=graph)
    small = compact(model, x, graph=graph)
    experts, router = small.model.layers[0].mlp.experts, small.model.layers[0].mlp.router
    assert tuple(experts.gate_up_proj.shape) == (EXPERTS, 24, 64) and tuple(experts.gate_up_proj_bias.shape) == (EXPERTS, 64)
    assert tuple(experts.down_proj.shape) == (EXPERTS, 32, 24) and tuple(experts.down_proj_bias.shape) == (EXPERTS, 24)
    assert tuple(router.weight.shape) == (EXPERTS, 24) and experts.hidden_size == 24
    err = compaction_description(small)["approximate"]["output_relative_error"]
    assert 1e-3 < err == pytest.approx(_rel(sm.output(small, x), sm.output(model, x)), rel=1e-3)


@pytest.mark.parametrize("exact", [True, False])
def test_qwen2_moe_config_follows_heads_shared_expert_and_hidden(exact, tmp_path):
    model = _make("qwen2_moe")
    x = _x("qwen2_moe")
    graph = build_dependency_graph(model, x, exact=exact)
    prune_groups(model, x, 0.5 if exact else 0.25, graph=graph, uniform=True)
    small = compact(model, x, graph=graph)
    assert compaction_description(small)["hf_config"] == "updated"
    cfg = small.config
    want = (32, 2, 1, 20) if exact else (24, 4, 2, 30)
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.shared_expert_intermediate_size) == want
    assert cfg.moe_intermediate_size == 24 and cfg.head_dim == 8  # the routed experts keep their width
    small.save_pretrained(tmp_path)
    again = type(small).from_pretrained(tmp_path).eval()
    assert torch.equal(sm.output(again, x), sm.output(small, x))


def test_qwen2_moe_dense_blocks_of_another_width_leave_the_config():
    model = sm.build("qwen2_moe", num_hidden_layers=LAYERS, mlp_only_layers=[1])  # block 1: a dense MLP of 48
    x = _x("qwen2_moe")
    prune_groups(model, x, 0.5, uniform=True)
    small = compact(model, x)
    assert small.model.layers[1].mlp.gate_proj.out_features == 24
    assert small.model.layers[0].mlp.shared_expert.gate_proj.out_features == 20
    desc = compaction_description(small)
    assert desc["hf_config"].startswith("not updated") and "feed-forward size differs" in desc["hf_config"]
