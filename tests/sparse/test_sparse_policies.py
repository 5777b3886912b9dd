"""prunekit's compiled sparse kernels, the execution policies, and all-or-nothing conversion.

No test here asserts a timing: which policy wins is measured at run time, so
the tests check what every policy computes, which policies are offered for
which weights (and why the others are not), that the report carries a figure
for every policy measured, and that a failure anywhere leaves the model as it
was. ``make test`` builds the kernels first (``make kernels``).
"""

from __future__ import annotations

import copy
import os
import pickle

import pytest
import torch
from torch import nn

import prunekit
from prunekit.sparse import (
    BSRLinear,
    ChannelLinear,
    CSRConv2d,
    CSRLinear,
    SparseInferenceModule,
    clear_decision_cache,
    native,
    policies,
    restore_dense,
    sparsify_for_inference,
)

DISABLED = os.environ.get("PRUNEKIT_SPARSE_KERNELS", "1").lower() in ("0", "off", "false", "no")
needs_kernels = pytest.mark.skipif(DISABLED, reason="PRUNEKIT_SPARSE_KERNELS=0")


def sparse_weight(out_f: int, in_f: int, sparsity: float, seed: int = 0, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out_f, in_f, generator=g, dtype=dtype)
    return w * (torch.rand(out_f, in_f, generator=g) >= sparsity).to(dtype)


def block_weight(out_f: int, in_f: int, block, sparsity: float, seed: int = 0) -> torch.Tensor:
    bh, bw = block
    g = torch.Generator().manual_seed(seed)
    keep = (torch.rand(out_f // bh, in_f // bw, generator=g) >= sparsity).float()
    keep = keep.repeat_interleave(bh, 0).repeat_interleave(bw, 1)
    return torch.randn(out_f, in_f, generator=g) * keep


def linear_from(weight: torch.Tensor, bias: bool = True) -> nn.Linear:
    lin = nn.Linear(weight.shape[1], weight.shape[0], bias=bias, dtype=weight.dtype)
    with torch.no_grad():
        lin.weight.copy_(weight)
    return lin


def tol(dtype):
    return dict(atol=1e-10, rtol=1e-10) if dtype == torch.float64 else dict(atol=1e-4, rtol=1e-4)


# --------------------------------------------------------------------------- #
# the compiled kernels
# --------------------------------------------------------------------------- #
@needs_kernels
def test_kernels_are_built_for_this_machine():
    assert native.available(), native.unavailable_reason()
    assert native.unavailable_reason() == ""


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("rows", [1, 2, 5, 8, 13, 16, 31, 70])
@pytest.mark.parametrize("threads", [0, 1])
def test_compiled_csr_equals_dense(dtype, rows, threads):
    w = sparse_weight(37, 53, 0.8, seed=rows, dtype=dtype)  # odd sizes: partial tiles everywhere
    lin = linear_from(w)
    x = torch.randn(rows, 53, dtype=dtype)
    sp = CSRLinear.from_dense(lin, kernel="prunekit", threads=threads)
    assert sp.policy == ("csr-1t" if threads else "csr") and sp.col_indices.dtype == torch.int16
    with torch.no_grad():
        torch.testing.assert_close(sp(x), lin(x), **tol(dtype))


@needs_kernels
def test_compiled_csr_with_int32_columns_empty_rows_and_no_bias():
    w = sparse_weight(6, 32770, 0.999, seed=3)  # more columns than int16 indexes
    w[2] = 0  # an empty row
    lin = linear_from(w, bias=False)
    sp = CSRLinear.from_dense(lin, kernel="prunekit")
    assert sp.col_indices.dtype == torch.int32
    for rows in (1, 9):
        x = torch.randn(rows, 32770)
        with torch.no_grad():
            got, want = sp(x), lin(x)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        assert torch.equal(got[:, 2], torch.zeros(rows))
    assert sp(torch.randn(0, 32770)).shape == (0, 6)


@needs_kernels
@pytest.mark.parametrize("block", [(4, 1), (1, 4)])
@pytest.mark.parametrize("rows", [1, 3, 8, 40])
@pytest.mark.parametrize("threads", [0, 1])
def test_compiled_bsr_equals_dense(block, rows, threads):
    w = block_weight(24, 36, block, 0.7, seed=rows)
    lin = linear_from(w)
    sp = BSRLinear.from_dense(lin, block=block, threads=threads)
    kept_blocks = int((w.reshape(24 // block[0], block[0], 36 // block[1], block[1]) != 0).any(3).any(1).sum())
    assert sp.nnz_blocks == kept_blocks
    assert sp.policy == f"bsr{block[0]}x{block[1]}" + ("-1t" if threads else "")
    x = torch.randn(2, rows, 36)
    with torch.no_grad():
        torch.testing.assert_close(sp(x), lin(x), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(sp.dense_weight(), w)
    torch.testing.assert_close(sp.to_dense_module().weight, w)


def test_bsr_refuses_shapes_that_are_not_whole_blocks():
    with pytest.raises(ValueError, match=r"BSRLinear: shape \(6, 8\) is not a multiple of the 4x1 block"):
        BSRLinear(torch.zeros(6, 8), None, block=(4, 1))
    with pytest.raises(ValueError, match=r"block=\(2, 2\); use \(4, 1\) or \(1, 4\)"):
        BSRLinear(torch.zeros(8, 8), None, block=(2, 2))
    with pytest.raises(ValueError, match="threads=2; use 0"):
        CSRLinear(torch.zeros(8, 8), None, threads=2)
    with pytest.raises(ValueError, match="kernel='mkl'; use one of"):
        CSRLinear(torch.zeros(8, 8), None, kernel="mkl")


def test_channel_linear_drops_whole_rows_and_columns():
    w = sparse_weight(12, 10, 0.3, seed=1)
    w[[0, 5, 7]] = 0
    w[:, [2, 3]] = 0
    lin = linear_from(w)
    sp = ChannelLinear.from_dense(lin)
    assert tuple(sp.weight.shape) == (9, 8) and sp.policy == "channels"
    x = torch.randn(3, 4, 10)
    with torch.no_grad():
        out = sp(x)
        torch.testing.assert_close(out, lin(x), atol=1e-5, rtol=1e-5)
    assert torch.equal(out[..., 5], lin.bias[5].expand(3, 4))  # a dropped output holds its bias
    torch.testing.assert_close(sp.to_dense_module().weight, w)


def test_without_compiled_kernels_the_prunekit_policy_computes_through_torch(monkeypatch):
    monkeypatch.setitem(native._state, "loaded", False)
    monkeypatch.setitem(native._state, "reason", "not built (test)")
    lin = linear_from(sparse_weight(16, 16, 0.75))
    sp = CSRLinear.from_dense(lin, kernel="prunekit")
    blocks = BSRLinear.from_dense(linear_from(block_weight(16, 16, (4, 1), 0.5)), block=(4, 1))
    x = torch.randn(3, 16)
    with torch.no_grad():
        torch.testing.assert_close(sp(x), lin(x), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(blocks(x), blocks.to_dense_module()(x), atol=1e-5, rtol=1e-5)
    model = nn.Sequential(lin)
    report = sparsify_for_inference(model, measure=False)
    assert report.device_note == "prunekit's compiled kernels: not built (test)"
    assert report["0"].not_tried["csr"] == "compiled kernels unavailable: not built (test)"
    assert model[0].policy == "csr-torch-1t"  # the first policy that can run without them


def test_csr_module_pickled_before_policies_runs_torch_on_one_thread():
    sp = CSRLinear.from_dense(linear_from(sparse_weight(8, 8, 0.5)), kernel="prunekit")
    state = sp.__getstate__()
    del state["kernel"], state["threads"]
    old = CSRLinear.__new__(CSRLinear)
    old.__setstate__(state)
    assert (old.kernel, old.threads, old.policy) == ("torch", 1, "csr-torch-1t")
    clone = pickle.loads(pickle.dumps(sp))
    assert clone.policy == "csr"


# --------------------------------------------------------------------------- #
# which policies are offered
# --------------------------------------------------------------------------- #
def _offered(weight, wanted=policies.POLICIES):
    lin = linear_from(weight)
    return policies.candidates("linear", lin, weight, wanted, True)


@needs_kernels
def test_unstructured_weight_is_offered_csr_only_with_reasons_for_the_rest():
    builders, skipped = _offered(sparse_weight(64, 64, 0.9))
    expected = {"csr", "csr-torch"} if torch.get_num_threads() == 1 else {"csr", "csr-1t", "csr-torch",
                                                                          "csr-torch-1t"}
    assert set(builders) == expected
    assert skipped["bsr4x1"].startswith("only ") and "prune with pattern '4x1'" in skipped["bsr4x1"]
    assert skipped["channels"].startswith("whole zero rows/columns leave")
    assert skipped["2:4"] == "not a 2:4 pattern" or skipped["2:4"] == "2:4 kernels take only Linear layers"


@needs_kernels
@pytest.mark.parametrize("block", [(4, 1), (1, 4)])
def test_block_pattern_is_offered_its_blocked_layout(block):
    builders, skipped = _offered(block_weight(64, 64, block, 0.9), wanted=["bsr4x1", "bsr1x4", "csr"])
    name = f"bsr{block[0]}x{block[1]}"
    other = "bsr1x4" if name == "bsr4x1" else "bsr4x1"
    assert set(builders) == {name, "csr"}
    assert other in skipped
    module = builders[name]()
    assert isinstance(module, BSRLinear) and module.block == block


def test_channel_pattern_is_offered_a_smaller_dense_product():
    w = sparse_weight(64, 64, 0.0)
    w[:40] = 0
    builders, _ = _offered(w, wanted=["channels"])
    assert isinstance(builders["channels"](), ChannelLinear)


@needs_kernels
def test_policies_argument_forces_the_policy_and_the_layers_really_are_converted():
    for policy, cls in [("csr", CSRLinear), ("csr-torch", CSRLinear), ("bsr4x1", BSRLinear),
                        ("channels", ChannelLinear)]:
        w = block_weight(64, 64, (4, 1), 0.9) if policy == "bsr4x1" else sparse_weight(64, 64, 0.9)
        if policy == "channels":
            w[:48] = 0
        model = nn.Sequential(linear_from(w), nn.ReLU())
        x = torch.randn(5, 64)
        with torch.no_grad():
            expected = model(x)
        report = sparsify_for_inference(model, measure=False, policies=[policy])
        assert type(model[0]) is cls and model[0].policy == policy
        assert report["0"].converted and report["0"].policy == policy
        with torch.no_grad():
            torch.testing.assert_close(model(x), expected, atol=1e-5, rtol=1e-5)


def test_policies_argument_is_checked():
    model = nn.Sequential(linear_from(sparse_weight(8, 8, 0.9)))
    with pytest.raises(ValueError, match=r"unknown policies \['mkl'\]"):
        sparsify_for_inference(model, policies=["mkl"])
    with pytest.raises(TypeError, match=r"policies='csr' must be a list of names, e.g. \['csr'\]"):
        sparsify_for_inference(model, policies="csr")
    with pytest.raises(ValueError, match=r"none of policies=\['channels'\] belongs to format='csr'"):
        sparsify_for_inference(model, format="csr", policies=["channels"])
    assert type(model[0]) is nn.Linear


@needs_kernels
def test_report_has_a_figure_for_every_policy_measured():
    clear_decision_cache()
    w = sparse_weight(64, 64, 0.9)
    w[:, :8] = 0  # 8 of 64 columns: too few for 'channels'
    model = nn.Sequential(linear_from(w))
    report = sparsify_for_inference(model, min_speedup=1e9, budget_ms=1)
    d = report["0"]
    offered = {"csr", "csr-torch"} | (set() if torch.get_num_threads() == 1 else {"csr-1t", "csr-torch-1t"})
    assert set(d.timings_ms) == offered | {"dense"}
    assert all(ms > 0 for ms in d.timings_ms.values())
    assert d.policy == min(offered, key=d.timings_ms.get) and not d.converted
    assert d.sparse_ms == d.timings_ms[d.policy] and d.dense_ms == d.timings_ms["dense"]
    assert {"bsr4x1", "bsr1x4", "channels", "2:4"} <= set(d.not_tried)
    text = report.summary()
    for name in offered:
        assert f"{name} {d.timings_ms[name]:.3f} ms" in text
    assert isinstance(model[0], nn.Linear) and not isinstance(model[0], SparseInferenceModule)


@needs_kernels
def test_measured_conversion_keeps_the_fastest_and_matches():
    clear_decision_cache()
    model = nn.Sequential(linear_from(sparse_weight(96, 64, 0.9)), nn.ReLU(), linear_from(sparse_weight(32, 96, 0.95)))
    x = torch.randn(7, 64)
    with torch.no_grad():
        expected = model(x)
    report = sparsify_for_inference(model, example_inputs=x, min_speedup=1e-9, budget_ms=1)
    for i in ("0", "2"):
        d = report[i]
        assert d.converted and d.policy == min((p for p in d.timings_ms if p != "dense"), key=d.timings_ms.get)
        assert getattr(model, i).policy == d.policy
    with torch.no_grad():
        torch.testing.assert_close(model(x), expected, atol=1e-5, rtol=1e-5)


@needs_kernels
def test_conv_runs_on_the_compiled_kernel():
    conv = nn.Conv2d(4, 8, 3, padding=1)
    with torch.no_grad():
        conv.weight.mul_((torch.rand_like(conv.weight) > 0.8).float())
    x = torch.randn(2, 4, 6, 6)
    sp = CSRConv2d.from_dense(conv, kernel="prunekit")
    with torch.no_grad():
        torch.testing.assert_close(sp(x), conv(x), atol=1e-5, rtol=1e-5)
    model = nn.Sequential(conv)
    sparsify_for_inference(model, example_inputs=x, measure=False, policies=["csr"])
    assert type(model[0]) is CSRConv2d and model[0].policy == "csr"


# --------------------------------------------------------------------------- #
# all or nothing
# --------------------------------------------------------------------------- #
def _state(model):
    return ([(n, type(m), id(m), m.training) for n, m in model.named_modules()],
            {k: v.clone() for k, v in model.state_dict().items()},
            [(n, len(m._forward_pre_hooks), len(m._forward_hooks)) for n, m in model.named_modules()])


def _assert_same(model, before):
    mods, sd, hooks = _state(model)
    assert mods == before[0] and hooks == before[2]
    assert sd.keys() == before[1].keys() and all(torch.equal(sd[k], before[1][k]) for k in sd)


class Interrupting(nn.Sequential):
    """Raises at the n-th submodule assignment (counting from 1)."""

    def __init__(self, *mods, at: int = 0, exc: type = KeyboardInterrupt):
        super().__init__(*mods)
        object.__setattr__(self, "_at", at)
        object.__setattr__(self, "_exc", exc)
        object.__setattr__(self, "_count", 0)

    def __setattr__(self, name, value):
        if isinstance(value, nn.Module) and self._at:
            object.__setattr__(self, "_count", self._count + 1)
            if self._count == self._at:
                raise self._exc(f"injected at assignment {self._count}")
        super().__setattr__(name, value)


def _interrupting_model(at: int, exc: type = KeyboardInterrupt):
    torch.manual_seed(0)
    model = Interrupting(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32), nn.Linear(32, 16), at=at, exc=exc)
    for i in (0, 2, 3):
        prunekit.l1_unstructured(model[i], "weight", amount=0.9)
    model.train()
    return model


@pytest.mark.parametrize("exc", [KeyboardInterrupt, RuntimeError])
@pytest.mark.parametrize("at", [1, 2, 3])
def test_sparsify_failing_at_any_swap_leaves_the_model_as_it_was(at, exc):
    model = _interrupting_model(at, exc)
    before = _state(model)
    with pytest.raises(exc, match=f"injected at assignment {at}"):
        sparsify_for_inference(model, example_inputs=torch.randn(3, 32), measure=False)
    _assert_same(model, before)
    object.__setattr__(model, "_at", 0)  # the same call without the fault converts all three
    report = sparsify_for_inference(model, example_inputs=torch.randn(3, 32), measure=False)
    assert [d.name for d in report.converted] == ["0", "2", "3"]
    assert model.training and all(model[i].training for i in range(4))  # example run did not leave eval mode


@pytest.mark.parametrize("step", ["capture", "build", "measure"])
def test_sparsify_interrupted_while_deciding_leaves_the_model_as_it_was(monkeypatch, step):
    model = _interrupting_model(0)
    before = _state(model)

    def boom(*args, **kwargs):
        raise KeyboardInterrupt(step)

    if step == "capture":  # inside the model's forward on the example input
        monkeypatch.setattr(model[2], "forward", boom)
    elif step == "build":
        monkeypatch.setattr(policies, "CSRLinear", boom)
    else:
        monkeypatch.setattr("prunekit.sparse.inference.measure_in_context", boom)
    clear_decision_cache()
    with pytest.raises(KeyboardInterrupt, match=step):
        sparsify_for_inference(model, example_inputs=torch.randn(3, 32), policies=["csr-torch"])
    monkeypatch.undo()
    _assert_same(model, before)


@pytest.mark.parametrize("exc", [KeyboardInterrupt, RuntimeError])
@pytest.mark.parametrize("at", [1, 2, 3])
def test_restore_dense_failing_at_any_swap_leaves_the_model_as_it_was(at, exc):
    model = _interrupting_model(0)
    sparsify_for_inference(model, measure=False)
    sparse_before = _state(model)
    object.__setattr__(model, "_at", at)
    object.__setattr__(model, "_exc", exc)
    object.__setattr__(model, "_count", 0)
    with pytest.raises(exc):
        restore_dense(model)
    _assert_same(model, sparse_before)
    object.__setattr__(model, "_at", 0)
    restore_dense(model)
    assert not any(isinstance(m, SparseInferenceModule) for m in model.modules())


def test_restore_dense_failing_to_build_a_dense_layer_changes_nothing(monkeypatch):
    model = _interrupting_model(0)
    sparsify_for_inference(model, measure=False, keep_original=False)
    before = _state(model)

    def boom(self):
        raise KeyboardInterrupt("to_dense_module")

    monkeypatch.setattr(CSRLinear, "to_dense_module", boom)
    with pytest.raises(KeyboardInterrupt):
        restore_dense(model)
    _assert_same(model, before)


def test_converted_model_deepcopies_with_its_policies():
    model = nn.Sequential(linear_from(sparse_weight(16, 16, 0.9)))
    sparsify_for_inference(model, measure=False, policies=["csr-torch-1t"])
    clone = copy.deepcopy(model)
    assert clone[0].policy == "csr-torch-1t"
    x = torch.randn(2, 16)
    torch.testing.assert_close(clone(x), model(x))
