"""Verified distributed checkpoints: integrity manifest, restricted .metadata, all-or-nothing load.

Most tests run in this process without a process group (DCP then saves and
loads as one process). The 2-rank scenarios (tests/helpers/dist_scenarios.py,
``dcp_*``) run in one launch of tests/helpers/dist_harness.py.
"""

import hashlib
import json
import os
import pickle
import random
import shutil

import pytest
import torch
import torch.distributed as dist
from torch import nn

import prunekit
from prunekit.distributed import (
    CorruptDistributedCheckpointError,
    DistributedCheckpointError,
    UnsafeDistributedCheckpointError,
)

pytestmark = pytest.mark.usefixtures("one_thread")

needs_gloo = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")


# ----------------------------------------------------------------- helpers
def _read(path):
    with open(path, "rb") as f:
        return f.read()


def _write(path, data):
    with open(path, "wb") as f:
        f.write(data)


def _model(seed=0):
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))
    prunekit.l1_unstructured(m[0], "weight", 0.5)
    prunekit.l1_unstructured(m[2], "weight", 0.4, mask_dtype=torch.bool)
    return m


def _fresh(seed=1):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))


def _state(model, note=None):
    values = {k: v.detach().clone() for k, v in model.state_dict().items()}
    pruned = [sorted(prunekit.reparam.pruned_names(m)) for m in model.modules()]
    hooks = [len(m._forward_pre_hooks) for m in model.modules()]
    return values, pruned, hooks, None if note is None else {k: (v.clone() if torch.is_tensor(v) else v)
                                                              for k, v in note.items()}


def _same(a, b):
    if list(a[0]) != list(b[0]) or a[1:3] != b[1:3]:
        return False
    if not all(torch.equal(a[0][k], b[0][k]) for k in a[0]):
        return False
    if (a[3] is None) != (b[3] is None):
        return False
    return a[3] is None or (list(a[3]) == list(b[3]) and all(
        torch.equal(x, y) if torch.is_tensor(x) else x == y for x, y in zip(a[3].values(), b[3].values())))


def _forge_manifest(path):
    """Rewrite the manifest to match the files as they are now (what someone crafting a folder would do)."""
    files = {}
    for name in sorted(os.listdir(path)):
        if name != "prunekit-manifest.json":
            data = _read(os.path.join(path, name))
            files[name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    doc = {"format": "prunekit.distributed.checkpoint", "version": 1, "files": files}
    with open(os.path.join(path, "prunekit-manifest.json"), "w") as f:
        json.dump(doc, f)


@pytest.fixture
def saved(tmp_path):
    model = _model()
    path = str(tmp_path / "ckpt")
    prunekit.distributed.save(path, model, note={"step": 3, "lr": torch.tensor([0.5])})
    return path, model


def _load_expect(path, exc, words, seed=1):
    target = _fresh(seed)
    note = {"step": 0, "lr": torch.zeros(1)}
    before = _state(target, note)
    with pytest.raises(exc) as info:
        prunekit.distributed.load(path, target, note=note)
    assert str(info.value).startswith(os.path.realpath(path)), str(info.value)
    assert words in str(info.value), str(info.value)
    assert _same(_state(target, note), before), "a refused load changed the model"
    return info.value


# ----------------------------------------------------------------- round trip
def test_round_trip_without_a_process_group(saved):
    path, model = saved
    assert sorted(os.listdir(path)) == [".metadata", "__0_0.distcp", "prunekit-manifest.json"]
    manifest = json.loads(_read(os.path.join(path, "prunekit-manifest.json")))
    assert sorted(manifest["files"]) == [".metadata", "__0_0.distcp"]
    for name, entry in manifest["files"].items():
        data = _read(os.path.join(path, name))
        assert entry == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    target = _fresh()
    note = {"step": 0, "lr": torch.zeros(1)}
    prunekit.distributed.load(path, target, note=note)
    assert note == {"step": 3, "lr": torch.tensor([0.5])}
    assert target[2].weight_mask.dtype == torch.bool
    for k, v in model.state_dict().items():
        assert torch.equal(target.state_dict()[k], v), k
    x = torch.randn(4, 6)
    assert torch.equal(target(x), model(x))


# ----------------------------------------------------------------- integrity
def test_bit_flip_in_a_shard_is_refused(saved):
    path, model = saved
    shard = os.path.join(path, "__0_0.distcp")
    data = bytearray(_read(shard))
    at = data.find(model[0].weight_orig.detach().numpy().tobytes())  # the tensor's own bytes: DCP reads them as is
    assert at > 0
    data[at + 5] ^= 0x04
    _write(shard, bytes(data))
    _load_expect(path, CorruptDistributedCheckpointError, "__0_0.distcp does not match the manifest")


def test_missing_and_truncated_shard_raise_value_errors(saved):
    path, _ = saved
    shard = os.path.join(path, "__0_0.distcp")
    data = _read(shard)
    with open(shard, "wb") as f:
        f.write(data[:-10])
    err = _load_expect(path, CorruptDistributedCheckpointError, f"has {len(data) - 10} bytes, the manifest says")
    assert isinstance(err, ValueError)
    os.unlink(shard)
    _load_expect(path, CorruptDistributedCheckpointError, "__0_0.distcp is missing")


def test_folder_without_manifest_is_incomplete(saved):
    path, _ = saved
    os.unlink(os.path.join(path, "prunekit-manifest.json"))
    _load_expect(path, DistributedCheckpointError, "incomplete save")


def test_altered_metadata_is_refused_by_the_manifest(saved, tmp_path):
    path, _ = saved
    meta = os.path.join(path, ".metadata")
    data = _read(meta)
    _write(meta, data.replace(b"float32", b"float64"))
    _load_expect(path, CorruptDistributedCheckpointError, ".metadata does not match the manifest")


def test_linked_shard_is_refused(saved, tmp_path):
    path, _ = saved
    shard = os.path.join(path, "__0_0.distcp")
    os.rename(shard, str(tmp_path / "elsewhere"))
    os.symlink(str(tmp_path / "elsewhere"), shard)
    _load_expect(path, CorruptDistributedCheckpointError, "__0_0.distcp is a symbolic link")


# ----------------------------------------------------------------- nothing from the folder runs
class _Run:
    """Pickles to a call of os.system that creates ``marker``."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_crafted_metadata_runs_nothing(saved, tmp_path):
    path, _ = saved
    marker = tmp_path / "ran"
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(_Run(marker), f)
    _forge_manifest(path)  # a crafted folder comes with a manifest that matches it
    _load_expect(path, UnsafeDistributedCheckpointError, "asks for posix.system, which is not one of DCP's")
    assert not marker.exists()


def test_metadata_with_a_crafted_global_inside_runs_nothing(saved, tmp_path):
    path, _ = saved
    marker = tmp_path / "ran"
    import torch.distributed.checkpoint as dcp

    meta = dcp.FileSystemReader(path).read_metadata()  # the real metadata (from our own folder)
    meta.version = _Run(marker)  # one field replaced, deep inside a valid Metadata
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(meta, f)
    _forge_manifest(path)
    _load_expect(path, UnsafeDistributedCheckpointError, "posix.system")
    assert not marker.exists()


def test_entry_that_unpickles_to_code_runs_nothing(tmp_path):
    marker = tmp_path / "ran"
    path = str(tmp_path / "ckpt")
    prunekit.distributed.save(path, _model(), note={"step": _Run(marker)})  # saved as bytes, run when unpickled
    assert not marker.exists()
    target = _fresh()
    before = _state(target)
    with pytest.raises(UnsafeDistributedCheckpointError, match="entry 'note.step' is not plain data"):
        prunekit.distributed.load(path, target, note={"step": 0})
    assert not marker.exists()
    assert _same(_state(target), before)


def test_metadata_pointing_outside_its_shards_is_refused(saved):
    path, _ = saved
    import torch.distributed.checkpoint as dcp

    meta = dcp.FileSystemReader(path).read_metadata()
    for info in meta.storage_data.values():
        info.relative_path = "../../etc/passwd"
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(meta, f)
    _forge_manifest(path)
    _load_expect(path, CorruptDistributedCheckpointError, "which is not a shard the manifest lists")


# ----------------------------------------------------------------- all or nothing
def test_interrupt_while_reading_leaves_the_model_unchanged(saved, monkeypatch):
    path, _ = saved
    real_load, calls = torch.load, []

    def interrupted(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real_load(*args, **kwargs)

    monkeypatch.setattr(torch, "load", interrupted)
    target = _fresh()
    before = _state(target)
    with pytest.raises(KeyboardInterrupt):
        prunekit.distributed.load(path, target, note={"step": 0, "lr": torch.zeros(1)})
    assert len(calls) == 3
    assert _same(_state(target), before)


def test_interrupt_while_applying_leaves_the_model_unchanged(saved, monkeypatch):
    path, _ = saved
    import prunekit.distributed.fsdp as fsdp

    def interrupted(model):
        raise KeyboardInterrupt

    monkeypatch.setattr(fsdp, "remask", interrupted)  # the last step of moving the values into the model
    for target in (_fresh(), _model(seed=2)):
        note = {"step": 0, "lr": torch.zeros(1)}
        before = _state(target, note)
        with pytest.raises(KeyboardInterrupt):
            prunekit.distributed.load(path, target, note=note)
        assert _same(_state(target, note), before)


def _trained(model, seed):
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, foreach=False)  # Adam imports dynamo: seconds
    torch.manual_seed(seed)
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(4, 6)).square().sum().backward()
        opt.step()
    return opt


def _opt_state(opt):
    return [(k, v.clone() if torch.is_tensor(v) else v) for k, v in
            ((f"{i}.{n}", t) for i, st in opt.state_dict()["state"].items() for n, t in st.items())]


def test_optimizer_round_trip_and_undo_after_everything_was_applied(tmp_path, monkeypatch):
    model = _model()
    opt = _trained(model, 0)
    path = str(tmp_path / "ckpt")
    prunekit.distributed.save(path, model, optim=opt, note={"step": 3})
    # an interrupt at the very last step (every rank agreeing that all is applied) puts everything back
    target = _model(seed=4)
    target_opt = _trained(target, 1)
    note = {"step": 0}
    before, opt_before = _state(target, note), _opt_state(target_opt)
    import prunekit.distributed.checkpoint as ckpt

    real_agree, calls = ckpt.agree, []

    def interrupted(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:  # manifest, preparation, commit
            raise KeyboardInterrupt
        return real_agree(*args, **kwargs)

    monkeypatch.setattr(ckpt, "agree", interrupted)
    with pytest.raises(KeyboardInterrupt):
        prunekit.distributed.load(path, target, optim=target_opt, note=note)
    assert len(calls) == 3
    assert _same(_state(target, note), before)
    after = _opt_state(target_opt)
    assert [k for k, _ in after] == [k for k, _ in opt_before]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(after, opt_before))
    monkeypatch.setattr(ckpt, "agree", real_agree)
    prunekit.distributed.load(path, target, optim=target_opt, note=note)
    assert note == {"step": 3} and _same(_state(target), _state(model))
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(_opt_state(target_opt), _opt_state(opt)))


def test_checkpoint_that_does_not_fit_changes_nothing(saved):
    path, _ = saved
    torch.manual_seed(1)
    target = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 4))  # last layer: 4 outputs, not 3
    before = _state(target)
    with pytest.raises(DistributedCheckpointError, match="Size mismatch"):
        prunekit.distributed.load(path, target, note={"step": 0, "lr": torch.zeros(1)})
    assert _same(_state(target), before)


# ----------------------------------------------------------------- saving
def test_failed_save_over_a_checkpoint_keeps_the_old_one(saved):
    path, model = saved
    parent = os.path.dirname(path)
    with pytest.raises(DistributedCheckpointError, match="writing the checkpoint failed"):
        prunekit.distributed.save(path, _fresh(5), note={"step": lambda: 0})  # a lambda cannot be pickled
    assert sorted(os.listdir(parent)) == ["ckpt"]  # no temporary folder left
    target = _fresh()
    note = {"step": 0, "lr": torch.zeros(1)}
    prunekit.distributed.load(path, target, note=note)
    assert note["step"] == 3 and all(torch.equal(target.state_dict()[k], v) for k, v in model.state_dict().items())


def test_save_never_replaces_a_folder_with_other_files(tmp_path):
    path = tmp_path / "mine"
    path.mkdir()
    (path / "notes.txt").write_text("keep me")
    with pytest.raises(DistributedCheckpointError, match="holds 'notes.txt', which is not a checkpoint file"):
        prunekit.distributed.save(str(path), _model())
    assert os.listdir(path) == ["notes.txt"] and sorted(os.listdir(tmp_path)) == ["mine"]


def test_save_creates_missing_parents_and_removes_them_on_failure(tmp_path):
    path = tmp_path / "a" / "b" / "ckpt"
    with pytest.raises(DistributedCheckpointError):
        prunekit.distributed.save(str(path), _model(), note={"step": lambda: 0})
    assert os.listdir(tmp_path) == []
    prunekit.distributed.save(str(path), _model())
    assert sorted(os.listdir(path)) == [".metadata", "__0_0.distcp", "prunekit-manifest.json"]


# ----------------------------------------------------------------- hostile folders, fuzzed
def _mutate(rng, path, names):
    name = rng.choice(names)
    p = os.path.join(path, name)
    data = bytearray(_read(p))
    kind = rng.choice(["flip", "byte", "truncate", "append", "zero-run", "delete"])
    if kind == "delete":
        os.unlink(p)
        names.remove(name)
        return f"{kind} {name}"
    if kind == "flip" and data:
        i = rng.randrange(len(data))
        data[i] ^= 1 << rng.randrange(8)
    elif kind == "byte" and data:
        data[rng.randrange(len(data))] = rng.randrange(256)
    elif kind == "truncate":
        data = data[: rng.randrange(len(data) + 1)]
    elif kind == "append":
        data += bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64)))
    elif data:
        i = rng.randrange(len(data))
        data[i:i + 16] = bytes(len(data[i:i + 16]))
    _write(p, bytes(data))
    return f"{kind} {name}"


def _fuzz(tmp_path, seeds, forge):
    model = _model()
    clean = str(tmp_path / "clean")
    prunekit.distributed.save(clean, model, note={"step": 3, "lr": torch.tensor([0.5])})
    reference = _fresh()
    note = {"step": 0, "lr": torch.zeros(1)}
    prunekit.distributed.load(clean, reference, note=note)
    expected = _state(reference, note)
    outcomes = {"loaded": 0, "refused": 0}
    for seed in seeds:
        rng = random.Random(seed)
        path = str(tmp_path / f"case{seed}")
        shutil.copytree(clean, path)
        names = sorted(os.listdir(path))
        if forge:
            names.remove("prunekit-manifest.json")
        done = [_mutate(rng, path, names) for _ in range(rng.choice([1, 1, 2]))]
        if forge:
            _forge_manifest(path)
        target = _fresh()
        note = {"step": 0, "lr": torch.zeros(1)}
        before = _state(target, note)
        try:
            prunekit.distributed.load(path, target, note=note)
        except DistributedCheckpointError as e:
            assert str(e).startswith(os.path.realpath(path)), (seed, done, str(e))
            assert _same(_state(target, note), before), (seed, done, "a refused load changed the model")
            outcomes["refused"] += 1
        else:
            if not forge:  # the manifest holds: what loads is exactly what was saved
                assert _same(_state(target, note), expected), (seed, done, "a damaged checkpoint loaded changed")
            outcomes["loaded"] += 1
        shutil.rmtree(path)
    return outcomes


def test_fuzzed_folders_load_identically_or_are_refused(tmp_path):
    out = _fuzz(tmp_path, range(30), forge=False)
    assert out["refused"] >= 25, out  # only a change to the manifest's layout (whitespace) can still load


def test_fuzzed_folders_with_forged_manifests_never_escape(tmp_path):
    out = _fuzz(tmp_path, range(100, 124), forge=True)
    assert out["refused"] > 0, out


# ----------------------------------------------------------------- two processes
_SCENARIOS = ["dcp_verified_round_trip", "dcp_damaged_shard", "dcp_one_rank_fails"]
_RESULTS = {}


@needs_gloo
@pytest.mark.parametrize("scenario", _SCENARIOS)
def test_two_ranks(scenario):
    from helpers.dist_harness import run_world

    if not _RESULTS:
        _RESULTS.update(run_world(2, _SCENARIOS))
    failed = {r: v for r, v in _RESULTS[scenario].items() if v != "ok"}
    assert not failed, "\n".join(f"--- rank {r} ---\n{v}" for r, v in sorted(failed.items()))
