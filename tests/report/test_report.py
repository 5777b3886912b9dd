"""prunekit.report: per-layer sparsity as data, checkpoint reading, plots."""

import os

import pytest
import torch
import torch.nn.utils.prune as torch_prune
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import prunekit
from prunekit.report import (
    UnsafeCheckpointError,
    model_report,
    plot_accuracy_vs_sparsity,
    plot_layer_sparsity,
    read_checkpoint,
)


def _cnn():
    return nn.Sequential(nn.Conv2d(4, 8, 3), nn.ReLU(), nn.Conv2d(8, 8, 1), nn.Flatten(), nn.Linear(8 * 4 * 4, 6))


# --------------------------------------------------------------------- exact figures on hand-made tensors
def test_figures_of_a_hand_made_linear():
    w = torch.ones(8, 8)
    w[0] = 0  # one whole output channel
    w[1, :4] = 0  # row 1: first group of 4 is empty, second is full
    w[2:4, 0] = 0  # rows 2..3 col 0; with rows 0..1 col 0 also zero -> the 4x1 block (rows 0-3, col 0) is zero
    r = model_report({"fc.weight": w, "fc.bias": torch.ones(8)})
    e = r.layer("fc.weight")
    assert e.shape == (8, 8) and e.numel == 64
    assert e.nonzero == 64 - 8 - 4 - 2
    assert e.sparsity == pytest.approx(14 / 64)
    assert (e.zero_channels, e.channels) == (1, 8)
    # groups of 4 along the input: 16 groups; fitting 2:4 (<= 2 non-zeros): row 0 (2 groups), row 1 first group
    assert e.fits_2_4 == pytest.approx(3 / 16)
    # 4x1 blocks: 2 row-blocks x 8 columns = 16; zero: rows 0-3 col 0 only
    assert e.block_4x1_sparsity == pytest.approx(1 / 16)
    assert r.numel_all == 72 and r.nonzero_all == 50 + 8
    assert r.sparsity_layers == pytest.approx(14 / 64)


def test_conv_layout_groups_run_along_input_channels():
    # (out=4, in=4, 1, 2): zero input channels 2 and 3 at both kernel positions -> every group of 4
    # (the 4 input channels at one kernel position) holds 2 non-zeros: fits 2:4 everywhere
    w = torch.ones(4, 4, 1, 2)
    w[:, 2:] = 0
    e = model_report({"c.weight": w}).layers[0]
    assert e.fits_2_4 == 1.0
    assert e.block_4x1_sparsity == pytest.approx(0.5)  # 1 row block x 8 columns, 4 of them zero
    # zeroing along the kernel axis instead breaks the 2:4 fit
    w2 = torch.ones(4, 4, 1, 2)
    w2[..., 1] = 0
    assert model_report({"c.weight": w2}).layers[0].fits_2_4 == pytest.approx(0.5)


def test_none_when_the_shape_does_not_fit():
    e = model_report({"w": torch.ones(6, 3)}).layers[0]
    assert e.fits_2_4 is None and e.block_4x1_sparsity is None
    r = model_report({"w": torch.ones(6, 3)})
    assert r.fits_2_4 is None and r.block_4x1_sparsity is None


def _brute(w: torch.Tensor):
    o, i = w.shape
    fits = groups = 0
    for r in range(o):
        for c in range(0, i, 4):
            groups += 1
            fits += int(sum(int(w[r, c + k] != 0) for k in range(4)) <= 2)
    blocks = zero = 0
    for r in range(0, o, 4):
        for c in range(i):
            blocks += 1
            zero += int(all(w[r + k, c] == 0 for k in range(4)))
    return fits / groups, zero / blocks


@settings(max_examples=25, deadline=None)
@given(o=st.sampled_from([4, 8, 12]), i=st.sampled_from([4, 8, 16]), p=st.floats(0.0, 1.0), seed=st.integers(0, 2**16))
def test_pattern_figures_match_a_brute_force_count(o, i, p, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(o, i, generator=g) * (torch.rand(o, i, generator=g) >= p)
    e = model_report({"w": w}).layers[0]
    fits, block = _brute(w)
    assert e.fits_2_4 == pytest.approx(fits)
    assert e.block_4x1_sparsity == pytest.approx(block)
    assert e.nonzero == int((w != 0).sum())
    assert e.zero_channels == int((w == 0).all(dim=1).sum())


def _brute_conv(w: torch.Tensor):
    """2:4 fit and 4x1 block share of a conv weight, counted one kernel position at a time."""
    o, i, kh, kw = w.shape
    fits = groups = blocks = zero = 0
    for y in range(kh):
        for x in range(kw):
            f, z = _brute(w[:, :, y, x])
            groups += o * i // 4
            fits += round(f * (o * i // 4))
            blocks += (o // 4) * i
            zero += round(z * (o // 4) * i)
    return fits / groups, zero / blocks


@settings(max_examples=15, deadline=None)
@given(o=st.sampled_from([4, 8]), i=st.sampled_from([4, 8]), k=st.sampled_from([(1, 1), (2, 3), (3, 3)]),
       p=st.floats(0.0, 1.0), seed=st.integers(0, 2**16))
def test_conv_pattern_figures_match_a_per_kernel_position_count(o, i, k, p, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(o, i, *k, generator=g) * (torch.rand(o, i, *k, generator=g) >= p)
    e = model_report({"w": w}).layers[0]
    fits, block = _brute_conv(w)
    assert e.fits_2_4 == pytest.approx(fits)
    assert e.block_4x1_sparsity == pytest.approx(block)


def test_empty_weights_are_reported_not_crashed_on():
    r = model_report({"a": torch.zeros(0, 4), "b": torch.zeros(4, 0, 3, 3), "c": torch.ones(4, 4)})
    a, b = r.layer("a"), r.layer("b")
    assert (a.numel, a.channels, a.zero_channels, a.sparsity) == (0, 0, 0, 0.0)
    assert (a.fits_2_4, a.block_4x1_sparsity) == (None, None)
    assert (b.numel, b.channels, b.zero_channels, b.fits_2_4) == (0, 4, 4, None)
    # the totals come from the one non-empty weight alone
    assert (r.numel_layers, r.nonzero_layers, r.fits_2_4, r.block_4x1_sparsity) == (16, 16, 0.0, 0.0)


# --------------------------------------------------------------------- the same answer from every source
@pytest.mark.parametrize("mask_dtype", [None, torch.bool])
def test_module_state_dicts_and_compressed_file_agree(tmp_path, mask_dtype):
    m = _cnn()
    prunekit.l1_unstructured(m[0], "weight", amount=0.6, mask_dtype=mask_dtype)
    prunekit.ln_structured(m[2], "weight", amount=0.5, n=2, dim=0, mask_dtype=mask_dtype)
    from_module = model_report(m)
    from_sd = model_report(m.state_dict())
    from prunekit.sparse import save_compressed

    path = tmp_path / "m.safetensors"
    save_compressed(m, path)
    sd, kind = read_checkpoint(path)
    assert kind == "prunekit-compressed"
    from_file = model_report(sd)
    names = ["0.weight", "2.weight", "4.weight"]
    for r in (from_module, from_sd, from_file):
        assert [e.name for e in r.layers] == names
        assert [e.masked for e in r.layers] == [True, True, False]
        assert r.layer("0.weight").nonzero == 8 * 4 * 9 - round(0.6 * 8 * 4 * 9)
        assert r.layer("2.weight").zero_channels == 4
    assert from_module.nonzero_layers == from_sd.nonzero_layers == from_file.nonzero_layers
    # a model's totals are over its parameters; a state dict's include the float buffers (none here)
    assert from_module.numel_all == sum(p.numel() for p in m.parameters())


def test_torch_prune_style_state_dict(tmp_path):
    m = _cnn()
    torch_prune.l1_unstructured(m[4], "weight", amount=0.25)
    path = tmp_path / "torch_pruned.pt"
    torch.save(m.state_dict(), path)
    sd, kind = read_checkpoint(path)
    assert kind == "torch" and "4.weight_orig" in sd
    e = model_report(sd).layer("4.weight")
    assert e.masked and e.sparsity == pytest.approx(round(0.25 * 6 * 128) / (6 * 128))


def test_model_report_rejects_other_things():
    with pytest.raises(TypeError, match="nn.Module or a state dict"):
        model_report([torch.ones(2, 2)])
    with pytest.raises(TypeError, match="'x'.*not a tensor"):
        model_report({"x": 3})


def test_to_dict_is_json_ready():
    import json

    r = model_report(_cnn())
    d = json.loads(json.dumps(r.to_dict()))
    assert d["layers"][0]["shape"] == [8, 4, 3, 3]
    assert d["source"] == "model"


# --------------------------------------------------------------------- reading checkpoints safely
class _Custom:
    def __init__(self):
        self.w = torch.ones(2, 2)


def test_pickles_are_refused_unless_trusted(tmp_path):
    path = tmp_path / "whole_model.pt"
    torch.save(nn.Linear(3, 2), path)
    with pytest.raises(UnsafeCheckpointError, match="trust-pickle"):
        read_checkpoint(path)
    sd, kind = read_checkpoint(path, trust_pickle=True)
    assert list(sd) == ["weight", "bias"] and kind == "torch"


def test_nested_state_dict_and_plain_safetensors(tmp_path):
    from safetensors.torch import save_file

    m = nn.Linear(4, 3)
    torch.save({"state_dict": m.state_dict(), "epoch": 3}, tmp_path / "ckpt.pt")
    assert list(read_checkpoint(tmp_path / "ckpt.pt")[0]) == ["weight", "bias"]
    save_file(m.state_dict(), str(tmp_path / "plain.safetensors"))
    sd, kind = read_checkpoint(tmp_path / "plain.safetensors")
    assert kind == "safetensors" and torch.equal(sd["weight"], m.weight)


def test_missing_and_garbage_files(tmp_path):
    with pytest.raises(FileNotFoundError, match=f"checkpoint file not found: {tmp_path / 'nope.pt'}; give the path"):
        read_checkpoint(tmp_path / "nope.pt")
    with pytest.raises(IsADirectoryError, match="is a directory; give a checkpoint file"):
        read_checkpoint(tmp_path)
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint at all")
    for trust in (False, True):  # trusting a file does not turn garbage into a checkpoint
        with pytest.raises(ValueError) as info:
            read_checkpoint(tmp_path / "junk.pt", trust_pickle=trust)
        assert not isinstance(info.value, UnsafeCheckpointError)
        msg = str(info.value)
        assert msg.startswith(f"{tmp_path / 'junk.pt'}: not a torch checkpoint or a safetensors file (")
        assert msg.endswith("; give a file written by torch.save(model.state_dict(), path), "
                            "safetensors.torch.save_file or prunekit.sparse.save_compressed")
    (tmp_path / "junk.safetensors").write_bytes(b"\x00" * 32)
    with pytest.raises(ValueError, match=r"junk.safetensors: not a readable safetensors file \(.*\); give a file"):
        read_checkpoint(tmp_path / "junk.safetensors")
    torch.save([1, 2], tmp_path / "list.pt")
    with pytest.raises(ValueError, match="holds a list with no tensors; expected a state dict"):
        read_checkpoint(tmp_path / "list.pt")


# --------------------------------------------------------------------- plots
PNG = b"\x89PNG\r\n\x1a\n"


def test_plots_write_pngs(tmp_path):
    m = _cnn()
    prunekit.l1_unstructured(m[0], "weight", amount=0.5)
    p1 = plot_layer_sparsity(model_report(m), tmp_path / "layers.png")
    rows = [{"method": "a", "sparsity": 0.5, "accuracy": 0.9}, {"method": "a", "sparsity": 0.9, "accuracy": 0.8},
            {"method": "b", "sparsity": 0.5, "accuracy": 0.95}]
    p2 = plot_accuracy_vs_sparsity(rows, tmp_path / "acc.png", dense_accuracy=0.97)
    for p in (p1, p2):
        with open(p, "rb") as f:
            assert f.read(8) == PNG
        assert os.path.getsize(p) > 2000
    with pytest.raises(ValueError, match="has no 'accuracy'; give every result 'method', 'sparsity' and 'accuracy'"):
        plot_accuracy_vs_sparsity([{"method": "a", "sparsity": 0.5}], tmp_path / "bad.png")


def test_report_agrees_with_training_patterns():
    from prunekit.training import prepare_pruning

    m = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 8))
    cb = prepare_pruning(m, {"prune_type": "magnitude", "pattern": "2:4", "start_step": 0, "end_step": 0})
    cb.on_step_begin(0)
    cb.on_before_optimizer_step()
    cb.on_after_optimizer_step()
    cb.on_step_end()
    r = model_report(m)
    assert [e.fits_2_4 for e in r.layers] == [1.0, 1.0]
    assert r.sparsity_layers == pytest.approx(0.5)


def test_demo_docstring_examples_run():
    # in a subprocess: prunekit.demo loads scikit-learn (and scipy), kept out of the test process
    import subprocess
    import sys

    code = ("import doctest, importlib, pkgutil, sys, prunekit.demo as d\n"
            "names = ['prunekit.demo'] + sorted(m.name for m in pkgutil.walk_packages(d.__path__, 'prunekit.demo.'))\n"
            "runs = {n: doctest.testmod(importlib.import_module(n)) for n in names}\n"
            "print(names, runs)\n"
            "sys.exit(0 if sum(r.attempted for r in runs.values()) >= 8 and not any(r.failed for r in runs.values())"
            " else 1)")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr


def test_grouped_bars_name_the_missing_field(tmp_path):
    from prunekit.report import plot_grouped_bars

    with pytest.raises(ValueError, match=r"plot_grouped_bars: row .* has no 'cosine'"):
        plot_grouped_bars([{"pattern": "2:4", "method": "magnitude"}], tmp_path / "x.png", group="pattern",
                          series="method", value="cosine", ylabel="mean cosine")
    assert not (tmp_path / "x.png").exists()
