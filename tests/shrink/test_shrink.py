"""``prunekit.shrink``: every family to a size target and back through plain transformers, the target's
variants (MACs, blocks only, explicit sizes, axes), the report, bad input, rollback, determinism."""

from __future__ import annotations

import inspect
import math

import pytest
import torch
from torch import nn

import prunekit
import prunekit.compact.removal as removal
import prunekit.shrink.api as api
import prunekit.shrink.depth as depth
import prunekit.shrink.experts as experts
import prunekit.shrink.refit as refit
from prunekit.shrink import layer_list, layer_loss_importance
from prunekit.shrink.calibration import Objective, scoring_split
from prunekit.shrink.search import grid_candidates

pytestmark = [pytest.mark.hf, pytest.mark.usefixtures("one_thread")]
transformers = pytest.importorskip("transformers")
from helpers import shrink_models  # noqa: E402

#: how far below its target a candidate may be: the search's own default
SLACK = inspect.signature(grid_candidates).parameters["slack"].default

DECODERS = ["llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3"]
ENCODERS = ["bert", "roberta", "distilbert", "vit"]
_GQA = {"hidden_size": "hidden", "num_key_value_heads": "heads", "num_hidden_layers": "layers"}
_ENCODER = {"num_attention_heads": "heads", "intermediate_size": "ffn", "num_hidden_layers": "layers"}
#: family -> {config key: the axis whose kept units it must say}
CONFIG_KEYS = {
    **{f: dict(_GQA, intermediate_size="ffn") for f in DECODERS},
    "gpt2": {"n_embd": "hidden", "n_head": "heads", "n_inner": "ffn", "n_layer": "layers"},
    "opt": {"hidden_size": "hidden", "num_attention_heads": "heads", "ffn_dim": "ffn", "num_hidden_layers": "layers"},
    "mixtral": dict(_GQA, num_local_experts="experts", intermediate_size="expert_ffn"),
    "qwen2_moe": dict(_GQA, shared_expert_intermediate_size="ffn", num_experts="experts",
                      moe_intermediate_size="expert_ffn"),
    "qwen3_moe": dict(_GQA, num_experts="experts", moe_intermediate_size="expert_ffn"),
    "bert": _ENCODER, "roberta": _ENCODER, "vit": _ENCODER,
    "distilbert": {"n_heads": "heads", "hidden_dim": "ffn", "n_layers": "layers"},
}
#: family -> explicit sizes that change every axis its config can say
SIZES = {
    **{f: {"hidden": 24, "heads": 1, "ffn": 40, "layers": 3} for f in DECODERS},
    "gpt2": {"hidden": 24, "heads": 3, "ffn": 40, "layers": 3},  # heads of 8: 3 x 8 = 24
    "opt": {"hidden": 24, "heads": 3, "ffn": 40, "layers": 3},
    "mixtral": {"hidden": 24, "heads": 1, "experts": 3, "expert_ffn": 40, "layers": 3},
    "qwen2_moe": {"hidden": 24, "heads": 1, "ffn": 32, "experts": 3, "expert_ffn": 16, "layers": 3},
    "qwen3_moe": {"hidden": 24, "heads": 1, "experts": 3, "expert_ffn": 16, "layers": 3},
    "bert": {"ffn": 40, "layers": 3},  # the config derives the head size from hidden_size / heads: heads stay
    "roberta": {"ffn": 40, "layers": 3},
    "distilbert": {"ffn": 40, "layers": 3},
    "vit": {"heads": 3, "ffn": 40, "layers": 3},  # its config says head_dim
}
assert sorted(CONFIG_KEYS) == sorted(SIZES) == shrink_models.FAMILIES
#: the residual width of the families without a hidden axis
UNCHANGED = {"bert": ["hidden_size"], "roberta": ["hidden_size"], "distilbert": ["dim"], "vit": ["hidden_size"]}


# ------------------------------------------------------------------ helpers
def n_params(model):
    return sum(p.numel() for p in model.parameters())  # a tied tensor once


def held_out(family):
    """A batch the calibration did not hold, of another length, padded where the family takes a mask."""
    batch = shrink_models.batches(family, n=1, batch=3, tokens=7, seed=11)[0]
    if "attention_mask" in batch:
        batch["attention_mask"][0, -2:] = 0
    return batch


def hooks(model):
    return {name: (list(m._forward_hooks.items()), list(m._forward_pre_hooks.items()))
            for name, m in model.named_modules()}


def snapshot(model):
    """What a failed call must leave exactly as it was."""
    return {"state": {k: v.clone() for k, v in model.state_dict().items()},
            "config": model.config.to_dict(),
            "modules": list(model.named_modules()),
            "params": list(model.named_parameters()),
            "hooks": hooks(model)}


def assert_unchanged(model, snap):
    state = model.state_dict()
    assert state.keys() == snap["state"].keys()
    assert all(torch.equal(state[k], v) for k, v in snap["state"].items())
    assert model.config.to_dict() == snap["config"]
    assert [(n, id(m)) for n, m in model.named_modules()] == [(n, id(m)) for n, m in snap["modules"]]
    assert [(n, id(p)) for n, p in model.named_parameters()] == [(n, id(p)) for n, p in snap["params"]]
    assert hooks(model) == snap["hooks"]


def check_saved(model, family, report, tmp_path, batches):
    """Size within the target's limit, config that says the sizes, plain ``from_pretrained``, same outputs."""
    cls = getattr(transformers, shrink_models.SPECS[family][2])
    dense = shrink_models.build(family)
    sizes = report.chosen.sizes
    assert report.params == n_params(model) == report.chosen.params  # the size model predicted the real count
    head = model.get_output_embeddings()
    if head is not None and model.config.tie_word_embeddings:  # tied before: still one tensor
        assert head.weight is model.get_input_embeddings().weight
    model.save_pretrained(tmp_path)
    loaded = cls.from_pretrained(tmp_path).eval()
    assert type(loaded) is type(model) and n_params(loaded) == report.params
    config = loaded.config
    for key, axis in CONFIG_KEYS[family].items():
        assert getattr(config, key) == sizes[axis], key
    if "num_key_value_heads" in CONFIG_KEYS[family]:  # key/value groups keep their query heads
        per_group = dense.config.num_attention_heads // dense.config.num_key_value_heads
        assert config.num_attention_heads == sizes["heads"] * per_group
    if getattr(dense.config, "head_dim", None) is not None:
        assert config.head_dim == dense.config.head_dim  # the head size never changes
    if family in ("gpt2", "opt"):  # the config derives the head size: heads x 8 = hidden
        assert sizes["hidden"] == 8 * sizes["heads"]
    for key in ["vocab_size"] * hasattr(dense.config, "vocab_size") + UNCHANGED.get(family, []):
        assert getattr(config, key) == getattr(dense.config, key), key
    state, read = model.state_dict(), loaded.state_dict()
    assert state.keys() == read.keys() and all(torch.equal(state[k], read[k]) for k in state)
    for batch in (batches[0], held_out(family)):
        assert torch.equal(shrink_models.output(loaded, batch), shrink_models.output(model, batch))
    return loaded


# ------------------------------------------------------------------ every family, searched and explicit
@pytest.mark.parametrize("family", shrink_models.FAMILIES)
def test_every_family_shrinks_to_the_target_and_reloads_with_plain_transformers(family, tmp_path):
    model = shrink_models.build(family)
    batches = shrink_models.batches(family, n=2)
    dense = n_params(model)
    report = prunekit.shrink(model, batches, 0.6)
    limit = math.floor(0.6 * dense)
    assert (report.target.measure, report.target.limit, report.target.dense) == ("params", limit, dense)
    assert report.dense.params == dense
    assert limit - SLACK * dense <= report.params <= limit
    assert report.chosen.sizes != report.dense.sizes
    check_saved(model, family, report, tmp_path, batches)


@pytest.mark.parametrize("family", shrink_models.FAMILIES)
def test_explicit_sizes_skip_the_search_and_are_exactly_what_the_config_says(family, tmp_path, monkeypatch):
    def no_search(*args, **kwargs):
        raise AssertionError("sizes= must not search")

    monkeypatch.setattr(api, "grid_candidates", no_search)
    model = shrink_models.build(family)
    batches = shrink_models.batches(family, n=2)
    report = prunekit.shrink(model, batches, 0.5, sizes=SIZES[family])
    assert report.dense.sizes["layers"] == 4 and set(SIZES[family]) <= set(report.dense.sizes)
    assert report.chosen.sizes == dict(report.dense.sizes, **SIZES[family])
    assert len(report.candidates) == 1 and report.candidates[0] is report.chosen
    assert len(report.removed_layers) == 4 - SIZES[family]["layers"]
    loaded = check_saved(model, family, report, tmp_path, batches)
    assert len(layer_list(loaded)[1]) == SIZES[family]["layers"]


@pytest.mark.parametrize("family", shrink_models.FAMILIES)
def test_the_chosen_candidates_emulated_score_is_the_shrunk_models_objective(family):
    model = shrink_models.build(family)
    batches = shrink_models.batches(family, n=2)
    report = prunekit.shrink(model, batches, 0.6, refit=False)
    assert report.fits == []
    # the same objective on the same batches; the emulation multiplies removed units by zero where the shrunk
    # model leaves them out of its sums, so the two agree to float rounding (bit for bit in most families). An
    # encoder's objective is 1 - cosine, computed in float32 near 1: its rounding is absolute, float32's epsilon
    assert math.isclose(report.chosen.score, report.score, rel_tol=1e-6, abs_tol=torch.finfo(torch.float32).eps)
    assert report.score == Objective(shrink_models.build(family), batches)(model)


# ------------------------------------------------------------------ the target's variants
def linear_macs(model):
    """Per-token MACs of a Llama's matrix products: every one is an ``nn.Linear``, LM head included."""
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))


def test_a_macs_target_is_met_in_macs():
    model = shrink_models.build("llama")
    dense_macs, dense_params = linear_macs(model), n_params(model)
    report = prunekit.shrink(model, shrink_models.batches("llama"), 0.5, measure="macs", axes=["heads", "ffn", "layers"])
    limit = math.floor(0.5 * dense_macs)
    assert (report.target.measure, report.target.limit, report.target.dense) == ("macs", limit, dense_macs)
    assert report.dense.macs == dense_macs
    assert limit - SLACK * dense_macs <= linear_macs(model) == report.chosen.macs <= limit
    assert all(limit - SLACK * dense_macs <= c.macs <= limit for c in report.candidates)
    # the embedding (the hidden size kept) costs parameters, not MACs: the model keeps more than half of them
    assert report.params > 0.5 * dense_params


def block_params(model):
    return sum(p.numel() for p in layer_list(model)[1].parameters())


def test_scope_blocks_counts_only_the_blocks():
    model = shrink_models.build("llama")
    dense_blocks, dense = block_params(model), n_params(model)
    report = prunekit.shrink(model, shrink_models.batches("llama"), 0.5, scope="blocks", axes=["heads", "ffn", "layers"])
    limit = math.floor(0.5 * dense_blocks)
    assert report.target.dense == dense_blocks < dense
    assert limit - SLACK * dense_blocks <= block_params(model) <= limit
    assert report.params == n_params(model) > dense // 2  # the embeddings and head are outside the target


@pytest.mark.parametrize("axes, target, may_change", [
    (["ffn", "layers"], 0.6, {"intermediate_size", "num_hidden_layers"}),
    (["ffn"], 0.7, {"intermediate_size"}),  # a quarter of the neurons at least: not 0.6
    (["layers"], 0.6, {"num_hidden_layers"}),
    (["hidden", "heads"], 0.6, {"hidden_size", "num_key_value_heads", "num_attention_heads"}),
])
def test_axes_restrict_what_shrinks(axes, target, may_change):
    model = shrink_models.build("llama")
    dense = shrink_models.build("llama")
    report = prunekit.shrink(model, shrink_models.batches("llama"), target, axes=axes)
    assert all(c.sizes[a] == report.dense.sizes[a] for c in report.candidates for a in c.sizes if a not in axes)
    assert any(c.sizes[a] != report.dense.sizes[a] for c in report.candidates for a in axes)
    keys = ("hidden_size", "num_key_value_heads", "num_attention_heads", "intermediate_size", "num_hidden_layers")
    changed = {k for k in keys if getattr(model.config, k) != getattr(dense.config, k)}
    assert changed and changed <= may_change
    assert report.params <= report.target.limit
    if axes == ["layers"]:  # whole blocks go, the others are untouched
        kept = [b for b in range(4) if b not in report.removed_layers]
        assert len(kept) == model.config.num_hidden_layers
        for j, b in enumerate(kept):
            mine, theirs = model.model.layers[j].state_dict(), dense.model.layers[b].state_dict()
            assert all(torch.equal(mine[k], theirs[k]) for k in theirs)


def test_expert_ffn_is_an_axis_when_asked_for():
    model = shrink_models.build("mixtral")
    report = prunekit.shrink(model, shrink_models.batches("mixtral"), 0.6, axes=["expert_ffn"])
    width = report.chosen.sizes["expert_ffn"]
    assert width < 48 and width % 8 == 0 and model.config.intermediate_size == width
    assert report.params == n_params(model) == report.chosen.params <= report.target.limit
    assert all(mlp.experts.down_proj.shape[2] == width for mlp in experts.moe_layers(model).values())


def test_depth_importance_loss_removes_the_blocks_whose_loss_matters_least():
    batches = shrink_models.batches("llama")
    importance = layer_loss_importance(shrink_models.build("llama"), batches)
    model = shrink_models.build("llama")
    report = prunekit.shrink(model, batches, 0.6, axes=["layers"], depth_importance="loss")
    n_removed = 4 - model.config.num_hidden_layers
    assert n_removed >= 1
    assert report.removed_layers == sorted(torch.argsort(importance, stable=True)[:n_removed].tolist())


def test_the_report_is_consistent():
    model = shrink_models.build("llama")
    dense_model = shrink_models.build("llama")
    batches = shrink_models.batches("llama")
    report = prunekit.shrink(model, batches, 0.6, axes=["heads", "ffn", "layers"])  # a choice with refitted readers
    dense = n_params(dense_model)
    objective = Objective(dense_model, scoring_split(batches)[1])  # every score is on the batches not refitted on
    assert report.model_type == "llama" and report.objective == objective.kind == "loss"
    assert report.dense.sizes == {"hidden": 32, "heads": 2, "ffn": 48, "layers": 4}
    assert (report.dense.params, report.dense.macs) == (dense, linear_macs(dense_model))
    assert report.dense.score == objective(dense_model)
    scores = [c.score for c in report.candidates]
    assert len(scores) > 1 and scores == sorted(scores)
    assert report.chosen is report.candidates[0]
    assert all(report.target.limit - SLACK * dense <= c.params <= report.target.limit for c in report.candidates)
    assert report.params == n_params(model) and report.score == objective(model)
    sizes = report.chosen.sizes
    assert len(report.removed_layers) == 4 - sizes["layers"] == 4 - model.config.num_hidden_layers
    expected = {}
    for b in range(4):
        if b in report.removed_layers:
            continue
        if sizes["ffn"] < 48:
            expected[f"model.layers.{b}.mlp.down_proj"] = (sizes["ffn"], 48)
        if sizes["heads"] < 2:
            expected[f"model.layers.{b}.self_attn.o_proj"] = (sizes["heads"] * 16, 32)
    assert {f.module: (f.kept, f.total) for f in report.fits} == expected and expected
    assert all(0 <= f.error_after <= f.error_before for f in report.fits)
    assert "llama" in repr(report) and f"{report.params:,}" in repr(report)


@pytest.mark.parametrize("family", ["llama", "qwen2_moe"])
def test_the_same_call_on_the_same_model_gives_the_same_model(family):
    results = []
    for _ in range(2):
        model = shrink_models.build(family)
        report = prunekit.shrink(model, shrink_models.batches(family), 0.6)
        results.append((model.state_dict(), [(c.sizes, c.score) for c in report.candidates], report.removed_layers))
    (a, ca, ra), (b, cb, rb) = results
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert ca == cb and ra == rb


# ------------------------------------------------------------------ bad input: clear errors, the model unchanged
def _t5():
    config = transformers.T5Config(vocab_size=64, d_model=16, d_kv=4, d_ff=32, num_layers=2, num_heads=2)
    return transformers.T5Model(config).eval()


BAD = [  # (family, calibration change, keyword arguments, error, message)
    ("llama", None, dict(target=1), ValueError, r"no mix of \['hidden', 'heads', 'ffn', 'layers'\] brings llama to "
                                                r"1 params \(dense 35,104\); allow more axes"),
    ("llama", None, dict(target=0.01, axes=["ffn"]), ValueError, r"no mix of \['ffn'\] brings llama to 351 params"),
    ("llama", None, dict(target=0.3, axes=["heads"]), ValueError, r"no mix of \['heads'\] brings llama"),  # < 1 head
    ("llama", None, dict(target=0.05, axes=["layers"]), ValueError, r"no mix of \['layers'\]"),  # < 1 layer
    ("llama", None, dict(target=1.5), ValueError, r"target=1.5 is not a fraction in \(0, 1\).*target=0.5"),
    ("llama", None, dict(target=0.0), ValueError, r"target=0.0 is not a fraction"),
    ("llama", None, dict(target=math.nan), ValueError, r"target=nan is not a fraction"),
    ("llama", None, dict(target=10 ** 9), ValueError, r"target=1000000000 params is not between 1 and the dense "
                                                      r"model's 35,104"),
    ("llama", None, dict(target="0.5"), TypeError, r"target must be a fraction in \(0, 1\) or a params count, got "
                                                   r"str '0.5'"),
    ("llama", None, dict(target=True), TypeError, r"got bool True"),
    ("llama", None, dict(measure="flops"), ValueError, r"measure must be 'params' or 'macs', got 'flops'"),
    ("llama", None, dict(scope="block"), ValueError, r"scope must be 'model' or 'blocks', got 'block'"),
    ("llama", None, dict(axes=["neurons"]), ValueError, r"no axis 'neurons' .*its axes are \['hidden', 'heads', "
                                                        r"'ffn', 'layers'\]"),
    ("llama", None, dict(axes=["experts"]), ValueError, r"no axis 'experts'"),
    ("llama", None, dict(axes="ffn"), TypeError, r"axes must be a list of axis names, got str 'ffn'; write e\.g\. "
                                                 r"axes=\['ffn'\]"),
    ("llama", None, dict(axes=[]), ValueError, r"axes is empty; name at least one of"),
    ("gpt2", None, dict(axes=["heads"]), ValueError, r"heads can only be pruned with the hidden size.*add 'hidden'"),
    ("llama", None, dict(sizes={"ffn": 100}), ValueError, r"sizes\['ffn'\]=100; keep an int between 1 and 48"),
    ("llama", None, dict(sizes={"layers": 0}), ValueError, r"sizes\['layers'\]=0; keep an int between 1 and 4"),
    ("llama", None, dict(sizes={"heads": 0}), ValueError, r"sizes\['heads'\]=0; keep an int between 1 and 2"),
    ("llama", None, dict(sizes={"ffn": 24.0}), ValueError, r"sizes\['ffn'\]=24.0; keep an int"),
    ("llama", None, dict(sizes={"neurons": 3}), ValueError, r"sizes names 'neurons', which this model does not "
                                                            r"have; its axes are"),
    ("llama", None, dict(sizes=[("ffn", 24)]), TypeError, r"sizes must be a dict of axis -> units kept, got list"),
    ("mixtral", None, dict(sizes={"experts": 1}), ValueError, r"keep 1 experts.*num_experts_per_tok=2.*keep at "
                                                              r"least 2 experts"),
    ("mixtral", None, dict(sizes={"hidden": 20}), ValueError, r"sizes\['hidden'\]=20: with routed experts it must "
                                                              r"be a multiple of 8"),
    # the config of BERT derives the head size: found when the units are already removed, and rolled back
    ("bert", None, dict(sizes={"heads": 2}), ValueError, r"config cannot say its new shapes .*2 heads of 8 with "
                                                         r"hidden_size 32"),
    ("llama", None, dict(depth_importance="los"), ValueError, r"depth_importance must be 'influence' or 'loss', got "
                                                              r"'los'"),
    ("llama", None, dict(importance="obsx"), ValueError, r"importance must be 'auto', 'activation' or 'obs', got "
                                                         r"'obsx'"),
    ("llama", None, dict(round_to=0), ValueError, r"round_to must be an int >= 1"),
    ("llama", None, dict(max_candidates=0), ValueError, r"max_candidates must be an int >= 1, got 0"),
    ("llama", [], {}, ValueError, r"calibration is empty; give at least one batch"),
    ("llama", "one dict", {}, TypeError, r"calibration must be an iterable of batches, got one dict; write \[batch\]"),
    ("llama", "wrong keys", {}, ValueError, r"the calibration does not run on LlamaForCausalLM \(ValueError: You must "
                                            r"specify exactly one of input_ids or inputs_embeds\); give batches"),
    ("llama", "bad ids", {}, ValueError, r"the calibration does not run on LlamaForCausalLM \(IndexError: index out of "
                                         r"range in self\)"),
    ("vit", "wrong keys", {}, ValueError, r"the calibration does not run on ViTModel \(AttributeError: "),
    ("t5", None, {}, ValueError, r"the family 't5' \(T5Model\) has no shrink handler; known families: bert, .*vit "
                                 r"\(add one to prunekit\.compact\.hf_config\.FAMILIES\)"),
]


def _calibration(family, change):
    batches = shrink_models.batches("llama" if family == "t5" else family, n=2)
    if change is None or isinstance(change, list):
        return batches if change is None else change
    if change == "one dict":
        return batches[0]
    if change == "wrong keys":
        return [{"ids": b.get("input_ids", b.get("pixel_values"))} for b in batches]
    return [dict(b, input_ids=b["input_ids"] + shrink_models.VOCAB) for b in batches]  # "bad ids"


@pytest.mark.parametrize("family, change, kwargs, error, message", BAD,
                         ids=[f"{f}-{c if isinstance(c, (str, type(None))) else 'empty'}-{'-'.join(map(str, k))}"
                              for f, c, k, _, _ in BAD])
def test_bad_input_is_a_clear_error_and_the_model_is_unchanged(family, change, kwargs, error, message):
    model = _t5() if family == "t5" else shrink_models.build(family)
    snap = snapshot(model)
    kwargs = dict({"target": 0.5}, **kwargs)
    with pytest.raises(error, match=message) as info:
        prunekit.shrink(model, _calibration(family, change), **kwargs)
    assert "\n" not in str(info.value) and str(info.value).startswith("prunekit.shrink")
    assert_unchanged(model, snap)


# ------------------------------------------------------------------ all or nothing
def _fail_on(n, error, real):
    """``real`` that raises ``error`` right after its ``n``-th call (1-based) has done its work."""
    calls = []

    def call(*args, **kwargs):
        out = real(*args, **kwargs)
        calls.append(1)
        if len(calls) == n:
            raise error("injected")
        return out

    return call, calls


def _raise(error):
    def call(*args, **kwargs):
        raise error("injected")
    return call


ALL_AXES = {"hidden": 24, "heads": 1, "ffn": 32, "layers": 3}
MOE_AXES = {"hidden": 24, "heads": 1, "ffn": 32, "experts": 3, "expert_ffn": 16, "layers": 3}
FAILURES = [  # (id, family, sizes, what to patch, how many calls before it raises, error)
    ("remove_layers", "llama", ALL_AXES, (depth, "remove_layers"), 0, RuntimeError),
    ("final check", "llama", ALL_AXES, (api, "_check"), 0, KeyboardInterrupt),
    ("width surgery, second module", "llama", ALL_AXES, (removal, "shrink_module"), 2, KeyboardInterrupt),
    ("refit, second reader", "llama", ALL_AXES, (refit, "_fit_to_dense"), 2, KeyboardInterrupt),
    ("scoring", "llama", None, (Objective, "__call__"), 3, KeyboardInterrupt),  # dense score, 1st, 2nd candidate
    ("remove_experts", "qwen2_moe", MOE_AXES, (experts, "remove_experts"), 0, RuntimeError),
    ("expert ffn surgery", "qwen2_moe", MOE_AXES, (experts, "shrink_expert_ffn"), 1, KeyboardInterrupt),
    ("final check, MoE", "mixtral", {"hidden": 24, "experts": 3, "expert_ffn": 40, "layers": 3}, (api, "_check"), 0,
     KeyboardInterrupt),
]


@pytest.mark.parametrize("family, sizes, where, after, error", [f[1:] for f in FAILURES], ids=[f[0] for f in FAILURES])
def test_a_failure_anywhere_leaves_the_model_exactly_as_it_was(family, sizes, where, after, error, monkeypatch):
    model = shrink_models.build(family)
    batches = shrink_models.batches(family, n=2)
    dense = shrink_models.output(model, held_out(family))
    snap = snapshot(model)
    owner, name = where
    real = getattr(owner, name)
    fake, calls = (_raise(error), []) if after == 0 else _fail_on(after, error, real)
    monkeypatch.setattr(owner, name, fake)
    with pytest.raises(error, match="injected"):
        prunekit.shrink(model, batches, 0.5, sizes=sizes)
    assert after == 0 or len(calls) == after  # the failure came after that many calls had done their work
    monkeypatch.undo()
    assert_unchanged(model, snap)
    assert torch.equal(shrink_models.output(model, held_out(family)), dense)
    if family in shrink_models.MOE:
        assert all(not mlp.gate._forward_hooks and not mlp.experts._forward_hooks
                   for mlp in experts.moe_layers(model).values())
    again = prunekit.shrink(model, batches, 0.5, sizes=sizes)  # and the model still shrinks
    assert again.params == n_params(model) < n_params(shrink_models.build(family))
