"""The family table: every supported family's block list is found; an unknown one is a clear error."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from helpers import shrink_models  # noqa: E402
from prunekit.shrink import FAMILIES, family_of, layer_list  # noqa: E402

EXPECTED = {"gpt2": "transformer.h", "opt": "model.decoder.layers", "bert": "encoder.layer", "roberta": "encoder.layer",
            "distilbert": "transformer.layer"}


@pytest.mark.parametrize("family", shrink_models.FAMILIES)
def test_every_family_finds_its_blocks(family):
    model = shrink_models.build(family)
    name, blocks = layer_list(model)
    assert len(blocks) == 4
    assert dict(model.named_modules())[name] is blocks
    assert family_of(model)[0] == family
    if family in EXPECTED:
        assert name == EXPECTED[family]
    assert FAMILIES[family].moe == (family in shrink_models.MOE)


def test_the_table_covers_the_test_models():
    assert sorted(FAMILIES) == shrink_models.FAMILIES


def test_an_unknown_family_or_a_plain_module_is_a_value_error():
    import torch
    import transformers

    cfg = transformers.T5Config(vocab_size=32, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_heads=2)
    with pytest.raises(ValueError, match=r"family 't5' \(T5Model\) has no shrink handler; known families: bert"):
        family_of(transformers.T5Model(cfg))
    with pytest.raises(ValueError, match="Linear is not a Hugging Face model"):
        layer_list(torch.nn.Linear(2, 2))


@pytest.mark.parametrize("family", shrink_models.FAMILIES)
def test_the_config_keys_name_the_models_sizes(family):
    model = shrink_models.build(family)
    fam = FAMILIES[family]
    _, blocks = layer_list(model)
    assert getattr(model.config, fam.layers_key) == len(blocks)
    if fam.moe:
        mlp = blocks[0].mlp
        assert getattr(model.config, fam.experts_key) == mlp.experts.gate_up_proj.shape[0] == 4
        assert getattr(model.config, fam.expert_ffn_key) == mlp.experts.down_proj.shape[-1]
