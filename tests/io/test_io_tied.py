"""Tied tensors in prunekit's files: stored once, loaded as one tensor, hostile aliases refused."""

import json

import pytest
import torch

pytest.importorskip("safetensors")
from safetensors.torch import save_file  # noqa: E402

from prunekit.io import CorruptCheckpointError, UnreadableFileError, load_compressed, save_compressed  # noqa: E402
from prunekit.io.checkpoint import read_plain_safetensors  # noqa: E402
from prunekit.io.layers import tied_aliases  # noqa: E402
from prunekit.io.plain import TIED_KEY, write_safetensors  # noqa: E402
from test_io_hostile import _index, _load_bytes, _with_index  # noqa: E402


class _LM(torch.nn.Module):
    """An embedding and a head tied to it, the head first in the state dict, as transformers names it."""

    all_tied_weights_keys = {"head.weight": "emb.weight"}

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.head = torch.nn.Linear(8, 16, bias=False)
        self.emb = torch.nn.Embedding(16, 8)
        self.head.weight = self.emb.weight
        self.other = torch.nn.Linear(8, 8)


def test_the_tie_is_stored_once_under_the_name_transformers_keeps(tmp_path):
    model = _LM()
    path = str(tmp_path / "m.safetensors")
    save_compressed(model, path)
    data = open(path, "rb").read()
    entries = _index(data)["tensors"]
    assert [e["name"] for e in entries] == ["head.weight", "emb.weight", "other.weight", "other.bias"]
    assert entries[0] == {"name": "head.weight", "encoding": "alias", "of": "emb.weight"}
    sd = load_compressed(path)
    assert list(sd) == list(model.state_dict()) and sd["head.weight"] is sd["emb.weight"]
    assert torch.equal(sd["emb.weight"], model.emb.weight)
    fresh = _LM()
    with torch.no_grad():
        fresh.emb.weight.zero_()
    fresh.load_state_dict(sd)
    assert fresh.head.weight is fresh.emb.weight and torch.equal(fresh.head.weight, model.emb.weight)
    # a state dict without its module: the first name of the tie is kept
    assert dict(tied_aliases(model.state_dict())) == {"emb.weight": "head.weight"}
    # no tie once drop_masked_values gives one side values of its own
    assert list(tied_aliases({"a": torch.ones(2), "b": torch.ones(2)})) == []


def test_overlapping_views_are_not_ties():
    base = torch.arange(8.0)
    assert not tied_aliases({"a": base[:4], "b": base[:6], "c": base[1:5], "d": base.view(2, 4)})
    assert dict(tied_aliases({"a": base[:4], "b": base[:4]})) == {"b": "a"}


def test_crafted_aliases_are_refused(tmp_path):
    path = str(tmp_path / "m.safetensors")
    save_compressed(_LM(), path)
    data = open(path, "rb").read()
    cases = [
        ({"name": "head.weight", "encoding": "alias", "of": "nope"}, "alias of 'nope', which the index does not list"),
        ({"name": "head.weight", "encoding": "alias", "of": "head.weight"}, "it must name another tensor"),
        ({"name": "head.weight", "encoding": "alias", "of": 3}, "it must name another tensor"),
        ({"name": "head.weight", "encoding": "alias", "of": "emb.weight", "dtype": "float32"}, "index entry has keys"),
    ]
    for entry, message in cases:
        idx = _index(data)
        idx["tensors"][0] = entry
        with pytest.raises(CorruptCheckpointError, match=message):
            _load_bytes(path, _with_index(data, idx))
    idx = _index(data)
    idx["tensors"].append({"name": "x", "encoding": "alias", "of": "head.weight"})
    with pytest.raises(CorruptCheckpointError, match="'x' is an alias of 'head.weight', which the index lists as an "
                                                     "alias too"):
        _load_bytes(path, _with_index(data, idx))


def test_plain_safetensors_ties(tmp_path):
    model = _LM()
    path = str(tmp_path / "p.safetensors")
    write_safetensors(model, path)
    sd = read_plain_safetensors(path)
    assert sorted(sd) == sorted(model.state_dict()) and sd["head.weight"] is sd["emb.weight"]
    with pytest.raises(ValueError, match="is the entry that lists the tied tensors"):
        write_safetensors(model, str(tmp_path / "q.safetensors"), metadata={TIED_KEY: "{}"})
    t = {"a": torch.ones(2), "b": torch.zeros(2)}
    for meta, message in (("[1]", "must be a JSON object of names"), ('{"b": "a"}', "ties 'b' to 'a'; the file "
                          "stores 'b' itself"), ('{"c": "z"}', "has no tensor 'z'"), ('{"c": "a", "c": "b"}',
                          "duplicate")):
        bad = str(tmp_path / "bad.safetensors")
        save_file(t, bad, metadata={TIED_KEY: meta})
        with pytest.raises(UnreadableFileError, match=message):
            read_plain_safetensors(bad)
    save_file(t, bad, metadata={TIED_KEY: json.dumps({"c": "a"})})
    sd = read_plain_safetensors(bad)
    assert list(sd) == ["a", "b", "c"] and sd["c"] is sd["a"]


def test_the_streaming_writer_records_ties_as_the_whole_file_writer_does(tmp_path):
    from prunekit.io.compressed import CompressedWriter

    model = _LM()
    sd = model.state_dict()
    whole, streamed = str(tmp_path / "a.safetensors"), str(tmp_path / "b.safetensors")
    save_compressed(model, whole)
    with CompressedWriter(streamed) as out:
        out.add("emb.weight", sd["emb.weight"])
        with pytest.raises(ValueError, match="add 'nope' first"):
            out.alias("head.weight", "nope")
        out.alias("head.weight", "emb.weight")
        with pytest.raises(ValueError, match="'head.weight' is already added"):
            out.alias("head.weight", "emb.weight")
        out.add("other.weight", sd["other.weight"])
        out.add("other.bias", sd["other.bias"])
    a, b = load_compressed(whole), load_compressed(streamed)
    assert sorted(a) == sorted(b) and b["head.weight"] is b["emb.weight"]
    assert all(torch.equal(a[k], b[k]) for k in a)
