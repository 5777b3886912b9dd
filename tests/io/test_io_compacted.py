"""Compacted-model files: sealed with a checksum, read as hostile input, rebuilt only as compaction would, all-or-nothing."""

import copy
import hashlib
import io
import os
import random
import zipfile

import pytest
import torch
from torch import nn

from prunekit.compact import (
    compact,
    compaction_description,
    load_compacted,
    prune_groups,
    rebuild_from_description,
    save_compacted,
)
from prunekit.io import UnreadableFileError
from prunekit.io.compacted import CompactedModelError, read_compacted, write_compacted


def _make():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _make_cnn():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3), nn.ReLU(),
                         nn.Flatten(), nn.Linear(8 * 4 * 4, 4)).eval()


class _Attn(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(16, 4, batch_first=True)
        self.out = nn.Linear(16, 4)

    def forward(self, x):
        return self.out(self.attn(x, x, x, need_weights=False)[0])


def _make_attn():
    torch.manual_seed(0)
    return _Attn().eval()


@pytest.fixture
def small():
    m = _make()
    x = torch.randn(2, 8)
    prune_groups(m, x, 0.5)
    return compact(m, x), x


@pytest.fixture(scope="module")
def cnn():
    m = _make_cnn()
    x = torch.randn(2, 3, 8, 8)
    prune_groups(m, x, 0.5)
    return compact(m, x).eval(), x


def _seal(raw: bytes) -> bytes:
    """A torch.save archive sealed as prunekit does: SHA-256 of all bytes before the zip comment's length."""
    assert raw[-22:-18] == b"PK\x05\x06" and raw[-2:] == b"\x00\x00"
    comment = b"prunekit-sha256:" + hashlib.sha256(raw[:-2]).hexdigest().encode()
    return raw[:-2] + len(comment).to_bytes(2, "little") + comment


def _save_sealed(obj, path):
    buf = io.BytesIO()
    torch.save(obj, buf)
    with open(path, "wb") as f:
        f.write(_seal(buf.getvalue()))


def _state(model):
    return ([(n, type(m)) for n, m in model.named_modules()],
            {k: v.clone() for k, v in model.state_dict().items()},
            {n: dict(vars(m)) for n, m in model.named_modules()})


def _same(a, b):
    plain = lambda d: {n: {k: v for k, v in attrs.items() if not k.startswith("_") or k == "_prunekit_compaction"}  # noqa: E731
                       for n, attrs in d.items()}
    return (a[0] == b[0] and a[1].keys() == b[1].keys() and all(torch.equal(a[1][k], b[1][k]) for k in a[1])
            and plain(a[2]) == plain(b[2]))


# ----------------------------------------------------------------------------- round trips
def test_round_trip_through_the_file(tmp_path, small):
    model, x = small
    path = tmp_path / "small.pt"
    save_compacted(model, str(path))
    sd, desc = read_compacted(str(path))
    assert torch.equal(load_compacted(_make(), sd, desc)(x), model(x))
    assert torch.equal(load_compacted(_make(), path)(x), model(x))
    assert torch.equal(torch.load(path, weights_only=True)["state_dict"]["0.weight"], model[0].weight)  # plain torch


def test_round_trip_with_masks_and_a_replaced_attention(tmp_path):
    m, x = _make_attn(), torch.randn(2, 5, 16)
    prune_groups(m, x, 0.5)
    small = compact(m, x).eval()
    # unstructured masks on what stays are kept as masks, saved as name_orig/name_mask
    import prunekit
    prunekit.l1_unstructured(small.out, "weight", 0.25)
    save_compacted(small, tmp_path / "a.pt")
    again = load_compacted(_make_attn(), tmp_path / "a.pt").eval()
    assert type(again.attn).__name__ == "PrunedMultiheadAttention" and again.attn.num_heads == 2
    assert prunekit.is_pruned(again.out) and torch.equal(again.out.weight_mask, small.out.weight_mask)
    with torch.no_grad():
        assert torch.equal(again(x), small(x))


# ----------------------------------------------------------------------------- the checksum
def test_every_one_bit_flip_is_refused_naming_the_file(tmp_path, cnn):
    model, _ = cnn
    path = tmp_path / "small.pt"
    save_compacted(model, path)
    raw = path.read_bytes()
    rng = random.Random(0)
    for i in range(200):
        b = bytearray(raw)
        pos = rng.randrange(len(b))
        b[pos] ^= 1 << rng.randrange(8)
        bad = tmp_path / "flipped.pt"
        bad.write_bytes(bytes(b))
        fresh = _make_cnn()
        with pytest.raises(CompactedModelError, match="^" + str(bad) + ": damaged") as e:
            load_compacted(fresh, bad)
        assert "checksum" in str(e.value) or "sealed" in str(e.value), (i, pos, str(e.value))


@pytest.mark.parametrize("cut", [1, 2, 50, 81, 82, 83, 104, 105, 2000])
def test_a_truncated_file_is_refused(tmp_path, small, cut):
    model, _ = small
    path = tmp_path / "small.pt"
    save_compacted(model, path)
    raw = path.read_bytes()
    path.write_bytes(raw[: len(raw) - cut])
    with pytest.raises(CompactedModelError, match="^" + str(path) + ": damaged"):
        read_compacted(path)


def test_a_file_without_a_checksum_is_refused_unless_asked(tmp_path, small, caplog):
    model, x = small
    path = tmp_path / "old.pt"
    torch.save({"state_dict": model.state_dict(), "description": compaction_description(model)}, path)  # no seal
    with pytest.raises(CompactedModelError, match="has no prunekit checksum .* require_checksum=False"):
        read_compacted(path)
    with pytest.raises(CompactedModelError, match="has no prunekit checksum"):
        load_compacted(_make(), path)
    with caplog.at_level("WARNING", logger="prunekit.io.compacted"):
        again = load_compacted(_make(), path, require_checksum=False)
    assert torch.equal(again(x), model(x)) and "without a checksum" in caplog.text
    # saved again, it is sealed
    write_compacted(*read_compacted(path, require_checksum=False), tmp_path / "new.pt")
    assert torch.equal(load_compacted(_make(), tmp_path / "new.pt")(x), model(x))


def test_an_archive_with_a_compressed_record_is_refused_before_torch_reads_it(tmp_path, small):
    model, _ = small
    buf = io.BytesIO()
    torch.save({"state_dict": model.state_dict(), "description": compaction_description(model)}, buf)
    src = zipfile.ZipFile(io.BytesIO(buf.getvalue()))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as dst:
        for info in src.infolist():
            dst.writestr(info.filename, src.read(info.filename),
                         zipfile.ZIP_DEFLATED if info.filename.endswith("data/0") else zipfile.ZIP_STORED)
    path = tmp_path / "deflated.pt"
    path.write_bytes(_seal(out.getvalue()))
    with pytest.raises(CompactedModelError, match="^" + str(path) + r": record '.*data/0' is compressed"):
        read_compacted(path)


# ----------------------------------------------------------------------------- sizes before allocation
def _no_big_allocations(monkeypatch, limit=10 ** 6):
    for name in ("zeros", "empty"):
        real = getattr(torch, name)

        def spy(*size, _real=real, **kw):
            dims = size[0] if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)) else size
            n = 1
            for d in dims:
                n *= int(d)
            if n > limit:
                raise AssertionError(f"allocation of {n} elements asked for by a description")
            return _real(*size, **kw)

        monkeypatch.setattr(torch, name, spy)


def test_sizes_are_checked_against_the_state_dict_before_anything_is_allocated(tmp_path, small, monkeypatch):
    model, _ = small
    desc = compaction_description(model)
    desc["modules"]["0"]["tensors"]["weight"] = [2 ** 20, 2 ** 20]
    path = tmp_path / "big.pt"
    _save_sealed({"state_dict": model.state_dict(), "description": desc}, path)
    assert path.stat().st_size < 5000
    _no_big_allocations(monkeypatch)
    fresh = _make()
    before = _state(fresh)
    with pytest.raises(CompactedModelError, match=r"^" + str(path) + r": description: module '0' tensor 'weight': "
                       r"the description says \[1048576, 1048576\], the state dict holds \[8, 8\]"):
        load_compacted(fresh, path)
    with pytest.raises(CompactedModelError, match="the description says"):
        load_compacted(fresh, model.state_dict(), desc)
    assert _same(_state(fresh), before)


def test_sizes_larger_than_the_model_are_refused_even_when_the_state_dict_agrees(tmp_path, small, monkeypatch):
    # a stride-0 tensor: a 2**40-element "weight" in a file of a few KB; description and state dict agree
    model, _ = small
    desc = compaction_description(model)
    desc["modules"]["0"]["tensors"]["weight"] = [2 ** 20, 2 ** 20]
    sd = dict(model.state_dict())
    sd["0.weight"] = torch.zeros(1).expand(2 ** 20, 2 ** 20)
    path = tmp_path / "big.pt"
    _save_sealed({"state_dict": sd, "description": desc}, path)
    assert path.stat().st_size < 5000
    _no_big_allocations(monkeypatch)
    fresh = _make()
    before = _state(fresh)
    with pytest.raises(CompactedModelError, match=r"module '0': tensor 'weight' is \[16, 8\]: compaction only shrinks"):
        load_compacted(fresh, path)
    assert _same(_state(fresh), before)


# ----------------------------------------------------------------------------- what a description may set
def _edit(desc, fn):
    desc = copy.deepcopy(desc)
    fn(desc)
    return desc


CNN_EDITS = {
    "eps on a BatchNorm": (lambda d: d["modules"]["1"]["attrs"].update(eps=1000.0),
                           r"module '1': attribute 'eps' is not one compaction sets on a BatchNorm2d \(it sets "
                           r"\['num_features'\]\)"),
    "forward": (lambda d: d["modules"]["1"]["attrs"].update(forward=1), "attribute 'forward' is not one"),
    "__class__": (lambda d: d["modules"]["0"]["attrs"].update(__class__="Linear"), "attribute '__class__' is not one"),
    "in/out not the weight's": (lambda d: d["modules"]["6"]["attrs"].update(in_features=63),
                                r"attribute 'in_features' would be 63, and the tensors' new shapes make it 64"),
    "attrs left out": (lambda d: d["modules"]["6"].pop("attrs"),
                       r"attribute 'in_features' would be 128, and the tensors' new shapes make it 64"),
    "larger than now": (lambda d: d["modules"]["3"]["attrs"].update(out_channels=9),
                        r"attribute 'out_channels' is 8 and compaction only shrinks it: give an int in \[0, 8\]"),
    "a float size": (lambda d: d["modules"]["1"]["attrs"].update(num_features=4.0), "give an int in"),
    "a bool size": (lambda d: d["modules"]["1"]["attrs"].update(num_features=True), "give an int in"),
    "a kernel axis": (lambda d: d["modules"]["3"]["tensors"].update(weight=[4, 4, 3, 1]),
                      r"compaction only shrinks axes \[0, 1\] of it"),
    "a tensor it never slices": (lambda d: d["modules"]["1"]["tensors"].update(num_batches_tracked=[]),
                                 "tensor 'num_batches_tracked': compaction never changes it"),
    "bias and weight disagree": (lambda d: d["modules"]["0"]["tensors"].update(bias=[3]),
                                 "tensor 'bias' has 3 along axis 0; the module's other tensors say 4"),
    "a class for a conv": (lambda d: d["modules"]["0"].update({"class": "PrunedMultiheadAttention", "init": {}}),
                           "PrunedMultiheadAttention replaces an MultiheadAttention"),
    "a class not allowed": (lambda d: d["modules"]["0"].update({"class": "Linear"}),
                            "class 'Linear' is not one compaction puts in a model"),
    "init without class": (lambda d: d["modules"]["0"].update({"init": {"x": 1}}), "'init' is given without 'class'"),
    "unknown module": (lambda d: d["modules"].update({"9": {"attrs": {}}}), "the description names module '9'"),
}


@pytest.mark.parametrize("edit", list(CNN_EDITS), ids=list(CNN_EDITS))
def test_a_description_sets_only_what_compaction_sets(cnn, edit):
    model, _ = cnn
    fn, message = CNN_EDITS[edit]
    desc = _edit(compaction_description(model), fn)
    fresh = _make_cnn()
    before = _state(fresh)
    with pytest.raises(CompactedModelError, match=message):
        load_compacted(fresh, model.state_dict(), desc)
    with pytest.raises(CompactedModelError, match=message):
        rebuild_from_description(fresh, desc)
    assert _same(_state(fresh), before)


ATTN_EDITS = {
    "more heads": (lambda e: e["init"].update(num_heads=5), r"init 'num_heads' must be an int in \[0, 4\]"),
    "dropout": (lambda e: e["init"].update(dropout=0.5), "init 'dropout' must be 0.0"),
    "head size": (lambda e: e["init"].update(head_dim=8), "init 'head_dim' must be 4"),
    "unknown argument": (lambda e: e["init"].update(device="cuda"), r"unknown \['device'\]"),
    "shapes not the init's": (lambda e: e["tensors"].update(in_proj_weight=[12, 16]),
                              r"tensor 'in_proj_weight': the description says \[12, 16\], its init builds \[24, 16\]"),
    "an attribute": (lambda e: e["attrs"].update(num_heads=1), "attribute 'num_heads' is not one compaction sets"),
}


@pytest.mark.parametrize("edit", list(ATTN_EDITS), ids=list(ATTN_EDITS))
def test_a_replacement_is_built_only_within_the_original_sizes(edit):
    m, x = _make_attn(), torch.randn(2, 5, 16)
    prune_groups(m, x, 0.5)
    small = compact(m, x)
    fn, message = ATTN_EDITS[edit]
    desc = compaction_description(small)
    fn(desc["modules"]["attn"])
    fresh = _make_attn()
    before = _state(fresh)
    with pytest.raises(CompactedModelError, match=message):
        load_compacted(fresh, small.state_dict(), desc)
    assert _same(_state(fresh), before)


# ----------------------------------------------------------------------------- all or nothing
@pytest.mark.parametrize("fault", ["missing key", "wrong shape", "interrupt", "bad description"])
def test_a_failed_load_leaves_the_model_exactly_as_it_was(small, monkeypatch, fault):
    model, _ = small
    sd, desc = dict(model.state_dict()), compaction_description(model)
    fresh = _make()
    before = _state(fresh)
    if fault == "missing key":
        sd.pop(next(iter(sd)))
    elif fault == "wrong shape":
        sd[next(iter(sd))] = torch.zeros(3, 3)
    elif fault == "bad description":
        desc["modules"]["0"]["tensors"]["weight"] = [-1, 8]
    else:
        def interrupted(self, *a, **k):
            raise KeyboardInterrupt

        monkeypatch.setattr(nn.Module, "load_state_dict", interrupted)
    with pytest.raises(KeyboardInterrupt if fault == "interrupt" else CompactedModelError):
        load_compacted(fresh, sd, desc)
    assert _same(_state(fresh), before)
    assert fresh[0].weight.shape == (16, 8)


def test_a_bad_later_entry_leaves_earlier_modules_as_they_were(cnn):
    model, _ = cnn
    desc = compaction_description(model)
    desc["modules"]["6"]["tensors"]["nope"] = [1]  # the last entry; '0', '1' and '3' come first
    fresh = _make_cnn()
    before = _state(fresh)
    with pytest.raises(CompactedModelError, match="module '6': Linear has no parameter or buffer 'nope'"):
        rebuild_from_description(fresh, desc)
    assert _same(_state(fresh), before) and fresh[0].weight.shape == (8, 3, 3, 3)


@pytest.mark.parametrize("at", [1, 3, 6])
def test_an_interrupt_while_rebuilding_leaves_the_model_as_it_was(cnn, monkeypatch, at):
    model, _ = cnn
    desc = compaction_description(model)
    fresh = _make_cnn()
    before = _state(fresh)
    calls = []
    real = torch.zeros

    def interrupted(*a, **k):
        calls.append(a)
        if len(calls) == at:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(torch, "zeros", interrupted)
    with pytest.raises(KeyboardInterrupt):
        rebuild_from_description(fresh, desc)
    assert len(calls) == at and _same(_state(fresh), before)


def test_loading_holds_no_second_copy_of_the_model(small, monkeypatch):
    model, x = small
    real = copy.deepcopy

    def no_module_copies(obj, *a, **k):
        assert not isinstance(obj, nn.Module), "load_compacted copied the model"
        return real(obj, *a, **k)

    monkeypatch.setattr(copy, "deepcopy", no_module_copies)
    fresh = _make()
    assert load_compacted(fresh, model.state_dict(), compaction_description(model)) is fresh
    assert torch.equal(fresh(x), model(x))


# ----------------------------------------------------------------------------- hostile files
@pytest.mark.parametrize("bad", [
    {"format": "other"},
    {"format": "prunekit.compact/1", "modules": []},
    {"format": "prunekit.compact/1", "modules": {}, "surprise": 1},
    {"format": "prunekit.compact/1", "modules": {"0": {"class": ["os", "system"]}}},
    {"format": "prunekit.compact/1", "modules": {"0": {"tensors": {"weight": [2 ** 50]}}}},
    {"format": "prunekit.compact/1", "modules": {"0": {"tensors": {"weight": [2 ** 30, 2 ** 30]}}}},
    {"format": "prunekit.compact/1", "modules": {"0": {"attrs": {"x": {"nested": 1}}}}},
    {"format": "prunekit.compact/1", "modules": {"0": {"attrs": {"x": float("nan")}}}},
    {"format": "prunekit.compact/1", "modules": {"0": {"init": {"x": torch.ones(1)}}}},
    {"format": "prunekit.compact/1", "modules": {"0": {"unexpected": 1}}},
])
def test_hostile_descriptions_are_refused_naming_the_file(tmp_path, bad):
    path = str(tmp_path / "x.pt")
    _save_sealed({"state_dict": {}, "description": bad}, path)
    with pytest.raises(CompactedModelError, match="^" + str(tmp_path)):
        read_compacted(path)


def test_non_files_and_other_files_are_refused(tmp_path):
    with pytest.raises(UnreadableFileError, match="not a regular file"):
        read_compacted(str(tmp_path))
    path = str(tmp_path / "sd.pt")
    _save_sealed({"w": torch.ones(1)}, path)
    with pytest.raises(CompactedModelError, match="not a compacted model file"):
        read_compacted(path)
    (tmp_path / "junk.pt").write_bytes(b"junk")
    with pytest.raises(CompactedModelError, match="not a compacted model file"):
        read_compacted(str(tmp_path / "junk.pt"))
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    with pytest.raises(UnreadableFileError, match="not a regular file"):
        load_compacted(_make(), fifo)
