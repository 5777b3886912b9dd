"""Sparse-kernel inference: conversion, outputs, decisions and their reasons, conversion back.

No test here asserts a timing; decisions that depend on a measurement are
checked through ``measure=False`` or through thresholds that every timing
passes (``min_speedup`` tiny) or fails (``min_speedup`` huge).
"""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
import torch.nn.utils.prune as torch_prune
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import prunekit
from prunekit.sparse import (
    CSRConv2d,
    CSRLinear,
    SparseInferenceModule,
    SparsifyReport,
    check_n_m_pattern,
    clear_decision_cache,
    restore_dense,
    sparsify_for_inference,
)

ATOL = 1e-5


def mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(96, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 10))


def pruned_mlp(amount: float = 0.9) -> nn.Sequential:
    model = mlp()
    for i in (0, 2, 4):
        prunekit.l1_unstructured(model[i], "weight", amount=amount)
    return model


def two_four_mask(weight: torch.Tensor) -> torch.Tensor:
    """Keep the two largest magnitudes in every group of four inputs."""
    out, inp = weight.shape
    groups = weight.abs().reshape(out, inp // 4, 4)
    keep = torch.zeros_like(groups, dtype=torch.bool)
    keep.scatter_(-1, groups.topk(2, dim=-1).indices, True)
    return keep.reshape(out, inp)


# --------------------------------------------------------------------------- #
# outputs of converted models
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("shape", [(1, 96), (7, 96), (2, 5, 96), (96,)])
def test_converted_mlp_matches_masked_model(shape):
    model = pruned_mlp(0.9)
    x = torch.randn(*shape)
    with torch.no_grad():
        expected = model(x)
    report = sparsify_for_inference(model, measure=False)
    assert [d.name for d in report.converted] == ["0", "2", "4"]
    assert all(isinstance(model[i], CSRLinear) for i in (0, 2, 4))
    assert all(d.format == "csr" for d in report.converted)
    with torch.no_grad():
        got = model(x)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=1e-5)


def test_nnz_of_converted_layers_is_exact():
    model = pruned_mlp(0.9)
    kept = [int(model[i].weight_mask.sum()) for i in (0, 2, 4)]
    report = sparsify_for_inference(model, measure=False)
    assert [model[i].nnz for i in (0, 2, 4)] == kept
    sizes = (96 * 128, 128 * 64, 64 * 10)
    assert [d.sparsity for d in report.converted] == [(n - k) / n for k, n in zip(kept, sizes)]


def test_linear_without_bias_and_torch_pruned_layer():
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(32, 48, bias=False), nn.Linear(48, 8))
    torch_prune.l1_unstructured(model[0], "weight", amount=0.8)  # torch's own hook-based reparameterization
    prunekit.random_unstructured(model[1], "weight", amount=0.7)
    x = torch.randn(4, 32)
    with torch.no_grad():
        expected = model(x)
    report = sparsify_for_inference(model, measure=False)
    assert len(report.converted) == 2 and model[0].bias is None
    with torch.no_grad():
        torch.testing.assert_close(model(x), expected, atol=ATOL, rtol=1e-5)


def test_float64_layer_matches_tightly():
    lin = nn.Linear(40, 30).double()
    prunekit.l1_unstructured(lin, "weight", amount=0.75)
    model = nn.Sequential(lin)
    x = torch.randn(6, 40, dtype=torch.float64)
    with torch.no_grad():
        expected = model(x)
    sparsify_for_inference(model, measure=False)
    torch.testing.assert_close(model(x), expected, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize(
    "kwargs",
    [dict(kernel_size=3, padding=1), dict(kernel_size=3, stride=2), dict(kernel_size=(3, 1), dilation=2, padding=(2, 0)),
     dict(kernel_size=1, bias=False)],
)
def test_conv2d_with_example_inputs(kwargs):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(4, 16, **kwargs), nn.ReLU(), nn.Conv2d(16, 8, 1))
    prunekit.l1_unstructured(model[0], "weight", amount=0.9)
    prunekit.l1_unstructured(model[2], "weight", amount=0.9)
    x = torch.randn(2, 4, 11, 9)
    with torch.no_grad():
        expected = model(x)
    report = sparsify_for_inference(model, example_inputs=x, measure=False)
    assert [d.name for d in report.converted] == ["0", "2"]
    assert isinstance(model[0], CSRConv2d) and report["0"].rows == 2
    with torch.no_grad():
        torch.testing.assert_close(model(x), expected, atol=ATOL, rtol=1e-5)
        torch.testing.assert_close(model[0](x[0]), restore_dense(model)[0](x[0]), atol=ATOL, rtol=1e-5)


def test_conv_reasons_without_example_and_for_groups():
    model = nn.Sequential(nn.Conv2d(4, 8, 3, groups=2), nn.Conv2d(8, 8, 1))
    for m in model:
        prunekit.l1_unstructured(m, "weight", amount=0.9)
    report = sparsify_for_inference(model, measure=False)
    assert report.converted == []
    assert "groups=2" in report["0"].reason
    assert "needs example_inputs" in report["1"].reason
    assert all(type(m).__name__ == "Conv2d" for m in model)


# --------------------------------------------------------------------------- #
# decisions and reasons
# --------------------------------------------------------------------------- #
def test_min_sparsity_keeps_layers_dense_without_measuring():
    model = mlp()
    prunekit.l1_unstructured(model[0], "weight", amount=0.3)
    report = sparsify_for_inference(model, min_sparsity=0.5)
    assert report.converted == []
    d = report["0"]
    assert d.reason == "sparsity 30.0% is below min_sparsity 50%" and d.dense_ms is None
    assert report["2"].sparsity == 0.0
    assert isinstance(report, SparsifyReport) and "0 of 3 candidate layers converted" in report.summary()


def test_measured_decision_follows_min_speedup_and_is_cached():
    clear_decision_cache()
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
    with torch.no_grad():
        for m in model:
            m.weight[:, 8:] = 0  # both: same shape, same sparsity
    never = sparsify_for_inference(copy.deepcopy(model), min_speedup=1e9)
    assert never.converted == []
    assert never["0"].cached is False and never["1"].cached is True
    assert never["0"].dense_ms == never["1"].dense_ms and never["0"].sparse_ms == never["1"].sparse_ms
    assert "only" in never["0"].reason and "needs 1000000000.00x" in never["0"].reason
    # same layers, cached timing reused; a threshold every timing passes converts them
    always = sparsify_for_inference(copy.deepcopy(model), min_speedup=1e-9)
    assert [d.name for d in always.converted] == ["0", "1"]
    assert always["0"].cached and always["0"].speedup == pytest.approx(never["0"].speedup)
    assert "faster than dense on 8 rows" in always["0"].reason
    clear_decision_cache()
    again = sparsify_for_inference(copy.deepcopy(model), batch_size=3)
    assert again["0"].cached is False and again["0"].rows == 3


def test_measured_conversion_outputs_match():
    model = pruned_mlp(0.95)
    x = torch.randn(8, 96)
    with torch.no_grad():
        expected = model(x)
    report = sparsify_for_inference(model, min_speedup=1e-9, budget_ms=1)
    # which policy wins is measured (at 95% the 10-output layer may have whole zero rows, so
    # 'channels' can win there); every layer runs the one the report names
    for i in (0, 2, 4):
        assert isinstance(model[i], SparseInferenceModule)
        assert model[i].policy == report[str(i)].policy
        assert report[str(i)].timings_ms[model[i].policy] == min(
            ms for p, ms in report[str(i)].timings_ms.items() if p != "dense")
    with torch.no_grad():
        torch.testing.assert_close(model(x), expected, atol=ATOL, rtol=1e-5)


def test_unsupported_dtype_is_explained_and_model_still_runs():
    model = pruned_mlp(0.9).to(torch.bfloat16)
    report = sparsify_for_inference(model, measure=False)
    if report.converted:  # a future PyTorch may add bfloat16 CSR kernels on CPU
        pytest.skip("this PyTorch runs bfloat16 CSR products on CPU")
    reason = report["0"].reason
    assert reason.startswith("no sparse policy can run this layer")
    assert "csr: prunekit's kernels take float32/float64 CPU tensors, not torch.bfloat16" in reason
    assert "csr-torch: unavailable here: NotImplementedError" in reason
    assert report["0"].not_tried["csr-torch"].startswith("unavailable here")
    assert not any(isinstance(model[i], SparseInferenceModule) for i in (0, 2, 4))
    assert model(torch.randn(2, 96, dtype=torch.bfloat16)).shape == (2, 10)


def test_multihead_attention_out_proj_is_left_alone():
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(32, 4, batch_first=True)
    prunekit.l1_unstructured(mha.out_proj, "weight", amount=0.9)
    model = nn.Sequential(mha)
    report = sparsify_for_inference(model, measure=False)
    assert report.converted == []
    assert "MultiheadAttention" in report["0.out_proj"].reason
    x = torch.randn(2, 5, 32)
    assert model[0](x, x, x)[0].shape == (2, 5, 32)


def test_shared_layer_is_replaced_everywhere():
    shared = nn.Linear(32, 32)
    prunekit.l1_unstructured(shared, "weight", amount=0.9)
    model = nn.Sequential(shared, nn.ReLU(), shared)
    x = torch.randn(3, 32)
    with torch.no_grad():
        expected = model(x)
    report = sparsify_for_inference(model, measure=False)
    assert len(report.layers) == 1 and model[0] is model[2] and isinstance(model[0], CSRLinear)
    with torch.no_grad():
        torch.testing.assert_close(model(x), expected, atol=ATOL, rtol=1e-5)
    restore_dense(model)
    assert model[0] is shared and model[2] is shared


def test_root_layer_is_explained_not_replaced():
    lin = nn.Linear(32, 32)
    prunekit.l1_unstructured(lin, "weight", amount=0.9)
    report = sparsify_for_inference(lin, measure=False)
    assert report.converted == [] and "wrap it" in report[""].reason
    assert type(lin).__name__ == "Linear" and lin.weight_mask.shape == (32, 32)


def test_layer_types_filter():
    model = nn.Sequential(nn.Linear(16, 16), nn.Conv2d(2, 2, 1))
    with torch.no_grad():
        model[0].weight.zero_()
        model[1].weight.zero_()
    report = sparsify_for_inference(model, layer_types=("conv2d",), example_inputs=None, measure=False)
    assert [d.name for d in report.layers] == ["1"] and isinstance(model[0], nn.Linear)


def test_sparse_modules_are_not_reconverted():
    model = pruned_mlp(0.9)
    sparsify_for_inference(model, measure=False)
    second = sparsify_for_inference(model, measure=False)
    assert second.layers == []


def test_bad_arguments_leave_model_unchanged():
    model = pruned_mlp(0.9)
    before = [type(m) for m in model]
    with pytest.raises(ValueError, match="format='3:4'"):
        sparsify_for_inference(model, format="3:4")
    with pytest.raises(ValueError, match="min_sparsity=1.5"):
        sparsify_for_inference(model, min_sparsity=1.5)
    with pytest.raises(ValueError, match="layer_types"):
        sparsify_for_inference(model, layer_types=("lstm",))
    with pytest.raises(ValueError, match="batch_size=0"):
        sparsify_for_inference(model, batch_size=0)
    with pytest.raises(TypeError, match="nn.Module"):
        sparsify_for_inference(model.state_dict())
    assert [type(m) for m in model] == before


# --------------------------------------------------------------------------- #
# converting back
# --------------------------------------------------------------------------- #
def test_restore_dense_gives_back_the_original_modules():
    model = pruned_mlp(0.9)
    originals = [model[i] for i in (0, 2, 4)]
    sd_before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(5, 96)
    with torch.no_grad():
        expected = model(x)
    sparsify_for_inference(model, measure=False)
    assert "0.weight_orig" not in model.state_dict() and "0.values" in model.state_dict()
    restored = restore_dense(model)
    assert restored is model
    assert [model[i] for i in (0, 2, 4)] == originals
    assert prunekit.is_pruned(model)
    sd_after = model.state_dict()
    assert sd_after.keys() == sd_before.keys()
    assert all(torch.equal(sd_after[k], sd_before[k]) for k in sd_before)
    with torch.no_grad():
        assert torch.equal(model(x), expected)


def test_restore_without_original_builds_dense_layers_with_masked_weights():
    model = pruned_mlp(0.9)
    masked = [model[i].weight.detach().clone() for i in (0, 2, 4)]
    biases = [model[i].bias.detach().clone() for i in (0, 2, 4)]
    sparsify_for_inference(model, measure=False, keep_original=False)
    assert model[0].original is None
    restore_dense(model)
    for j, i in enumerate((0, 2, 4)):
        assert type(model[i]) is nn.Linear
        assert torch.equal(model[i].weight, masked[j]) and torch.equal(model[i].bias, biases[j])


def test_converted_model_copies_pickles_and_saves():
    model = pruned_mlp(0.9)
    sparsify_for_inference(model, measure=False)
    x = torch.randn(3, 96)
    with torch.no_grad():
        y = model(x)
    for clone in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        with torch.no_grad():
            assert torch.equal(clone(x), y)
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    buf.seek(0)
    fresh = pruned_mlp(0.5)
    sparsify_for_inference(fresh, measure=False)  # same structure, other weights
    sd = torch.load(buf)
    # nnz differs, so buffers are replaced rather than copied into
    for i in (0, 2, 4):
        for part in ("crow_indices", "col_indices", "values", "bias"):
            setattr(fresh[i], part, sd[f"{i}.{part}"])
    with torch.no_grad():
        assert torch.equal(fresh(x), y)
    assert list(model.parameters()) == []  # inference modules hold buffers only


def test_in_place_buffer_change_is_seen():
    lin = nn.Linear(16, 4)
    with torch.no_grad():
        lin.weight[:, 2:] = 0
    sp = CSRLinear.from_dense(lin)
    x = torch.randn(2, 16)
    y0 = sp(x)
    with torch.no_grad():
        sp.values.mul_(2)
        lin.weight.mul_(2)
        torch.testing.assert_close(sp(x) - sp.bias, lin(x) - lin.bias, atol=ATOL, rtol=1e-5)
    assert not torch.equal(sp(x), y0)


@settings(max_examples=25, deadline=None)
@given(
    out_f=st.integers(1, 40), in_f=st.integers(1, 40), rows=st.integers(0, 6),
    sparsity=st.floats(0, 1), bias=st.booleans(), seed=st.integers(0, 1000),
)
def test_csr_linear_property(out_f, in_f, rows, sparsity, bias, seed):
    g = torch.Generator().manual_seed(seed)
    lin = nn.Linear(in_f, out_f, bias=bias)
    with torch.no_grad():
        lin.weight.mul_(torch.rand(out_f, in_f, generator=g) >= sparsity)
    sp = CSRLinear.from_dense(lin)
    assert sp.nnz == int((lin.weight != 0).sum())
    x = torch.randn(rows, in_f, generator=g)
    with torch.no_grad():
        torch.testing.assert_close(sp(x), lin(x), atol=ATOL, rtol=1e-5)
        assert torch.equal(sp.to_dense_module().weight, lin.weight)


# --------------------------------------------------------------------------- #
# N:M (2:4) export
# --------------------------------------------------------------------------- #
def test_check_n_m_pattern_counts_bad_groups():
    w = torch.zeros(2, 8)
    assert check_n_m_pattern(w) == (True, "every group of 4 inputs holds at most 2 non-zeros")
    w[0, :3] = 1  # one group with three non-zeros
    w[1, 4:] = 1  # one group with four
    ok, why = check_n_m_pattern(w)
    assert not ok and why.startswith("2 of 4 groups of 4 inputs hold more than 2 non-zeros")
    assert check_n_m_pattern(torch.zeros(3, 6)) == (False, "the input dimension (6) is not a multiple of 4")
    assert check_n_m_pattern(torch.ones(3, 6), 3, 3)[0]
    with pytest.raises(ValueError, match="n=5, m=4"):
        check_n_m_pattern(w, 5, 4)


def test_two_four_on_cpu_validates_and_explains():
    if torch.cuda.is_available():
        pytest.skip("explains the CPU path; a CUDA device converts instead")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 16), nn.Conv2d(1, 1, 1))
    prunekit.custom_from_mask(model[0], "weight", two_four_mask(model[0].weight))
    prunekit.l1_unstructured(model[2], "weight", amount=0.5)  # 50% but not 2:4
    x = torch.randn(4, 64)
    with torch.no_grad():
        expected = model[:3](x)
    report = sparsify_for_inference(model, format="2:4")
    assert report.converted == []
    assert "no CUDA device" in report.device_note and report.device_note in report.summary()
    first = report["0"].reason
    assert first.startswith("2:4 pattern valid (every group of 4 inputs holds at most 2 non-zeros)")
    assert "run only on CUDA devices; this layer is on cpu" in first
    assert report["2"].reason.startswith("not a 2:4 pattern: ")
    assert "groups of 4 inputs hold more than 2 non-zeros" in report["2"].reason
    assert report["3"].reason == "2:4 semi-structured kernels exist only for Linear layers"
    assert not any(isinstance(m, SparseInferenceModule) for m in model.modules())
    with torch.no_grad():
        assert torch.equal(model[:3](x), expected)


def test_two_four_auto_on_cpu_falls_back_to_csr():
    if torch.cuda.is_available():
        pytest.skip("CPU behaviour")
    lin = nn.Linear(64, 32)
    prunekit.custom_from_mask(lin, "weight", two_four_mask(lin.weight))
    model = nn.Sequential(lin)
    report = sparsify_for_inference(model, format="auto", measure=False)
    assert report["0"].format == "csr" and report["0"].converted


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (2:4 semi-structured kernels)")
def test_two_four_on_cuda_converts_and_matches():  # pragma: no cover - no CUDA in CI
    from prunekit.sparse import SemiStructuredLinear

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 64)).half().cuda()
    for i in (0, 2):
        prunekit.custom_from_mask(model[i], "weight", two_four_mask(model[i].weight))
    x = torch.randn(32, 128, dtype=torch.float16, device="cuda")
    with torch.no_grad():
        expected = model(x)
    report = sparsify_for_inference(model, format="2:4", measure=False)
    assert [d.name for d in report.converted] == ["0", "2"]
    assert isinstance(model[0], SemiStructuredLinear)
    with torch.no_grad():
        torch.testing.assert_close(model(x), expected, atol=1e-2, rtol=1e-2)
    restore_dense(model)
    with torch.no_grad():
        assert torch.equal(model(x), expected)
