"""The transformers families of ``shrink_models.ZOO`` (hidden 64, 2 layers, 4 heads; MoE with 4 experts).

Half of every block's attention heads (key/value groups) and FFN neurons, ``uniform=True``; the
compacted model must equal the masked one. Then either ``compaction_description(...)["hf_config"]``
is ``"updated"`` and ``save_pretrained`` -> plain ``from_pretrained`` gives identical outputs, or
it says which config field cannot express the result and the config is left as it was -- never a
config that reloads into another model. The test id names the outcome: ``-round-trip`` or
``-refused``.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed")

from helpers import shrink_models as S  # noqa: E402
from prunekit.compact import compact, compaction_description, count_macs, count_params, prune_groups  # noqa: E402

pytestmark = [pytest.mark.zoo, pytest.mark.usefixtures("one_thread", "quiet_transformers")]

#: families whose config cannot say the compacted sizes, and the words the reason must hold
REFUSED = {
    **{f: "derives the head size from" for f in ("stablelm", "gptj", "opt", "gpt2", "bert", "roberta", "distilbert")},
    "deepseek_v3": "mlp.shared_experts.gate_proj.weight",  # moe_intermediate_size x n_shared_experts: one width
}


def _out(model, batch):
    with torch.no_grad():
        return S.output(model, batch)


@pytest.mark.parametrize("family", [pytest.param(f, id=f"{f}-{'refused' if f in REFUSED else 'round-trip'}")
                                    for f in S.ZOO])
def test_family_compacts_and_round_trips_or_says_why(family, tmp_path, record_property):
    model, batch = S.build_zoo(family), S.zoo_batch(family)
    before = model.config.to_dict()
    macs, params = count_macs(model, batch), count_params(model)
    decisions = prune_groups(model, batch, 0.5, uniform=True)
    assert any(d.removed for d in decisions)
    small = compact(model, batch)
    assert float((_out(small, batch) - _out(model, batch)).norm() / _out(model, batch).norm()) < 1e-5
    said = compaction_description(small)["hf_config"]
    record_property("outcome", "refused" if said.startswith("not updated") else "round-trip")
    record_property("reason", said.removeprefix("not updated: ") if said != "updated" else "")
    record_property("macs_ratio", count_macs(small, batch) / macs)
    record_property("params_ratio", count_params(small) / params)
    if family in REFUSED:
        assert said.startswith("not updated: ") and REFUSED[family] in said and "save_compacted" in said
        assert small.config.to_dict() == before
        return
    assert said == "updated"
    small.save_pretrained(tmp_path)
    again = type(small).from_pretrained(tmp_path).eval()
    assert torch.equal(_out(again, batch), _out(small, batch))
    assert sum(p.numel() for p in again.parameters()) < sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("family", ["olmo2", "cohere_qk_norm"])
def test_qk_norms_follow_their_heads_or_keep_them(family):
    model, batch = S.build_zoo(family), S.zoo_batch(family)
    prune_groups(model, batch, 0.5, uniform=True)
    attn = compact(model, batch).model.layers[0].self_attn
    if family == "olmo2":  # RMSNorms over every head's channels: removing a head changes them, heads stay
        assert attn.q_proj.out_features == 64 and attn.q_norm.weight.shape == (64,)
    else:  # Cohere's per-head LayerNorms: a row per head, removed with it
        assert attn.q_proj.out_features == 32 and attn.q_norm.weight.shape == (2, 16)
        assert attn.k_norm.weight.shape == (1, 16) and attn.k_proj.out_features == 16
