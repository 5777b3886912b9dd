"""Depth: block importance, skipping blocks, removing them (config consistent, checkpoints that load back)."""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from prunekit.shrink import (block_influence, family_of, layer_list, layer_loss_importance, remove_layers,
                             skipped_layers)

pytestmark = [pytest.mark.hf, pytest.mark.usefixtures("one_thread")]
transformers = pytest.importorskip("transformers")
from helpers import shrink_models  # noqa: E402

DECODERS = [f for f in shrink_models.FAMILIES if shrink_models.SPECS[f][2].endswith(("ForCausalLM", "LMHeadModel"))]


def padded_batch(family):
    batch = shrink_models.batches(family, n=1)[0]
    if "attention_mask" in batch:
        batch["attention_mask"][1, -3:] = 0
    return batch


def layer_idxs(model):
    _, blocks = layer_list(model)
    return [[m.layer_idx for m in block.modules() if isinstance(m.__dict__.get("layer_idx"), int)]
            for block in blocks]


def snapshot(model):
    """What must come back after a failed removal: the block objects, layer_idx values, config."""
    _, blocks = layer_list(model)
    return list(blocks), layer_idxs(model), model.config.to_dict()


def reload(model, family, tmp_path):
    model.save_pretrained(tmp_path)
    auto = transformers.AutoModelForCausalLM if family in DECODERS else transformers.AutoModel
    loaded = auto.from_pretrained(tmp_path)
    assert type(loaded) is type(model)
    return loaded.eval()


def layers_key(model):
    return family_of(model)[1].layers_key


# ------------------------------------------------------------------ every family: remove == skip, and round trip
@pytest.mark.parametrize("family", shrink_models.FAMILIES)
def test_removing_two_of_four_blocks_equals_skipping_them_and_round_trips(family, tmp_path):
    model = shrink_models.build(family)
    batch = padded_batch(family)
    dense = shrink_models.output(model, batch)
    with skipped_layers(model, [1, 2]):
        skipped = shrink_models.output(model, batch)
    assert not torch.allclose(skipped, dense, atol=1e-3)  # skipping changes the model
    assert torch.equal(shrink_models.output(model, batch), dense)  # and is undone on exit

    remove_layers(model, [1, 2])
    _, blocks = layer_list(model)
    assert len(blocks) == 2 and list(blocks._modules) == ["0", "1"]
    assert getattr(model.config, layers_key(model)) == 2
    assert all(ids == [j] * len(ids) for j, ids in enumerate(layer_idxs(model)))
    assert torch.equal(shrink_models.output(model, batch), skipped)  # bit for bit

    loaded = reload(model, family, tmp_path)
    assert getattr(loaded.config, layers_key(loaded)) == 2 and len(layer_list(loaded)[1]) == 2
    assert torch.equal(shrink_models.output(loaded, batch), skipped)


@pytest.mark.parametrize("family", DECODERS)
def test_kv_cache_and_generate_work_with_the_new_block_count(family, tmp_path):
    model = shrink_models.build(family)
    remove_layers(model, [1, 2])
    loaded = reload(model, family, tmp_path)
    ids = shrink_models.batches(family, n=1)[0]["input_ids"]
    for m in (model, loaded):
        with torch.no_grad():
            prefix = m(input_ids=ids[:, :-1], use_cache=True)
            key = "cache" if "cache" in prefix else "past_key_values"  # transformers >= 5.25 names it cache
            assert len(prefix[key]) == 2
            step = m(input_ids=ids[:, -1:], use_cache=True, **{key: prefix[key]})
            full = m(input_ids=ids, use_cache=False)
        torch.testing.assert_close(step.logits[:, -1], full.logits[:, -1], atol=1e-5, rtol=1e-5)
        cached = m.generate(ids, max_new_tokens=4, do_sample=False, use_cache=True)
        uncached = m.generate(ids, max_new_tokens=4, do_sample=False, use_cache=False)
        assert cached.shape == (ids.shape[0], ids.shape[1] + 4) and torch.equal(cached, uncached)


# ------------------------------------------------------------------ importance
def make_identity(model, family, i):
    """Zero block ``i``'s writers to the residual stream: the block returns its input exactly."""
    _, blocks = layer_list(model)
    block = blocks[i]
    writers = {"llama": ("self_attn.o_proj", "mlp.down_proj"), "gpt2": ("attn.c_proj", "mlp.c_proj")}[family]
    with torch.no_grad():
        for path in writers:
            for p in block.get_submodule(path).parameters():
                p.zero_()


def manual_influence(model, batches):
    """1 - cos of consecutive hidden states (output_hidden_states), over real tokens; the last block left out
    (its hidden state comes after the final norm)."""
    sums, counts = 0.0, 0
    for b in batches:
        with torch.no_grad():
            hs = model(**b, output_hidden_states=True).hidden_states
        keep = b["attention_mask"].bool()
        lost = torch.stack([1 - F.cosine_similarity(hs[i].double(), hs[i + 1].double(), dim=-1)
                            for i in range(len(hs) - 2)])
        sums, counts = sums + lost[:, keep].sum(dim=1), counts + int(keep.sum())
    return sums / counts


def test_block_influence_is_one_minus_cosine_over_real_tokens_only():
    model = shrink_models.build("llama")
    batches = shrink_models.batches("llama", n=2)
    batches[1]["attention_mask"][0, -4:] = 0
    scores = block_influence(model, batches)
    assert scores.shape == (4,) and scores.dtype == torch.float64
    torch.testing.assert_close(scores[:3], manual_influence(model, batches), atol=1e-6, rtol=1e-5)
    changed = [dict(b) for b in batches]
    changed[1] = dict(batches[1], input_ids=batches[1]["input_ids"].clone())
    changed[1]["input_ids"][0, -4:] = 7  # padding (right, causal): changes no real token's states
    torch.testing.assert_close(block_influence(model, changed), scores, atol=1e-12, rtol=0)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_an_identity_block_has_zero_influence_and_ranks_least_important(family):
    model = shrink_models.build(family)
    batches = shrink_models.batches(family, n=2)
    make_identity(model, family, 2)
    influence = block_influence(model, batches)
    loss = layer_loss_importance(model, batches)
    assert influence[2] < 1e-12 and int(influence.argmin()) == 2 and bool((influence[[0, 1, 3]] > 1e-4).all())
    assert loss[2] == 0.0 and bool((loss[[0, 1, 3]] != 0).all())  # next-token loss: skipping it changes nothing
    # the base model is scored by cosine to its own outputs: every other block's skip costs more than nothing
    hidden = layer_loss_importance(model.base_model, batches)
    assert hidden[2] == 0.0 and int(hidden.argmin()) == 2 and bool((hidden[[0, 1, 3]] > 1e-6).all())


def test_loss_importance_is_the_objective_increase_when_one_block_is_skipped():
    from prunekit.shrink.calibration import Objective

    for family in ("bert", "qwen2"):
        model = shrink_models.build(family)
        batches = shrink_models.batches(family, n=2)
        objective = Objective(model, batches)
        base = objective(model)
        expected = []
        for i in range(4):
            with skipped_layers(model, [i]):
                expected.append(objective(model) - base)
        scores = layer_loss_importance(model, batches)
        assert scores.dtype == torch.float64 and scores.tolist() == pytest.approx(expected, rel=1e-9, abs=1e-12)
        assert bool(torch.isfinite(scores).all()) and bool((scores.abs() > 1e-6).all())


@pytest.mark.parametrize("family", shrink_models.FAMILIES)
def test_both_scores_are_finite_per_block_and_leave_modes_and_hooks_as_they_were(family):
    model = shrink_models.build(family).train()
    model.get_submodule(layer_list(model)[0] + ".0").eval()
    modes = {n: m.training for n, m in model.named_modules()}
    batches = shrink_models.batches(family, n=2)
    for score in (block_influence, layer_loss_importance):
        values = score(model, batches)
        assert values.shape == (4,) and values.dtype == torch.float64 and bool(torch.isfinite(values).all())
        assert {n: m.training for n, m in model.named_modules()} == modes
        assert all(not m._forward_hooks for m in model.modules())


def test_a_failing_batch_leaves_no_hook_and_restores_modes():
    model = shrink_models.build("llama").train()
    good = shrink_models.batches("llama", n=1)[0]
    bad = {"input_ids": torch.full((1, 3), 10_000)}  # out of the vocabulary: the embedding raises
    for score in (block_influence, layer_loss_importance):
        with pytest.raises(IndexError):
            score(model, [good, bad])
        assert model.training and all(m.training for m in model.modules())
        assert all(not m._forward_hooks for m in model.modules())
    with pytest.raises(ValueError, match="calibration is empty"):
        block_influence(model, [])


def test_skipped_layers_removes_its_hooks_when_the_block_raises():
    model = shrink_models.build("llama")
    with pytest.raises(KeyboardInterrupt):
        with skipped_layers(model, [0, 3]):
            assert len(model.model.layers[0]._forward_hooks) == 1
            raise KeyboardInterrupt
    assert all(not m._forward_hooks for m in model.modules())


# ------------------------------------------------------------------ blocks that return tuples
class TupleBlock(nn.Module):
    """A block returning ``(hidden, extra)``, as transformers' blocks did before 5.x."""

    def __init__(self, width, layer_idx):
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.layer_idx = layer_idx

    def forward(self, hidden_states):
        pre = self.lin(hidden_states)
        return hidden_states + torch.tanh(pre), pre.mean()


class TupleModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.config = types.SimpleNamespace(model_type="llama", num_hidden_layers=4)
        self.layers = nn.ModuleList(TupleBlock(8, i) for i in range(4))

    def forward(self, x):
        extras = []
        for i, layer in enumerate(self.layers):  # positional and keyword calls
            x, extra = layer(x) if i % 2 else layer(hidden_states=x)
            extras.append(extra)
        return x, extras


def test_tuple_outputs_keep_their_extras_and_skipping_equals_removing():
    model, x = TupleModel(), torch.randn(2, 5, 8)
    with torch.no_grad():
        _, dense_extras = model(x)
        with skipped_layers(model, [1, 2]):
            skipped, extras = model(x)
        assert [float(e) for e in extras[:2]] == [float(e) for e in dense_extras[:2]]  # extras still there
        scores = block_influence(model, [x])
        remove_layers(model, [1, 2])
        removed, removed_extras = model(x)
    assert torch.equal(removed, skipped) and [float(e) for e in removed_extras] == [float(extras[0]), float(extras[3])]
    assert model.config.num_hidden_layers == 2 and [b.layer_idx for b in model.layers] == [0, 1]
    assert scores.shape == (4,) and bool((scores > 0).all())


# ------------------------------------------------------------------ bad indices: clear errors, model unchanged
@pytest.mark.parametrize("indices, error, message", [
    ([1.5], TypeError, r"block index 1.5 \(float\) is not an int; write the blocks of model.layers as ints 0..3"),
    ([True], TypeError, r"block index True \(bool\) is not an int"),
    (2, TypeError, r"indices must be a list of block indices, got 2; write e.g. \[1, 2\] \(a list even for one block\)"),
    ([4], IndexError, r"block index 4 is out of range: model.layers has 4 blocks; write indices 0..3"),
    ([-1], IndexError, r"block index -1 is out of range: model.layers has 4 blocks; write indices 0..3 \(3 for -1\)"),
    ([1, 2, 1], ValueError, r"block index 1 is given twice in \[1, 2, 1\]; name each block once"),
    ([0, 1, 2, 3], ValueError, r"removing all 4 blocks of model.layers leaves none; keep at least one"),
])
def test_bad_indices_are_named_and_change_nothing(indices, error, message):
    model = shrink_models.build("llama")
    batch = shrink_models.batches("llama", n=1)[0]
    before, out = snapshot(model), shrink_models.output(model, batch)
    with pytest.raises(error, match=f"remove_layers: {message}"):
        remove_layers(model, indices)
    with pytest.raises(error, match=f"skipped_layers: {message}"):
        with skipped_layers(model, indices):
            pass
    assert snapshot(model) == before and torch.equal(shrink_models.output(model, batch), out)
    assert all(not m._forward_hooks for m in model.modules())


def test_index_types_that_are_ints_are_accepted_and_nothing_is_a_no_op():
    model = shrink_models.build("llama")
    before = snapshot(model)
    remove_layers(model, [])
    assert snapshot(model) == before
    remove_layers(model, torch.tensor([2, 0]))
    assert len(model.model.layers) == 2 and model.model.layers[0] is before[0][1] and model.model.layers[1] is before[0][3]


# ------------------------------------------------------------------ failure atomicity
def check_unchanged_after(model, batch, before, out, error, call):
    with pytest.raises(error):
        call()
    assert snapshot(model) == before and torch.equal(shrink_models.output(model, batch), out)
    assert [id(m) for m in layer_list(model)[1]] == [id(m) for m in before[0]]


def test_a_config_setter_failing_mid_removal_leaves_the_model_as_it_was(monkeypatch):
    model = shrink_models.build("gemma2")
    batch = shrink_models.batches("gemma2", n=1)[0]
    before, out = snapshot(model), shrink_models.output(model, batch)
    cls, original = type(model.config), type(model.config).__setattr__

    def setattr_failing(self, key, value):
        if key == "layer_types":  # after num_hidden_layers, the blocks and layer_idx have changed
            raise RuntimeError("injected")
        original(self, key, value)

    monkeypatch.setattr(cls, "__setattr__", setattr_failing)
    check_unchanged_after(model, batch, before, out, RuntimeError, lambda: remove_layers(model, [1, 2]))
    monkeypatch.undo()
    monkeypatch.setattr(cls, "validate_layer_type", lambda self: (_ for _ in ()).throw(KeyboardInterrupt))
    check_unchanged_after(model, batch, before, out, KeyboardInterrupt, lambda: remove_layers(model, [0, 3]))
    monkeypatch.undo()
    remove_layers(model, [1, 2])  # and the removal still works
    assert model.config.layer_types == ["sliding_attention", "full_attention"]


def test_an_interrupt_while_renumbering_layer_idx_leaves_the_model_as_it_was(monkeypatch):
    from transformers.models.llama import modeling_llama

    model = shrink_models.build("llama")
    batch = shrink_models.batches("llama", n=1)[0]
    before, out = snapshot(model), shrink_models.output(model, batch)
    original = nn.Module.__setattr__

    def interrupted(self, key, value):
        if key == "layer_idx" and value == 1:
            raise KeyboardInterrupt
        original(self, key, value)

    monkeypatch.setattr(modeling_llama.LlamaAttention, "__setattr__", interrupted, raising=False)
    check_unchanged_after(model, batch, before, out, KeyboardInterrupt, lambda: remove_layers(model, [0, 1]))


# ------------------------------------------------------------------ per-layer config rules
def remove_and_round_trip(model, family, indices, tmp_path):
    """Remove ``indices``; the output equals the skip emulation, before and after save/from_pretrained."""
    batch = padded_batch(family)
    with skipped_layers(model, indices):
        skipped = shrink_models.output(model, batch)
    remove_layers(model, indices)
    assert torch.equal(shrink_models.output(model, batch), skipped)
    loaded = reload(model, family, tmp_path)
    assert torch.equal(shrink_models.output(loaded, batch), skipped)
    return loaded


def test_gemma2_layer_types_keep_the_kept_blocks_entries(tmp_path):
    model = shrink_models.build("gemma2", sliding_window=4)
    assert model.config.layer_types == ["sliding_attention", "full_attention"] * 2
    loaded = remove_and_round_trip(model, "gemma2", [0], tmp_path)
    assert loaded.config.layer_types == ["full_attention", "sliding_attention", "full_attention"]
    assert [b.self_attn.sliding_window for b in loaded.model.layers] == [None, 4, None]


def test_qwen2_max_window_layers_counts_the_kept_full_attention_blocks(tmp_path):
    model = shrink_models.build("qwen2", use_sliding_window=True, sliding_window=4, max_window_layers=2)
    assert model.config.layer_types == ["full_attention"] * 2 + ["sliding_attention"] * 2
    loaded = remove_and_round_trip(model, "qwen2", [1, 2], tmp_path)
    assert loaded.config.layer_types == ["full_attention", "sliding_attention"]
    assert loaded.config.max_window_layers == 1
    fields = {k: v for k, v in loaded.config.to_dict().items() if k != "layer_types"}
    assert transformers.Qwen2Config(**fields).layer_types == loaded.config.layer_types  # the threshold agrees
    unchanged = shrink_models.build("qwen2")  # 28 >= 4 blocks: every block is below it, before and after
    remove_layers(unchanged, [0])
    assert unchanged.config.max_window_layers == 28


def sparse_blocks(model):
    return [type(b.mlp).__name__.endswith("SparseMoeBlock") for b in model.model.layers]


def test_qwen_moe_sparse_step_stays_when_it_still_holds(tmp_path):
    model = shrink_models.build("qwen2_moe", decoder_sparse_step=2)
    assert sparse_blocks(model) == [False, True, False, True]
    loaded = remove_and_round_trip(model, "qwen2_moe", [1, 2], tmp_path)
    assert (loaded.config.decoder_sparse_step, loaded.config.mlp_only_layers) == (2, [])
    assert sparse_blocks(loaded) == [False, True]


def test_qwen_moe_sparse_step_becomes_one_with_the_dense_blocks_listed(tmp_path):
    model = shrink_models.build("qwen2_moe", decoder_sparse_step=2)
    loaded = remove_and_round_trip(model, "qwen2_moe", [0], tmp_path)
    assert (loaded.config.decoder_sparse_step, loaded.config.mlp_only_layers) == (1, [1])
    assert sparse_blocks(loaded) == [True, False, True]


def test_qwen_moe_mlp_only_layers_are_renumbered(tmp_path):
    model = shrink_models.build("qwen3_moe", mlp_only_layers=[0, 2])
    loaded = remove_and_round_trip(model, "qwen3_moe", [0, 1], tmp_path)
    assert (loaded.config.decoder_sparse_step, loaded.config.mlp_only_layers) == (1, [0])
    assert sparse_blocks(loaded) == [False, True]


def test_gpt2_inverse_layer_scaling_allows_only_removing_the_last_blocks(tmp_path):
    model = shrink_models.build("gpt2", scale_attn_by_inverse_layer_idx=True)
    batch = shrink_models.batches("gpt2", n=1)[0]
    before, out = snapshot(model), shrink_models.output(model, batch)
    with pytest.raises(ValueError, match=r"renumbers blocks \{3: 1\} \(old -> new\).*remove only the last blocks of "
                                         r"transformer.h"):
        remove_layers(model, [1, 2])
    assert snapshot(model) == before and torch.equal(shrink_models.output(model, batch), out)
    remove_and_round_trip(model, "gpt2", [2, 3], tmp_path)


def test_distilbert_keeps_its_block_count_attribute_in_step():
    model = shrink_models.build("distilbert")
    remove_layers(model, [0, 3])
    assert model.transformer.n_layers == 2 == model.config.n_layers


def test_config_lists_it_cannot_keep_consistent_are_refused():
    model = shrink_models.build("gemma2")
    model.config.layer_types = model.config.layer_types[:3]
    before = snapshot(model)
    with pytest.raises(ValueError, match=r"config.layer_types has 3 entries for the 4 blocks of model.layers; make "
                                         "it one entry per block"):
        remove_layers(model, [1])
    assert snapshot(model) == before
    model = shrink_models.build("llama")
    model.config.shared_layers = [0, 2]
    before = snapshot(model)
    with pytest.raises(ValueError, match=r"config.shared_layers = \[0, 2\] may describe blocks one by one"):
        remove_layers(model, [1])
    assert snapshot(model) == before
