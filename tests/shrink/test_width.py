"""Width axes: found per family, scored on calibration activations, emulated exactly as removed."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.hf
transformers = pytest.importorskip("transformers")

from helpers import shrink_models  # noqa: E402
from prunekit.compact.hf_config import FAMILIES as CONFIG_FAMILIES  # noqa: E402
from prunekit.compact.surgery.journal import Journal  # noqa: E402
from prunekit.shrink.width import Width  # noqa: E402

# what each family's blocks offer (Qwen2-MoE's ffn is its shared expert; routed experts are another axis)
AXES = {"llama": ["ffn", "heads", "hidden"], "gpt2": ["ffn", "heads", "hidden"], "bert": ["ffn", "heads"],
        "vit": ["ffn", "heads"], "distilbert": ["ffn", "heads"], "phi3": ["ffn", "heads", "hidden"],
        "opt": ["ffn", "heads", "hidden"], "mixtral": ["heads", "hidden"], "qwen2_moe": ["ffn", "heads", "hidden"]}


def _keep(width, fraction):
    keep = {name: max(1, int(axis.units * fraction)) for name, axis in width.axes.items()}
    family = CONFIG_FAMILIES[width.model_type]
    if family.head_dim_key is None:  # the config says heads x head size = hidden size
        if "hidden" in keep:
            keep["hidden"] = keep["heads"] * width.axes["heads"].unit_width
        else:
            del keep["heads"]
    if width.model_type in shrink_models.MOE and "hidden" in keep:
        keep["hidden"] = keep["hidden"] // 8 * 8  # grouped expert products need rows of 16-byte multiples
    return keep


@pytest.mark.parametrize("family", sorted(AXES))
def test_axes_of_each_family(family):
    model = shrink_models.build(family)
    width = Width(model, shrink_models.batches(family)[0])
    assert sorted(width.axes) == AXES[family]
    assert all(len(a.groups) == 4 for n, a in width.axes.items() if n != "hidden")


@pytest.mark.parametrize("family", shrink_models.FAMILIES)
def test_emulation_computes_what_removal_leaves(family):
    model = shrink_models.build(family)
    batches = shrink_models.batches(family)
    width = Width(model, batches[0])
    width.score(batches)
    keep = _keep(width, 0.6)
    dense = shrink_models.output(model, batches[1])
    with width.emulated(keep):
        emulated = shrink_models.output(model, batches[1])
    assert torch.equal(shrink_models.output(model, batches[1]), dense)  # hooks gone on exit
    removed = width.apply(keep, Journal())
    assert removed == sum(a.units - keep[n] for n, a in width.axes.items() if n in keep for _ in a.groups)
    out = shrink_models.output(model, batches[1])
    assert out.shape == emulated.shape
    torch.testing.assert_close(out, emulated, rtol=1e-5, atol=1e-6)
    assert (dense - emulated).abs().max() > 1e-3  # the emulation did remove something


@pytest.mark.parametrize("importance", ["activation", "obs"])
def test_scores_rank_a_silenced_neuron_and_head_last(importance):
    model = shrink_models.build("llama")
    batches = shrink_models.batches("llama")
    with torch.no_grad():
        model.model.layers[1].mlp.up_proj.weight[5].zero_()  # neuron 5 of block 1 outputs 0
        model.model.layers[2].self_attn.v_proj.weight[8:16].zero_()  # key/value group 1 of block 2 outputs 0
    width = Width(model, batches[0])
    width.score(batches, importance)
    ffn, heads = width.axes["ffn"], width.axes["heads"]
    assert ffn.removed(47)[1] == [5] and heads.removed(1)[2] == [1]
    if importance == "activation":
        assert ffn.scores[1][5] == 0 and heads.scores[2][1] == 0
        assert bool((ffn.scores[1][torch.arange(48) != 5] > 0).all())
    else:  # the removal order: a unit that carries nothing goes first
        assert ffn.scores[1][5] == 1 and heads.scores[2][1] == 1
        assert sorted(ffn.scores[1].tolist()) == list(range(1, 49))


def test_obs_order_beats_activations_on_a_redundant_neuron():
    """A neuron whose output another neuron copies costs nothing to lose once the copy is refitted:
    OBS removes it first; its activation norm is the largest of all."""
    model = shrink_models.build("llama")
    mlp = model.model.layers[0].mlp
    with torch.no_grad():
        for proj in (mlp.gate_proj, mlp.up_proj):
            proj.weight[3] *= 3.0
            proj.weight[7] = proj.weight[3]  # neuron 7 computes exactly what neuron 3 does
    batches = shrink_models.batches("llama")
    width = Width(model, batches[0])
    width.score(batches, "activation")
    assert int(torch.argmax(width.axes["ffn"].scores[0])) in (3, 7)
    width.score(batches, "obs")
    assert width.axes["ffn"].removed(47)[0] in ([3], [7])


def test_importance_names_the_bad_value():
    model = shrink_models.build("llama")
    with pytest.raises(ValueError, match="importance must be 'auto', 'activation' or 'obs', got 'wanda'"):
        Width(model, shrink_models.batches("llama")[0]).score(shrink_models.batches("llama"), "wanda")


def test_padding_does_not_count():
    model = shrink_models.build("llama")
    batches = shrink_models.batches("llama", n=1)
    width = Width(model, batches[0])
    width.score(batches)
    before = [s.clone() for s in width.axes["hidden"].scores]
    padded = {"input_ids": torch.cat([batches[0]["input_ids"], torch.randint(0, 64, (2, 3))], 1),
              "attention_mask": torch.cat([batches[0]["attention_mask"], torch.zeros(2, 3, dtype=torch.long)], 1)}
    width.score([padded])
    torch.testing.assert_close(width.axes["hidden"].scores[0], before[0], rtol=1e-6, atol=1e-9)


def test_bad_keep_counts_name_the_axis():
    model = shrink_models.build("llama")
    width = Width(model, shrink_models.batches("llama")[0])
    with pytest.raises(ValueError, match="call Width.score first"):
        width.decisions({"ffn": 10})
    width.score(shrink_models.batches("llama", n=1))
    with pytest.raises(ValueError, match="heads keeps 0 of 2 units; keep between 1 and 2"):
        width.decisions({"heads": 0})
    with pytest.raises(ValueError, match=r"has no width axis 'experts'; its axes are \['ffn', 'heads', 'hidden'\]"):
        width.decisions({"experts": 1})


def test_removal_keeps_a_tied_lm_head_one_tensor():
    model = shrink_models.build("gemma2")
    batches = shrink_models.batches("gemma2")
    width = Width(model, batches[0])
    width.score(batches)
    width.apply({"hidden": 24}, Journal())
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.lm_head.weight.shape == (shrink_models.VOCAB, 24)
