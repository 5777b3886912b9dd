"""A shrunk model exported with ``torch.onnx.export`` runs in ONNX Runtime and computes what PyTorch computes.

The exporter is TorchScript's (``dynamo=False``): ``dynamo=True`` needs the ``onnxscript`` package,
which is not a dependency here. Transformers' default MoE experts (``grouped_mm``) count tokens
per expert with ``torch.histc``, which that exporter has no ONNX operator for, in the dense model as
in the shrunk one; its ``batched_mm`` experts (the same function, one batched product, no data-dependent
control flow) export, so the MoE model runs with those.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import prunekit

pytestmark = [pytest.mark.hf, pytest.mark.usefixtures("one_thread"),
              # tracing records Python-level branches as constants; the held-out batch (another size, padding)
              # checks that the exported graph does not depend on them
              pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning"),
              pytest.mark.filterwarnings("ignore:Exporting aten.*index operator:UserWarning")]
transformers = pytest.importorskip("transformers")
onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
from helpers import shrink_models  # noqa: E402


class Outputs(nn.Module):
    """The model as a function of ``(input_ids, attention_mask)`` to its logits or last hidden state."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        kwargs = {"use_cache": False} if getattr(self.model.config, "use_cache", None) is not None else {}
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        return out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state


def held_out(family):
    """Another batch size and length than the export's, with padding."""
    batch = shrink_models.batches(family, n=1, batch=3, tokens=6, seed=5)[0]
    batch["attention_mask"][0, -2:] = 0
    return batch


def export_and_run(model, family, tmp_path):
    wrapped = Outputs(model).eval()
    example = shrink_models.batches(family, n=1, seed=3)[0]
    path = tmp_path / f"{family}.onnx"
    names = ["input_ids", "attention_mask"]
    dynamic = {n: {0: "batch", 1: "tokens"} for n in names}
    torch.onnx.export(wrapped, (example["input_ids"], example["attention_mask"]), str(path), dynamo=False,
                      input_names=names, output_names=["output"], dynamic_axes=dynamic)
    onnx.checker.check_model(str(path))
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for batch in (example, held_out(family)):
        with torch.no_grad():
            expected = wrapped(batch["input_ids"], batch["attention_mask"]).numpy()
        (got,) = session.run(None, {n: batch[n].numpy() for n in names})
        assert got.shape == expected.shape
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)
    return onnx.load(str(path))


def dims(graph):
    return {d for t in graph.initializer for d in t.dims}


@pytest.mark.parametrize("family, sizes, gone", [
    ("llama", {"hidden": 24, "heads": 1, "ffn": 40, "layers": 3}, 32),  # no weight of the dense hidden size is left
    ("bert", {"ffn": 24, "layers": 3}, 48),  # nor of the dense FFN width
])
def test_a_shrunk_model_runs_in_onnx_runtime(family, sizes, gone, tmp_path):
    model = shrink_models.build(family)
    assert any(gone in p.shape for p in model.parameters())
    prunekit.shrink(model, shrink_models.batches(family, n=2), 0.5, sizes=sizes)
    graph = export_and_run(model, family, tmp_path).graph
    assert gone not in dims(graph) and {24, 40} & dims(graph)


def test_a_shrunk_mixture_of_experts_runs_in_onnx_runtime(tmp_path):
    model = shrink_models.build("qwen2_moe")
    prunekit.shrink(model, shrink_models.batches("qwen2_moe", n=2), 0.5,
                    sizes={"hidden": 24, "heads": 1, "experts": 3, "expert_ffn": 16, "layers": 3})
    model.set_experts_implementation("batched_mm")
    graph = export_and_run(model, "qwen2_moe", tmp_path).graph
    experts = model.model.layers[0].mlp.experts
    assert experts.gate_up_proj.shape == (3, 32, 24)
    assert any(tuple(t.dims) == (3, 32, 24) for t in graph.initializer)  # the three kept experts, 16 neurons each
