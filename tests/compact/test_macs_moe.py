"""count_macs on Mixtral: routed experts count the tokens each expert receives, whichever implementation runs."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from prunekit.compact import count_macs

transformers = pytest.importorskip("transformers", reason="transformers is not installed")

pytestmark = pytest.mark.usefixtures("one_thread")

H = 8  # hidden size
E = 4  # experts
MIXTRAL_FFN = 8  # torch._grouped_mm needs rows of a multiple of 16 bytes


def _mixtral(implementation):
    cfg = transformers.MixtralConfig(vocab_size=64, hidden_size=H, intermediate_size=MIXTRAL_FFN, num_hidden_layers=2,
                                     num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
                                     num_local_experts=E, num_experts_per_tok=2)
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(cfg).eval()
    model.config._experts_implementation = implementation
    return model


class _NoExperts(nn.Module):
    def forward(self, hidden_states, top_k_index, top_k_weights):
        return torch.zeros_like(hidden_states)


def test_mixtral_counts_the_same_routed_macs_for_every_experts_implementation():
    x = {"input_ids": torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(0))}
    model = _mixtral("grouped_mm")
    routed = []  # per router call: its top-2 choices
    hooks = [layer.mlp.gate.register_forward_hook(lambda m, a, out: routed.append(out[2]))
             for layer in model.model.layers]
    total = count_macs(model, x)
    for h in hooks:
        h.remove()
    assert len(routed) == 2 and all(r.shape == (14, 2) for r in routed)
    experts = 2 * 14 * 2 * 3 * MIXTRAL_FFN * H  # 2 layers x 14 tokens x 2 experts x (gate, up, down) rows
    for layer in model.model.layers:
        layer.mlp.experts = _NoExperts()
    assert total == count_macs(model, x) + experts
    for implementation in ("eager", "batched_mm"):
        assert count_macs(_mixtral(implementation), x) == total
