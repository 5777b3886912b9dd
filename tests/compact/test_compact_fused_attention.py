"""Attention heads of Phi-3 (one fused ``qkv_proj``, grouped-query) and OPT (``out_proj``), and the
Hugging Face config update of Qwen3 (the Llama layout with per-head q/k norms)."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed")

from helpers import shrink_models as sm  # noqa: E402
from prunekit.compact import build_dependency_graph, compact, compaction_description, prune_groups  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread", "quiet_transformers")

LAYERS = 2


def _make(family):
    return sm.build(family, num_hidden_layers=LAYERS)


def _x(family):
    return sm.batches(family, n=1)[0]


def _rel(a, b):
    return float((a - b).norm() / b.norm())


def _attention_group(graph, attn):
    found = [g for g in graph.groups if (attn, "q") in g.slots]
    assert len(found) == 1
    return found[0]


@pytest.mark.parametrize("gqa, slots", [("groups", ("q", "k", "v", "o_in", "heads")), ("query_heads", ("q", "o_in", "heads"))])
def test_phi3_fused_qkv_heads_are_units(gqa, slots):
    model = _make("phi3")  # 4 query heads of 8 in 2 key/value groups, one qkv_proj of (4 + 2 + 2) * 8 rows
    dense = sm.output(model, _x("phi3"))
    grp = _attention_group(build_dependency_graph(model, _x("phi3"), gqa=gqa), "model.layers.0.self_attn")
    assert torch.equal(sm.output(model, _x("phi3")), dense)  # tracing changed nothing
    assert grp.prunable and grp.n_units == 2  # key/value groups, or the j-th query head of every group
    assert set(grp.slots) == {("model.layers.0.self_attn", s) for s in slots}


@pytest.mark.parametrize("gqa, kv_heads", [("groups", 1), ("query_heads", 2)])
def test_phi3_heads_compact_exactly_once_the_config_says_them(gqa, kv_heads):
    model = _make("phi3")
    x = _x("phi3")
    decisions = prune_groups(model, x, 0.5, uniform=True, gqa=gqa)
    assert sorted((d.total, len(d.removed)) for d in decisions) == [(2, 1)] * LAYERS + [(48, 24)] * LAYERS
    masked = sm.output(model, x)
    # Phi3Attention splits qkv_proj at config.num_attention_heads: it runs once the config says 2 heads
    small = compact(model, x, gqa=gqa, check=False)
    small.config.num_attention_heads = 2
    assert _rel(sm.output(small, x), masked) < 1e-5
    attn, mlp = small.model.layers[0].self_attn, small.model.layers[0].mlp
    assert attn.qkv_proj.out_features == (2 + 2 * kv_heads) * 8 and attn.o_proj.in_features == 16
    assert attn.num_key_value_heads == kv_heads and attn.num_key_value_groups == 2 // kv_heads
    assert mlp.gate_up_proj.out_features == 48 and mlp.down_proj.in_features == 24


def test_phi3_heads_and_ffn_round_trip_through_from_pretrained(tmp_path):
    model = _make("phi3")
    x = _x("phi3")
    prune_groups(model, x, 0.5, uniform=True)
    small = compact(model, x)
    assert compaction_description(small)["hf_config"] == "updated"
    assert small.config.num_attention_heads == 2 and small.config.intermediate_size == 24
    small.save_pretrained(tmp_path)
    again = type(small).from_pretrained(tmp_path).eval()
    assert torch.equal(sm.output(again, x), sm.output(small, x))


def test_opt_heads_and_ffn_compact_exactly():
    model = _make("opt")
    x = _x("opt")
    dense = sm.output(model, x)
    grp = _attention_group(build_dependency_graph(model, x), "model.decoder.layers.0.self_attn")
    assert grp.prunable and grp.n_units == 4
    assert torch.equal(sm.output(model, x), dense)  # tracing changed nothing
    decisions = prune_groups(model, x, 0.5, uniform=True)
    assert sorted((d.total, len(d.removed)) for d in decisions) == [(4, 2)] * LAYERS + [(48, 24)] * LAYERS
    masked = sm.output(model, x)
    assert not torch.equal(masked, dense)
    small = compact(model, x)
    assert _rel(sm.output(small, x), masked) < 1e-5
    attn = small.model.decoder.layers[0].self_attn
    assert attn.num_heads == 2 and attn.q_proj.out_features == 16 and attn.out_proj.in_features == 16
    # OPT's config derives the head size from hidden_size / heads: it cannot say 2 heads of 8
    desc = compaction_description(small)
    assert desc["hf_config"].startswith("not updated") and "head size" in desc["hf_config"]


def _round_trip(model, x, tmp_path, graph=None):
    masked_small = compact(model, x, graph=graph)
    assert compaction_description(masked_small)["hf_config"] == "updated"
    masked_small.save_pretrained(tmp_path)
    again = type(masked_small).from_pretrained(tmp_path).eval()
    assert torch.equal(sm.output(again, x), sm.output(masked_small, x))
    assert _rel(sm.output(masked_small, x), sm.output(model, x)) < 1e-5
    return again


def test_opt_ffn_round_trips_through_from_pretrained(tmp_path):
    model = _make("opt")
    x = _x("opt")
    attention = [n for n, m in model.named_modules() if n.endswith("self_attn")]
    graph = build_dependency_graph(model, x, ignored_layers=attention)
    prune_groups(model, x, 0.5, graph=graph, uniform=True)
    again = _round_trip(model, x, tmp_path, graph)
    assert again.config.ffn_dim == 24 and again.model.decoder.layers[1].fc1.out_features == 24


def test_qwen3_round_trips_through_from_pretrained(tmp_path):
    model = _make("qwen3")
    x = _x("qwen3")
    prune_groups(model, x, 0.5, uniform=True)
    again = _round_trip(model, x, tmp_path)
    assert (again.config.num_attention_heads, again.config.num_key_value_heads, again.config.intermediate_size) == (2, 1, 24)
