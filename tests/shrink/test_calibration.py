"""Calibration batches and the objective that scores a smaller model."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from prunekit.shrink.calibration import Objective, as_batches, output_vectors

pytestmark = pytest.mark.hf
transformers = pytest.importorskip("transformers")
from helpers import shrink_models  # noqa: E402


def test_empty_or_single_batch_calibration_is_a_clear_error():
    with pytest.raises(ValueError, match="calibration is empty"):
        as_batches([])
    with pytest.raises(TypeError, match=r"write \[batch\] for a single batch"):
        as_batches({"input_ids": torch.zeros(1, 2, dtype=torch.long)})
    with pytest.raises(TypeError, match="got int"):
        as_batches(3)


def test_language_models_are_scored_by_next_token_cross_entropy_over_real_tokens():
    model = shrink_models.build("llama")
    batches = shrink_models.batches("llama", n=2)
    batches[1]["attention_mask"][:, -3:] = 0
    objective = Objective(model, batches)
    assert objective.kind == "loss" and objective.reference == []
    total, count = 0.0, 0
    for b in batches:
        logits = model(**b).logits.detach()
        ce = F.cross_entropy(logits[:, :-1].flatten(0, 1), b["input_ids"][:, 1:].flatten(), reduction="none")
        keep = b["attention_mask"][:, 1:].flatten().bool()
        total, count = total + float(ce[keep].double().sum()), count + int(keep.sum())
    assert objective(model) == pytest.approx(total / count, rel=1e-9)


def test_encoders_are_scored_by_cosine_to_the_dense_outputs():
    model = shrink_models.build("bert")
    batches = shrink_models.batches("bert", n=2)
    objective = Objective(model, batches)
    assert objective.kind == "cosine" and objective(model) == pytest.approx(0.0, abs=1e-6)
    with torch.no_grad():
        model.encoder.layer[0].output.dense.weight.mul_(3.0)
    assert objective(model) > 1e-4


def test_a_changed_output_width_is_named():
    model = torch.nn.Linear(4, 4)
    objective = Objective(model, [torch.randn(2, 4)])
    with pytest.raises(ValueError, match=r"output changed shape \(\(2, 4\) -> \(2, 3\)\)"):
        objective(torch.nn.Linear(4, 3))


def test_output_vectors_prefers_logits_then_hidden_state():
    model = shrink_models.build("gpt2")
    out = model(**shrink_models.batches("gpt2", n=1)[0])
    assert output_vectors(out) is out.logits
    with pytest.raises(TypeError, match="cannot find the output tensor in a str"):
        output_vectors("x")
