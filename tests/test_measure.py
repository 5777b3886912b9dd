"""prunekit.measure: the one sparsity report, of chosen tensors (report_layers) or of a whole model."""

import pytest
import torch
from torch import nn

import prunekit
from prunekit.measure import LayerReport, ModelReport, model_report, report_layers
from prunekit.training import sparsity_report


def test_report_layers_measures_chosen_tensors_with_totals_over_all():
    w = torch.tensor([[0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0], [1.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 2.0]])
    norm = torch.tensor([0.0, 3.0])
    rep = report_layers({"w": w, "norm": norm}, {"w": w, "norm": norm, "b": torch.ones(3)}, {"w"}, "state_dict")
    assert isinstance(rep, ModelReport) and rep.source == "state_dict"
    assert rep.layers == [
        LayerReport("w", (4, 4), 16, 4, 0.75, 4, 1, 0.25, 1.0, 0.25, True),  # column 2: the one zero 4x1 block
        LayerReport("norm", (2,), 2, 1, 0.5, 0, 0, 0.0, None, None, False),  # fewer than 2 dims: no channels
    ]
    assert (rep.numel_layers, rep.nonzero_layers, rep.sparsity_layers) == (18, 5, 13 / 18)
    assert (rep.numel_all, rep.nonzero_all) == (21, 8)
    assert (rep.channels, rep.zero_channels, rep.fits_2_4, rep.block_4x1_sparsity) == (4, 1, 1.0, 0.25)


def test_a_scalar_weight_is_measured_too():
    rep = report_layers({"s": torch.tensor(0.0)}, {"s": torch.tensor(0.0)})
    assert rep.layers == [LayerReport("s", (), 1, 0, 1.0, 0, 0, 0.0, None, None, False)]


def test_model_report_is_report_layers_over_the_weights():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 4))
    prunekit.l1_unstructured(m[0], "weight", amount=20)
    tensors, masked, kind = prunekit.measure.effective_tensors(m)
    expected = report_layers({n: t for n, t in tensors.items() if t.dim() >= 2}, tensors, masked, kind)
    assert model_report(m) == expected
    assert prunekit.report.ModelReport is ModelReport and prunekit.model_report is model_report


def test_sparsity_report_is_a_view_of_the_same_measurement():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 4))
    prunekit.l1_unstructured(m[0], "weight", amount=20)
    prunekit.l1_unstructured(m[1], "weight", amount=3)
    view = sparsity_report(m, {"0": "4x1", "1": None})
    tensors, masked, _ = prunekit.measure.effective_tensors(m)
    full = report_layers({"0.weight": tensors["0.weight"], "1.weight": tensors["1.weight"]}, tensors, masked)
    assert [(e.name, e.shape, e.numel, e.zeros, e.sparsity) for e in view.layers] == [
        (n, e.shape, e.numel, e.numel - e.nonzero, e.sparsity) for n, e in zip(("0", "1"), full.layers)]
    assert (view.numel_layers, view.zeros_layers, view.elementwise_over_layers) == (
        full.numel_layers, full.numel_layers - full.nonzero_layers, full.sparsity_layers)
    assert (view.numel_all, view.zeros_all, view.elementwise_over_all) == (
        full.numel_all, full.numel_all - full.nonzero_all, full.sparsity_all)
    assert view.layers[0].block_sparsity == full.layers[0].block_4x1_sparsity


def test_a_conv1d_weight_is_measured_along_its_inputs():
    """GPT-2's Conv1D stores (in, out): 2:4 groups run along the inputs, channels are the outputs."""
    pytest.importorskip("transformers")
    from transformers.pytorch_utils import Conv1D

    layer = Conv1D(nf=8, nx=16)
    with torch.no_grad():
        w = torch.randn(16, 8).abs() + 1
        w[0::4] = 0  # two of every four consecutive inputs zero, for every output
        w[1::4] = 0
        w[:, 3] = 0  # one whole output channel
        layer.weight.copy_(w)
    entry = model_report(torch.nn.Sequential(layer)).layers[0]
    assert entry.shape == (16, 8) and entry.channels == 8 and entry.zero_channels == 1
    assert entry.fits_2_4 == 1.0
    transposed = model_report({"0.weight": layer.weight.detach()}).layers[0]  # no module: read as stored
    assert transposed.fits_2_4 < 1.0
