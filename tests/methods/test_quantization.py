"""Pruning composes with PyTorch's dynamic quantization: zeros stay zeros."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import prunekit

quantization = pytest.importorskip("torch.ao.quantization")


def quantize(model: nn.Module, spec=None, dtype=torch.qint8) -> nn.Module:
    with warnings.catch_warnings():  # torch.ao.quantization announces its deprecation
        warnings.simplefilter("ignore")
        return quantization.quantize_dynamic(model, spec or {nn.Linear}, dtype=dtype)


def model_pruned_and_removed(amount: float = 0.9) -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, 32), nn.ReLU(), nn.Linear(32, 10))
    prunekit.l1_unstructured(model[0], "weight", amount=amount)
    prunekit.random_unstructured(model[2], "weight", amount=amount)
    prunekit.ln_structured(model[4], "weight", amount=0.5, n=2, dim=0)
    for i in (0, 2, 4):
        prunekit.remove(model[i], "weight")
    return model


def quantized_weights(qmodel: nn.Module):
    return [m.weight() for m in qmodel.modules() if hasattr(m, "weight") and callable(m.weight)]


@pytest.mark.parametrize("per_channel", [False, True])
def test_dynamic_int8_keeps_pruned_zeros_and_runs(per_channel):
    model = model_pruned_and_removed()
    float_weights = [model[i].weight.detach().clone() for i in (0, 2, 4)]
    spec = {nn.Linear: quantization.per_channel_dynamic_qconfig} if per_channel else {nn.Linear}
    qmodel = quantize(model, spec)
    qweights = quantized_weights(qmodel)
    assert len(qweights) == 3
    for w, q in zip(float_weights, qweights):
        assert q.dtype == torch.qint8
        pruned = w == 0
        # every pruned entry is stored as its zero point and dequantizes to exactly 0
        zero_point = q.q_per_channel_zero_points()[:, None] if per_channel else q.q_zero_point()
        assert bool((q.int_repr() == zero_point)[pruned].all())
        assert bool((q.dequantize()[pruned] == 0).all())
        # and quantization did not invent zeros elsewhere beyond rounding of tiny weights
        step = q.q_per_channel_scales()[:, None].float() if per_channel else torch.tensor(q.q_scale())
        half_step = (step / 2).expand_as(w)
        new_zeros = (q.dequantize() == 0) & ~pruned
        assert bool((w[new_zeros].abs() <= half_step[new_zeros] + 1e-7).all())
    x = torch.randn(16, 64)
    with torch.no_grad():
        ref = model(x)
        out = qmodel(x)
    assert out.shape == (16, 10)
    assert float((out - ref).norm() / ref.norm()) < 0.05


def test_whole_pruned_rows_stay_zero_rows():
    model = model_pruned_and_removed()
    dead_rows = (model[4].weight == 0).all(dim=1)
    assert int(dead_rows.sum()) == 5
    q = quantized_weights(quantize(model))[2]
    assert bool((q.dequantize()[dead_rows] == 0).all())


def test_float16_dynamic_quantization_keeps_zeros():
    model = model_pruned_and_removed()
    masks = [model[i].weight == 0 for i in (0, 2, 4)]
    qmodel = quantize(model, dtype=torch.float16)
    x = torch.randn(4, 64)
    with torch.no_grad():
        torch.testing.assert_close(qmodel(x), model(x), atol=1e-2, rtol=1e-2)
    # fp16 dynamic linear keeps packed weights; unpack them through the documented state dict
    sd = qmodel.state_dict()
    packed = [v for k, v in sd.items() if k.endswith("_packed_params._packed_params")]
    assert len(packed) == 3
    for (w, _bias), mask in zip(packed, masks):
        assert bool((w[mask] == 0).all()) and int((w == 0).sum()) == int(mask.sum())


def test_quantized_model_of_compressed_checkpoint(tmp_path):
    """Save compressed, load into a fresh model, quantize: same zeros as quantizing directly."""
    pytest.importorskip("safetensors")
    from prunekit.sparse import load_compressed, save_compressed

    model = model_pruned_and_removed()
    path = str(tmp_path / "m.safetensors")
    save_compressed(model, path)
    fresh = nn.Sequential(nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, 32), nn.ReLU(), nn.Linear(32, 10))
    fresh.load_state_dict(load_compressed(path))
    a, b = quantized_weights(quantize(model)), quantized_weights(quantize(fresh))
    assert all(torch.equal(x.int_repr(), y.int_repr()) for x, y in zip(a, b))


def test_layer_still_carrying_reparameterization_stays_float_until_removed():
    # quantize_dynamic matches modules by exact type; a layer that still carries its pruning
    # reparameterization is a per-instance subclass, so it is left float (and still pruned).
    # prunekit.remove first makes it a plain Linear, which is quantized.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32))
    prunekit.l1_unstructured(model[0], "weight", amount=0.9)
    qmodel = quantize(model)
    assert quantized_weights(qmodel) == [] and prunekit.is_pruned(qmodel[0])
    prunekit.remove(model[0], "weight")
    qweights = quantized_weights(quantize(model))
    assert len(qweights) == 1 and qweights[0].dtype == torch.qint8
    assert int((qweights[0].dequantize() == 0).sum()) >= int(0.9 * 64 * 32)
