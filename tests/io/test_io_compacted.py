"""Compacted-model files: written atomically, read as hostile input, loaded all-or-nothing."""

import pytest
import torch
from torch import nn

from prunekit.compact import compact, compaction_description, load_compacted, prune_groups, save_compacted
from prunekit.io import UnreadableFileError
from prunekit.io.compacted import read_compacted


def _make():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


@pytest.fixture
def small():
    m = _make()
    x = torch.randn(2, 8)
    prune_groups(m, x, 0.5)
    return compact(m, x), x


def _state(model):
    return ([(n, type(m)) for n, m in model.named_modules()],
            {k: v.clone() for k, v in model.state_dict().items()})


def _same(a, b):
    return a[0] == b[0] and a[1].keys() == b[1].keys() and all(torch.equal(a[1][k], b[1][k]) for k in a[1])


def test_round_trip_through_the_file(tmp_path, small):
    model, x = small
    path = tmp_path / "small.pt"
    save_compacted(model, str(path))
    sd, desc = read_compacted(str(path))
    again = load_compacted(_make(), sd, desc)
    assert torch.equal(again(x), model(x))


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
    with pytest.raises(KeyboardInterrupt if fault == "interrupt" else (RuntimeError, ValueError)):
        load_compacted(fresh, sd, desc)
    assert _same(_state(fresh), before)
    assert fresh[0].weight.shape == (16, 8)


@pytest.mark.parametrize("bad", [
    {"format": "other"},
    {"format": "prunekit.compact/1", "modules": []},
    {"format": "prunekit.compact/1", "modules": {"0": {"class": ["os", "system"]}}},
    {"format": "prunekit.compact/1", "modules": {"0": {"tensors": {"weight": [2 ** 50]}}}},
    {"format": "prunekit.compact/1", "modules": {"0": {"attrs": {"x": {"nested": 1}}}}},
    {"format": "prunekit.compact/1", "modules": {"0": {"init": {"x": torch.ones(1)}}}},
    {"format": "prunekit.compact/1", "modules": {"0": {"unexpected": 1}}},
])
def test_hostile_descriptions_are_refused_naming_the_file(tmp_path, bad):
    path = str(tmp_path / "x.pt")
    torch.save({"state_dict": {}, "description": bad}, path)
    with pytest.raises(UnreadableFileError, match="^" + str(tmp_path)):
        read_compacted(path)


def test_non_files_and_other_files_are_refused(tmp_path):
    with pytest.raises(UnreadableFileError, match="not a regular file"):
        read_compacted(str(tmp_path))
    path = str(tmp_path / "sd.pt")
    torch.save({"w": torch.ones(1)}, path)
    with pytest.raises(UnreadableFileError, match="not a compacted model file"):
        read_compacted(path)
    (tmp_path / "junk.pt").write_bytes(b"junk")
    with pytest.raises(UnreadableFileError, match="not a compacted model file"):
        read_compacted(str(tmp_path / "junk.pt"))
