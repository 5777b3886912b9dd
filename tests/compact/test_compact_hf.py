"""Compaction of Hugging Face model families built from small configs (random weights, no download).

Each family is pruned by 50% of its attention heads (or key/value groups) and feed-forward
neurons, compacted, and compared with the masked model (relative error < 1e-5); uniform
results are saved with ``save_pretrained`` and loaded with ``from_pretrained`` (plain
``transformers``, no prunekit) with identical outputs.
"""

from __future__ import annotations

import os

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed")

from helpers import hf_models as H  # noqa: E402
from prunekit.compact import (  # noqa: E402
    build_dependency_graph,
    compact,
    compaction_description,
    count_params,
    prune_groups,
)

pytestmark = pytest.mark.usefixtures("one_thread", "quiet_transformers")

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _out(model, x):
    with torch.no_grad():
        return model(**x)[0]


def _rel(a, b):
    return float((a - b).norm() / b.norm())


TOKENS = {"input_ids": H.ids()}
# family -> (factory, inputs, path of block 0's attention, config key of the FFN size, config saves heads)
FAMILIES = {
    "llama": (H.llama, TOKENS, "layers.0.self_attn", "intermediate_size", True),
    "mistral": (lambda: H.llama("mistral"), TOKENS, "layers.0.self_attn", "intermediate_size", True),
    "qwen2": (lambda: H.llama("qwen2"), TOKENS, "layers.0.self_attn", "intermediate_size", True),
    "gpt2": (H.gpt2, TOKENS, "h.0.attn", "n_inner", False),
    "vit": (H.vit, {"pixel_values": H.pixels()}, "layers.0.attention", "intermediate_size", True),
    "distilbert": (H.distilbert, TOKENS, "transformer.layer.0.attention", "hidden_dim", False),
    "t5_encoder": (H.t5_encoder, TOKENS, "encoder.block.0.layer.0.SelfAttention", "d_ff", True),
    "t5_gated": (lambda: H.t5_encoder(gated=True), TOKENS, "encoder.block.0.layer.0.SelfAttention", "d_ff", True),
    "bert": (H.bert, TOKENS, "encoder.layer.0.attention.self", "intermediate_size", False),
    "roberta": (lambda: H.bert("roberta"), TOKENS, "encoder.layer.0.attention.self", "intermediate_size", False),
}


def _heads(attn):
    for attr in ("num_heads", "n_heads", "num_attention_heads"):
        if isinstance(getattr(attn, attr, None), int):
            return getattr(attn, attr)
    # Llama-style modules keep no head count: the query projection says it
    return attn.q_proj.out_features // attn.head_dim


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_compacts_exactly_and_round_trips(family, tmp_path):
    make, x, attn_path, ffn_key, saves_heads = FAMILIES[family]
    torch.manual_seed(0)
    model = make()
    dense_out = _out(model, x)
    heads0 = _heads(model.get_submodule(attn_path))
    decisions = prune_groups(model, x, 0.5, uniform=True)
    assert decisions and all(len(d.removed) == d.total // 2 for d in decisions)
    small = compact(model, x)
    masked = _out(model, x)
    assert _rel(_out(small, x), masked) < 1e-5
    assert not torch.equal(masked, dense_out)  # the masks did something
    attn = small.get_submodule(attn_path)
    # half of the heads go (GQA: half of the key/value groups, each with its query heads)
    assert _heads(attn) == heads0 // 2
    assert count_params(small) < count_params(model)
    desc = compaction_description(small)
    if saves_heads:
        assert desc["hf_config"] == "updated"
        assert getattr(small.config, ffn_key) == getattr(model.config, ffn_key) // 2
        small.save_pretrained(tmp_path)
        again = type(small).from_pretrained(tmp_path).eval()
        assert torch.equal(_out(again, x), _out(small, x))
    else:  # the config derives the head size from hidden_size / heads: it cannot express fewer heads
        assert desc["hf_config"].startswith("not updated") and "head size" in desc["hf_config"]


@pytest.mark.parametrize("family", ["gpt2", "distilbert", "bert"])
def test_ffn_only_pruning_round_trips_where_heads_cannot(family, tmp_path):
    make, x, attn_path, ffn_key, _ = FAMILIES[family]
    model = make()
    ignored = [n for n, m in model.named_modules() if type(m) is type(model.get_submodule(attn_path))]
    assert len(ignored) == 2  # the attention of both blocks
    graph = build_dependency_graph(model, x, ignored_layers=ignored)
    prune_groups(model, x, 0.5, graph=graph, uniform=True)
    small = compact(model, x, graph=graph)
    assert compaction_description(small)["hf_config"] == "updated"
    assert getattr(small.config, ffn_key) == 24
    small.save_pretrained(tmp_path)
    again = type(small).from_pretrained(tmp_path).eval()
    assert torch.equal(_out(again, x), _out(small, x))
    assert _rel(_out(small, x), _out(model, x)) < 1e-5


def test_llama_gqa_query_heads_evenly_within_groups(tmp_path):
    model = H.llama(heads=8, kv_heads=2, hidden=64)
    x = TOKENS
    graph = build_dependency_graph(model, x, gqa="query_heads")
    heads = [g for g in graph.prunable_groups() if ("layers.0.self_attn", "q") in g.slots]
    assert [(len(g.units), g.units[0].width()) for g in heads] == [(4, 16)]  # head j of both groups
    prune_groups(model, x, 0.5, graph=graph)
    small = compact(model, x, graph=graph)
    attn = small.layers[0].self_attn
    assert (attn.q_proj.out_features, attn.k_proj.out_features, attn.num_key_value_groups) == (32, 16, 2)
    assert _rel(_out(small, x), _out(model, x)) < 1e-5
    assert (small.config.num_attention_heads, small.config.num_key_value_heads, small.config.head_dim) == (4, 2, 8)
    small.save_pretrained(tmp_path)
    assert torch.equal(_out(transformers.LlamaModel.from_pretrained(tmp_path), x), _out(small, x))


def test_llama_kv_groups_take_their_query_heads():
    model = H.llama(heads=8, kv_heads=2, hidden=64)
    graph = build_dependency_graph(model, TOKENS)
    groups = [g for g in graph.prunable_groups() if ("layers.0.self_attn", "k") in g.slots]
    assert len(groups) == 1
    (unit,) = groups[0].units[:1]
    # a key/value group: 8 key rows, 8 value rows, its 4 query heads (32 rows) and their 32 output columns
    sizes = {s: int(v.numel()) for (m, s), v in unit.members.items()}
    assert sizes == {"q": 32, "k": 8, "v": 8, "heads": 4, "o_in": 32}


def test_t5_heads_are_tied_across_layers_through_the_position_bias():
    model = H.t5_encoder(layers=3)
    graph = build_dependency_graph(model, TOKENS)
    (heads,) = [g for g in graph.prunable_groups() if any(s == "heads" for _, s in g.slots)]
    attn = {m for m, _ in heads.slots}
    assert attn == {f"encoder.block.{i}.layer.0.SelfAttention" for i in range(3)}
    assert len(heads.units) == 4
    prune_groups(model, TOKENS, 0.5)
    small = compact(model, TOKENS)
    assert small.encoder.block[0].layer[0].SelfAttention.relative_attention_bias.weight.shape == (32, 2)
    assert _rel(_out(small, TOKENS), _out(model, TOKENS)) < 1e-5


def test_cross_attention_heads_and_separate_key_value_inputs():
    model = H.bert(cross=True)
    x = {"input_ids": H.ids(), "encoder_hidden_states": torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(1))}
    d = prune_groups(model, x, 0.5)
    cross = [r for r in d if any("crossattention.self" in m for m, _ in r.group.slots)]
    assert len(cross) == 2 and all(r.total == 4 and len(r.removed) == 2 for r in cross)
    small = compact(model, x)
    c = small.encoder.layer[0].crossattention.self
    assert c.query.out_features == 16 and c.key.in_features == 32  # the encoder's width is not this model's
    assert _rel(_out(small, x), _out(model, x)) < 1e-5


def test_cached_keys_block_attention_with_a_reason():
    model = H.llama()
    past = transformers.DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=H.ids(tokens=3), cache=past, use_cache=True)
    g = build_dependency_graph(model, {"input_ids": H.ids(tokens=2), "cache": past, "use_cache": True})
    reasons = {gr.blocked for gr in g.groups if any(s == "k" for _, s in gr.slots)}
    assert reasons and all("cached keys/values" in r for r in reasons)


def test_approximate_hidden_size_reports_its_error_and_updates_the_config(tmp_path):
    from prunekit.compact import load_compacted, save_compacted

    def make():
        torch.manual_seed(0)
        cfg = transformers.LlamaConfig(vocab_size=H.VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
        return transformers.LlamaForCausalLM(cfg).eval()

    model = make()
    exact = build_dependency_graph(model, TOKENS)
    hidden = [g for g in exact.groups if ("model.norm", "features") in g.slots]
    assert len(hidden) == 1 and "RMSNorm 'model.layers.0.input_layernorm' normalizes over these" in hidden[0].blocked
    graph = build_dependency_graph(model, TOKENS, exact=False)
    decisions = prune_groups(model, TOKENS, 0.25, graph=graph)
    assert sorted((d.total, len(d.removed)) for d in decisions) == [(2, 0), (2, 0), (32, 8), (48, 12), (48, 12)]
    small = compact(model, TOKENS, graph=graph)
    assert small.model.norm.weight.shape == (24,) and small.model.embed_tokens.weight.shape == (H.VOCAB, 24)
    err = _rel(_out(small, TOKENS), _out(model, TOKENS))
    desc = compaction_description(small)
    assert 1e-3 < err == pytest.approx(desc["approximate"]["output_relative_error"], rel=1e-3)
    # the config says the new hidden size: plain from_pretrained rebuilds the model
    assert desc["hf_config"] == "updated"
    assert small.config.hidden_size == 24 and small.config.intermediate_size == 36 and model.config.hidden_size == 32
    small.save_pretrained(tmp_path / "hf")
    plain = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert torch.equal(_out(plain, TOKENS), _out(small, TOKENS))
    save_compacted(small, tmp_path / "small.pt")
    saved = torch.load(tmp_path / "small.pt", weights_only=True)
    again = load_compacted(make(), saved["state_dict"], saved["description"])
    assert torch.equal(_out(again, TOKENS), _out(small, TOKENS))


def test_gpt2_cross_attention_fused_conv1d_heads():
    cfg = transformers.GPT2Config(vocab_size=H.VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, n_inner=48,
                                  add_cross_attention=True)
    torch.manual_seed(0)
    model = transformers.GPT2Model(cfg).eval()
    x = {"input_ids": H.ids(), "encoder_hidden_states": torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(1))}
    d = prune_groups(model, x, 0.5)
    assert sorted((r.group.slots[0][0], r.total, len(r.removed)) for r in d if r.total == 4) == [
        ("h.0.attn", 4, 2), ("h.0.crossattention", 4, 2), ("h.1.attn", 4, 2), ("h.1.crossattention", 4, 2)]
    small = compact(model, x)
    cross = small.h[0].crossattention
    assert (cross.q_attn.nf, cross.c_attn.nf, cross.c_proj.nx) == (16, 32, 16)  # query, fused key+value, output
    assert _rel(_out(small, x), _out(model, x)) < 1e-5


@pytest.mark.parametrize("inplace", [False, True])
def test_a_tied_lm_head_stays_tied_to_its_embedding(inplace, tmp_path):
    from helpers import shrink_models

    model = shrink_models.build("gemma")  # ties lm_head to embed_tokens
    x = shrink_models.batches("gemma")[0]
    assert model.lm_head.weight is model.model.embed_tokens.weight
    graph = build_dependency_graph(model, x, exact=False)
    prune_groups(model, x, 0.25, graph=graph)
    small = compact(model, x, graph=graph, inplace=inplace)
    assert small.lm_head.weight is small.model.embed_tokens.weight
    assert small.lm_head.weight.shape == (shrink_models.VOCAB, 24)
    count = sum(p.numel() for p in small.parameters())  # one tensor, counted once
    small.save_pretrained(tmp_path / "hf")
    plain = type(small).from_pretrained(tmp_path / "hf").eval()
    assert sum(p.numel() for p in plain.parameters()) == count
    assert torch.equal(shrink_models.output(plain, x), shrink_models.output(small, x))
