"""The one atomic writer behaves like a careful torch.save."""

import errno
import json
import os
import stat

import pytest
import torch

pytest.importorskip("safetensors")

from prunekit.io import atomic_path, atomic_write, save_compressed, write_json, write_text, write_with  # noqa: E402
from prunekit.io import folders as folders_mod  # noqa: E402
from prunekit.io import writer as writer_mod  # noqa: E402


@pytest.fixture
def umask():
    """Set the process umask for one test, and put the old one back."""
    old = os.umask(0o022)
    os.umask(old)
    yield lambda m: os.umask(m)
    os.umask(old)


def _mode(path):
    return stat.S_IMODE(os.stat(path).st_mode)


def _compacted(path):
    from torch import nn

    from prunekit.compact import compact, prune_groups, save_compacted

    m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    x = torch.randn(2, 8)
    prune_groups(m, x, 0.5)
    save_compacted(compact(m, x), path)


def _plot(path):
    pytest.importorskip("matplotlib")
    from prunekit.report import plot_accuracy_vs_sparsity

    plot_accuracy_vs_sparsity([{"method": "m", "sparsity": 0.5, "accuracy": 0.9}], path)


# every writer prunekit has, each writing one file at a path
WRITERS = {
    "save_compressed": lambda p: save_compressed({"w": torch.zeros(64)}, p),
    "save_compressed(safetensors)": lambda p: save_compressed({"w": torch.zeros(64)}, p, format="safetensors"),
    "write_json": lambda p: write_json(p, {"a": 1}),
    "write_text": lambda p: write_text(p, "x"),
    "write_with(torch.save)": lambda p: write_with(p, lambda f: torch.save({"w": torch.ones(1)}, f)),
    "save_compacted": _compacted,
    "plot": _plot,
}
EXT = {"plot": ".png", "write_json": ".json", "write_text": ".txt"}


def _name(kind):
    return "out" + EXT.get(kind, ".bin")


@pytest.mark.parametrize("kind", sorted(WRITERS))
@pytest.mark.parametrize("mask", [0o022, 0o077, 0o002])
def test_permissions_are_what_the_umask_gives_like_torch_save(tmp_path, umask, kind, mask):
    umask(mask)
    ref = tmp_path / "torch.pt"
    torch.save({"w": torch.ones(1)}, ref)
    path = tmp_path / _name(kind)
    WRITERS[kind](str(path))
    assert _mode(path) == _mode(ref) == 0o666 & ~mask


@pytest.mark.parametrize("kind", sorted(WRITERS))
def test_an_existing_file_keeps_its_mode(tmp_path, umask, kind):
    umask(0o022)
    path = tmp_path / _name(kind)
    path.write_bytes(b"old")
    os.chmod(path, 0o640)
    WRITERS[kind](str(path))
    assert _mode(path) == 0o640 and path.read_bytes() != b"old"


@pytest.mark.parametrize("kind", sorted(WRITERS))
def test_a_symlink_is_followed_and_kept(tmp_path, kind):
    real = tmp_path / "real" / _name(kind)
    real.parent.mkdir()
    real.write_bytes(b"old")
    link = tmp_path / ("link" + os.path.splitext(_name(kind))[1])
    os.symlink(os.path.join("real", _name(kind)), link)  # relative, as people make them
    WRITERS[kind](str(link))
    assert os.path.islink(link)
    assert real.read_bytes() != b"old"
    assert sorted(os.listdir(tmp_path)) == sorted(["real", link.name])
    assert os.listdir(real.parent) == [real.name]


def test_a_dangling_symlink_gets_its_target_created(tmp_path):
    link = tmp_path / "link.json"
    os.symlink("target.json", link)
    write_json(str(link), {"a": 1})
    assert os.path.islink(link) and json.loads((tmp_path / "target.json").read_text()) == {"a": 1}


def test_data_is_fsynced_before_the_rename_and_the_directory_after(tmp_path, monkeypatch):
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        st = os.fstat(fd)
        events.append(("fsync-dir" if stat.S_ISDIR(st.st_mode) else "fsync-file", st.st_size))
        return real_fsync(fd)

    def replace(a, b):
        events.append(("replace", os.path.basename(str(b))))
        return real_replace(a, b)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    write_bytes_path = tmp_path / "x.bin"
    with atomic_write(str(write_bytes_path)) as f:
        f.write(b"12345")
    assert [e[0] for e in events] == ["fsync-file", "replace", "fsync-dir"]
    assert events[0][1] == 5  # the data was in the file when it was synced
    assert events[1][1] == "x.bin"


@pytest.mark.parametrize("exc", [ValueError("boom"), KeyboardInterrupt()])
def test_a_failed_write_leaves_the_old_file_and_no_temp_file(tmp_path, exc):
    path = tmp_path / "m.bin"
    path.write_bytes(b"old")
    with pytest.raises(type(exc)):
        with atomic_write(str(path)) as f:
            f.write(b"half")
            raise exc
    assert path.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["m.bin"]


@pytest.mark.parametrize("exc", [RuntimeError("encode failed"), KeyboardInterrupt()])
def test_save_compressed_interrupted_inside_safetensors_leaves_nothing(tmp_path, monkeypatch, exc):
    import safetensors.torch as st

    def broken(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"partial")
        raise exc

    monkeypatch.setattr(st, "save_file", broken)
    with pytest.raises(type(exc)):
        save_compressed({"w": torch.ones(4)}, str(tmp_path / "m.safetensors"))
    assert os.listdir(tmp_path) == []


def test_errors_name_the_users_path_not_the_temp_file(tmp_path, monkeypatch):
    path = str(tmp_path / "model.safetensors")

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError) as info:
        save_compressed({"w": torch.ones(4)}, path)
    assert info.value.errno == errno.ENOSPC
    assert info.value.filename == path and path in str(info.value)
    assert writer_mod._TMP_MARK not in str(info.value)
    assert os.listdir(tmp_path) == []


def test_a_missing_folder_is_named_in_the_error(tmp_path):
    path = str(tmp_path / "nope" / "m.json")
    with pytest.raises(FileNotFoundError) as info:
        write_json(path, {})
    assert info.value.filename == path


def test_a_directory_is_refused_by_name(tmp_path):
    with pytest.raises(IsADirectoryError) as info:
        write_text(str(tmp_path), "x")
    assert info.value.filename == str(tmp_path)


def test_a_device_is_written_in_place_never_replaced(tmp_path):
    write_text("/dev/null", "discarded")
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)


def test_atomic_path_keeps_the_extension_for_writers_that_choose_by_it(tmp_path):
    seen = []
    with atomic_path(str(tmp_path / "plot.png")) as tmp:
        seen.append(tmp)
        open(tmp, "wb").close()
    assert seen[0].endswith(".png") and os.path.dirname(seen[0]) == str(tmp_path)
    assert os.listdir(tmp_path) == ["plot.png"]


def test_a_file_object_is_written_directly():
    import io

    buf = io.BytesIO()
    write_with(buf, lambda f: torch.save({"w": torch.ones(2)}, f))
    buf.seek(0)
    assert torch.load(buf, weights_only=True)["w"].tolist() == [1.0, 1.0]


# ----------------------------------------------------------------------------- Ctrl-C at every step
from helpers.interrupts import every_step  # noqa: E402


def _listing(folder):
    return sorted(os.listdir(folder))


@pytest.mark.parametrize("existing", [False, True])
def test_atomic_write_interrupted_at_every_step_leaves_the_old_file_or_the_new_and_no_temp(tmp_path, existing):
    path = tmp_path / "m.bin"

    def setup():
        if existing:
            path.write_bytes(b"old")
        elif path.exists():
            path.unlink()

    def check(error, steps):
        names = _listing(tmp_path)
        if existing or error is None:
            assert names == ["m.bin"], (steps.names, names)
        else:
            assert names in ([], ["m.bin"]), (steps.names, names)
        if names:
            assert path.read_bytes() in ((b"old", b"new") if existing else (b"new",)), steps.names
        if error is None:
            assert path.read_bytes() == b"new"

    assert every_step(lambda: writer_mod.write_bytes(str(path), b"new"), check, setup=setup) > 5


def _tree(folder):
    return {n: open(os.path.join(folder, n), "rb").read() for n in sorted(os.listdir(folder))}


def _fill(folder, tag):
    for name in ("config.json", "model.safetensors"):
        with open(os.path.join(folder, name), "wb") as f:
            f.write(f"{tag}:{name}".encode())


OLD = {"config.json": b"old:config.json", "model.safetensors": b"old:model.safetensors"}
NEW = {"config.json": b"new:config.json", "model.safetensors": b"new:model.safetensors"}


def _reset(tmp_path, existing):
    import shutil

    for n in os.listdir(tmp_path):
        shutil.rmtree(tmp_path / n)
    if existing:
        (tmp_path / "export").mkdir()
        _fill(str(tmp_path / "export"), "old")


def _write_folder(path):
    with folders_mod.atomic_folder(path) as tmp:
        _fill(tmp, "new")


@pytest.mark.parametrize("swap", ["exchange", "two renames"])
@pytest.mark.parametrize("existing", [True, False])
def test_a_folder_replace_interrupted_at_every_step_keeps_the_old_folder_or_the_new(tmp_path, monkeypatch, swap,
                                                                                     existing):
    if swap == "two renames":  # a file system that cannot swap two names: the old is renamed aside first
        monkeypatch.setattr(folders_mod, "_exchange", lambda a, b: False)
    target = str(tmp_path / "export")

    def check(error, steps):
        names = _listing(tmp_path)
        if error is None:
            assert names == ["export"] and _tree(target) == NEW, steps.names
        elif existing:  # never lost, never half: the old folder, or (once the swap is done) the new one
            assert names == ["export"] and _tree(target) in (OLD, NEW), (steps.names, names)
        else:
            assert names in ([], ["export"]), (steps.names, names)
            assert not names or _tree(target) == NEW

    runs = every_step(lambda: _write_folder(target), check, setup=lambda: _reset(tmp_path, existing))
    assert runs > 10


def test_a_folder_replace_that_fails_puts_the_old_folder_back(tmp_path, monkeypatch):
    _reset(tmp_path, True)
    target = str(tmp_path / "export")
    real = folders_mod._fsync_dir

    def fail_after_the_swap(d):  # the parent's fsync comes after the swap
        if d == str(tmp_path):
            raise OSError(errno.EIO, "I/O error")
        return real(d)

    monkeypatch.setattr(folders_mod, "_fsync_dir", fail_after_the_swap)
    with pytest.raises(OSError, match="I/O error"):
        _write_folder(target)
    assert _listing(tmp_path) == ["export"] and _tree(target) == OLD


def test_atomic_folder_refuses_a_file_and_a_missing_parent(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(FileExistsError, match="is a file"):
        _write_folder(str(tmp_path / "f"))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        _write_folder(str(tmp_path / "nope" / "export"))
    assert _listing(tmp_path) == ["f"]


def test_an_unnamed_file_leaves_no_name_at_any_step(tmp_path, monkeypatch):
    for variant in ("O_TMPFILE", "named, then unlinked"):
        if variant != "O_TMPFILE":
            monkeypatch.delattr(os, "O_TMPFILE", raising=False)
        kept = []

        def make():
            f = writer_mod.unnamed_file(str(tmp_path))
            kept.append(f)
            f.write(b"spool")
            f.seek(0)
            assert f.read() == b"spool"

        def check(error, steps):
            assert _listing(tmp_path) == [], (variant, steps.names)
            while kept:
                kept.pop().close()

        assert every_step(make, check) >= 1


def test_the_trainer_callbacks_scores_file_leaves_no_temp_at_any_step(tmp_path):
    from types import SimpleNamespace

    from prunekit.training.hf import SCORES_FILE, PruningTrainerCallback

    fake = SimpleNamespace(pruning=SimpleNamespace(pruners=[SimpleNamespace(scores={"w": torch.arange(6.0)})]))

    def check(error, steps):
        names = _listing(tmp_path)
        assert names in ([], [SCORES_FILE]), (steps.names, names)
        for n in names:
            os.unlink(tmp_path / n)

    every_step(lambda: PruningTrainerCallback._save_scores(fake, str(tmp_path)), check)


def test_the_native_kernels_stamp_leaves_no_temp_at_any_step(tmp_path, monkeypatch):
    from torch.utils import cpp_extension

    from prunekit.sparse import native

    monkeypatch.setattr(native, "build_directory", lambda: tmp_path)
    monkeypatch.setattr(cpp_extension, "load", lambda **kw: None)
    monkeypatch.setattr(native, "available", lambda: True)
    monkeypatch.setitem(native._state, "loaded", None)

    def check(error, steps):
        names = _listing(tmp_path)
        assert names in ([], ["fingerprint.txt"]), (steps.names, names)
        if error is None:
            assert (tmp_path / "fingerprint.txt").read_text() == native._fingerprint()

    every_step(native.build, check)


def test_atomic_folder_is_importable_from_the_writer_module_too():
    from prunekit.io.writer import atomic_folder

    assert atomic_folder is writer_mod.atomic_folder is folders_mod.atomic_folder
    with pytest.raises(AttributeError, match="'prunekit.io.writer' has no attribute 'atomic_folders'"):
        writer_mod.atomic_folders
