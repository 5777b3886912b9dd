"""compressed-tensors folders are read as hostile input.

Every refusal is an UnreadableFileError (a ValueError) naming the folder's file and why:
index names that lead out of the folder, links, FIFOs and devices (refused without
blocking), shapes that lie about the stored data (refused before anything is allocated),
parts that do not fit together. The fuzz test at the end mutates and truncates a small
export with fixed seeds: each read gives the original tensors or that error.
"""

import json
import os
import random
import re
import shutil
import struct
import threading

import numpy
import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")
from safetensors.torch import load_file, save_file  # noqa: E402

import prunekit  # noqa: E402
from prunekit.io import UnreadableFileError, read_checkpoint  # noqa: E402
from prunekit.io.compressed_tensors import read_compressed_tensors  # noqa: E402

LAYER = "encoder.layer.0.attention.self.query"  # a 16 x 16 Linear


def _model(seed, pattern):
    torch.manual_seed(seed)
    cfg = transformers.BertConfig(vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                  intermediate_size=32, max_position_embeddings=16)
    model = transformers.BertModel(cfg).eval()
    for m in model.encoder.modules():
        if isinstance(m, torch.nn.Linear):
            if pattern == "2:4":
                w = m.weight.detach()
                keep = w.abs().reshape(-1, 4).topk(2, dim=1).indices
                prunekit.custom_from_mask(m, "weight", torch.zeros(w.numel() // 4, 4).scatter_(1, keep, 1.0)
                                          .reshape(w.shape))
            else:
                prunekit.l1_unstructured(m, "weight", amount=0.5)
    return model


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """A sparse-bitmask and a sparse-24-bitmask export: their files and their tensors."""
    root = tmp_path_factory.mktemp("exports")
    out = {}
    for fmt, seed, pattern in (("sparse-bitmask", 0, "unstructured"), ("sparse-24-bitmask", 1, "2:4")):
        folder = root / fmt
        assert prunekit.save_compressed(_model(seed, pattern), str(folder), format="compressed-tensors")["format"] == fmt
        out[fmt] = ({n: (folder / n).read_bytes() for n in os.listdir(folder)}, read_compressed_tensors(str(folder)))
    return out


def _copy(exports, tmp_path, fmt="sparse-bitmask"):
    folder = tmp_path / "export"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir()
    for n, data in exports[fmt][0].items():
        (folder / n).write_bytes(data)
    return folder


def _edit_tensors(folder, edit, name="model.safetensors"):
    path = str(folder / name)
    tensors = load_file(path)
    edit(tensors)
    os.unlink(path)
    save_file(tensors, path, metadata={"format": "pt"})


def _refused(folder, *words):
    with pytest.raises(UnreadableFileError) as info:
        read_checkpoint(str(folder))
    msg = str(info.value)
    assert msg.startswith(str(folder)), msg
    for w in words:
        assert w in msg, msg
    return msg


def _no_hang(fn, *args, unblock=()):
    """Run fn in a thread; fail (instead of hanging the suite) if it blocks. ``unblock``: FIFOs to release."""
    box = {}

    def target():
        try:
            box["value"] = fn(*args)
        except BaseException as e:  # noqa: BLE001
            box["error"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(10)
    blocked = t.is_alive()
    for fifo in unblock:  # let a blocked open() of the FIFO go on, so the thread ends
        if blocked:
            try:
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                pass
    assert not blocked, f"{fn.__name__}{args} blocked on a FIFO"
    return box


def _sharded(folder, name_for):
    """Turn the single file into a shard plus model.safetensors.index.json whose weight_map says name_for(key)."""
    keys = list(load_file(str(folder / "model.safetensors")))
    os.rename(folder / "model.safetensors", folder / "model-00001-of-00001.safetensors")
    index = {"metadata": {}, "weight_map": {k: name_for(k) for k in keys}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return keys


# ----------------------------------------------------------------------------- paths out of the folder
_FIFO_WATCH = """
import os, sys, time
fifo, marker, stop = sys.argv[1:4]
while not os.path.exists(stop):
    try:  # succeeds only while a reader has the FIFO open (blocked in open()): note it, and so release the reader
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
    except OSError:
        time.sleep(0.02)
        continue
    open(marker, "w").close()
    os.close(fd)
    break
"""


def test_an_index_naming_a_fifo_outside_the_folder_is_refused_without_opening_it(tmp_path, exports):
    import subprocess
    import sys

    folder = _copy(exports, tmp_path)
    fifo, marker = tmp_path / "outside.safetensors", tmp_path / "a-reader-blocked-on-the-fifo"
    os.mkfifo(fifo)
    _sharded(folder, lambda k: "../outside.safetensors" if k.startswith("encoder") else
             "model-00001-of-00001.safetensors")
    # a blocking open of a FIFO can hold the GIL (safetensors' Rust reader does): a thread cannot watch it,
    # a second process can -- and releases it, so the read ends either way
    stop = tmp_path / "stop"
    watch = subprocess.Popen([sys.executable, "-c", _FIFO_WATCH, str(fifo), str(marker), str(stop)])
    try:
        with pytest.raises(UnreadableFileError) as info:
            read_checkpoint(str(folder))
    finally:
        stop.touch()  # the watcher ends at its next look (having written the marker if it released a reader)
        watch.wait(timeout=60)
    assert not marker.exists(), "the reader opened the FIFO outside the folder (and blocked on it)"
    assert str(info.value).startswith(str(folder))
    assert "'../outside.safetensors' is not a plain file name inside the folder" in str(info.value)


@pytest.mark.parametrize("name", ["/etc/passwd.safetensors", "sub/model.safetensors", "..\\x.safetensors",
                                  ".", "", "a\0b.safetensors", 7])
def test_an_index_naming_anything_but_a_plain_file_of_the_folder_is_refused(tmp_path, exports, name):
    folder = _copy(exports, tmp_path)
    _sharded(folder, lambda k: name if k.endswith(".bias") else "model-00001-of-00001.safetensors")
    if not isinstance(name, str) or not name.endswith(".safetensors"):
        _refused(folder, "not a .safetensors file name")
    else:
        _refused(folder, "is not a plain file name inside the folder")


def test_a_link_to_a_file_outside_the_folder_is_refused(tmp_path, exports):
    folder = _copy(exports, tmp_path)
    os.rename(folder / "model.safetensors", tmp_path / "elsewhere.safetensors")  # a real, valid export file
    os.symlink("../elsewhere.safetensors", folder / "model.safetensors")
    _refused(folder, "model.safetensors: a symbolic link")
    os.unlink(folder / "model.safetensors")
    os.symlink("/dev/zero", folder / "model.safetensors")
    _refused(folder, "a symbolic link")


@pytest.mark.parametrize("where", ["model.safetensors", "config.json", "shard"])
def test_a_fifo_in_the_folder_is_refused_without_blocking(tmp_path, exports, where):
    folder = _copy(exports, tmp_path)
    if where == "shard":
        _sharded(folder, lambda k: "pipe.safetensors" if k.endswith(".bias") else "model-00001-of-00001.safetensors")
        where = "pipe.safetensors"
    else:
        os.unlink(folder / where)
    os.mkfifo(folder / where)
    box = _no_hang(read_checkpoint, str(folder), unblock=[str(folder / where)])
    assert isinstance(box.get("error"), UnreadableFileError), box
    assert str(box["error"]).startswith(str(folder / where)) and "FIFO" in str(box["error"])


def test_an_index_must_agree_with_its_shards(tmp_path, exports):
    folder = _copy(exports, tmp_path)
    keys = _sharded(folder, lambda k: "model-00001-of-00001.safetensors")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert _same(read_checkpoint(str(folder))[0], exports["sparse-bitmask"][1])  # a sound sharded folder reads
    del index["weight_map"][keys[0]]
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    _refused(folder, f"holds tensor {keys[0]!r}", "does not list")
    index["weight_map"][keys[0]] = "model-00001-of-00001.safetensors"
    index["weight_map"]["ghost.weight"] = "model-00001-of-00001.safetensors"
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    _refused(folder, "has no tensor 'ghost.weight'")
    index["weight_map"]["ghost.weight"] = "model-00002-of-00002.safetensors"
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002.safetensors"):
        read_checkpoint(str(folder))


# ----------------------------------------------------------------------------- lying parts
def _same(a, b):
    return list(a) == list(b) and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def test_a_shape_wider_than_the_bitmask_is_refused(tmp_path, exports):
    folder = _copy(exports, tmp_path)
    _edit_tensors(folder, lambda t: t.__setitem__(LAYER + ".shape", torch.tensor([16, 1024])))
    _refused(folder, f"{LAYER}.weight", "shape [16, 1024] needs a uint8 bitmask of [16, 128]", "[16, 2]")


class Allocated(BaseException):
    """Raised by the allocation guard: not an Exception, so no reader can turn it into a refusal."""


def test_a_huge_shape_is_refused_before_anything_is_allocated(tmp_path, exports, monkeypatch):
    folder = _copy(exports, tmp_path)
    _edit_tensors(folder, lambda t: t.__setitem__(LAYER + ".shape", torch.tensor([16, 2 ** 26])))
    assert os.path.getsize(folder / "model.safetensors") < 50_000
    real_zeros, real_unpack = torch.zeros, numpy.unpackbits

    def zeros(*shape, **kw):
        dims = shape[0] if len(shape) == 1 and not isinstance(shape[0], int) else shape
        if int(numpy.prod([int(d) for d in dims])) > 10 ** 7:
            raise Allocated(f"torch.zeros{tuple(dims)}")
        return real_zeros(*shape, **kw)

    def unpackbits(a, *args, count=None, **kw):
        if count is not None and count * max(1, a.size // max(1, a.shape[-1])) > 10 ** 7:
            raise Allocated(f"numpy.unpackbits(count={count})")
        return real_unpack(a, *args, count=count, **kw)

    monkeypatch.setattr(torch, "zeros", zeros)
    monkeypatch.setattr(numpy, "unpackbits", unpackbits)
    _refused(folder, f"shape [16, {2 ** 26}] needs a uint8 bitmask of [16, {2 ** 23}]")


LIES = {
    # name: (edit of the stored tensors, words of the refusal)
    "values count": (lambda t: t.__setitem__(LAYER + ".compressed", t[LAYER + ".compressed"][:-1].clone()),
                     ["the bitmask marks 128 non-zeros, the file stores [127] values"]),
    "row_offsets": (lambda t: t[LAYER + ".row_offsets"].__setitem__(3, 99), ["row_offsets do not match"]),
    "bitmask dtype": (lambda t: t.__setitem__(LAYER + ".bitmask", t[LAYER + ".bitmask"].to(torch.int16)),
                      ["needs a uint8 bitmask of [16, 2], the file stores torch.int16 [16, 2]"]),
    "padding bits": (lambda t: t.__setitem__(LAYER + ".shape", torch.tensor([16, 12])),
                     ["marks columns past 12"]),
    "float shape": (lambda t: t.__setitem__(LAYER + ".shape", torch.tensor([16.0, 16.0])),
                    ["its shape tensor is torch.float32; it must hold integers"]),
    "three numbers": (lambda t: t.__setitem__(LAYER + ".shape", torch.tensor([16, 16, 1])),
                      ["its shape tensor holds [3] values"]),
    "negative": (lambda t: t.__setitem__(LAYER + ".shape", torch.tensor([-16, 16])), ["shape [-16, 16] is not"]),
    "missing part": (lambda t: t.pop(LAYER + ".row_offsets"), ["has the parts ['bitmask', 'compressed', 'shape']"]),
    "stray part": (lambda t: t.__setitem__("pooler.dense.compressed", torch.ones(3)),
                   ["'pooler.dense.compressed' is a part of a compressed weight, but there is no"]),
    "also dense": (lambda t: t.__setitem__(LAYER + ".weight", torch.ones(16, 16)), ["stored both dense and compressed"]),
    "int values": (lambda t: t.__setitem__(LAYER + ".compressed", t[LAYER + ".compressed"].to(torch.int32)),
                   ["its values are torch.int32"]),
    "bias": (lambda t: t.__setitem__(LAYER + ".bias", torch.ones(8)), ["does not fit its bias of [8]"]),
}


@pytest.mark.parametrize("lie", sorted(LIES))
def test_parts_that_do_not_fit_together_are_refused(tmp_path, exports, lie):
    folder = _copy(exports, tmp_path)
    edit, words = LIES[lie]
    _edit_tensors(folder, edit)
    _refused(folder, *words)


def test_a_broken_2_4_pattern_is_refused(tmp_path, exports):
    folder = _copy(exports, tmp_path, "sparse-24-bitmask")

    def edit(t):
        b = t[LAYER + ".bitmask"]
        b[0, 0] = 0b00000111  # three of the first four: the population stays, the pattern does not
        b[0, 1] = b[0, 1] & 0b11111110 if bin(int(b[0, 1])).count("1") else b[0, 1]
    _edit_tensors(folder, edit)
    _refused(folder, "does not keep 2 of every 4 values")


def test_compressed_weights_without_a_declared_format_are_refused(tmp_path, exports):
    folder = _copy(exports, tmp_path)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"].pop("sparsity_config")
    (folder / "config.json").write_text(json.dumps(cfg))
    _refused(folder, "declares no sparsity format")


def test_a_quantized_folder_is_refused(tmp_path, exports):
    folder = _copy(exports, tmp_path)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"]["config_groups"] = {"group_0": {"targets": ["Linear"]}}
    (folder / "config.json").write_text(json.dumps(cfg))
    _refused(folder, "quantized")


# ----------------------------------------------------------------------------- fuzz
def _header_span(data):
    n = struct.unpack("<Q", data[:8])[0]
    return 8, 8 + n


def _mutations(files, rng):
    """One mutated copy of an export's files per call: (kind, files)."""
    out = dict(files)
    data = bytearray(files["model.safetensors"])
    kind = rng.choice(["header number", "part dtype", "part bits", "truncate", "config byte", "config cut"])
    start, end = _header_span(bytes(data))
    header = bytes(data[start:end]).decode()
    meta = json.loads(header)
    parts = [k for k in meta if k.rsplit(".", 1)[-1] in ("shape", "bitmask", "row_offsets", "compressed")]
    if kind == "header number":  # a digit of a shape or a byte range
        digits = [start + m.start(2) + i for m in re.finditer(r'"(shape|data_offsets)":\[([0-9,]*)\]', header)
                  for i, c in enumerate(m.group(2)) if c.isdigit()]
        pos = rng.choice(digits)
        data[pos] = ord(rng.choice([d for d in "0123456789" if ord(d) != data[pos]]))
    elif kind == "part dtype":  # another dtype of the same size for a compressed weight's part
        key = rng.choice(parts)
        same = {"F32": ["I32", "U32"], "I64": ["F64", "I32"], "U8": ["I8", "BOOL", "F8_E4M3"]}
        tag = meta[key]["dtype"]
        new = rng.choice(same[tag])
        if len(new) != len(tag):
            return kind, None
        m = re.search(re.escape(f'"{key}":{{"dtype":"{tag}"'), header)
        pos = start + m.end() - len(tag) - 1
        data[pos:pos + len(tag)] = new.encode()
    elif kind == "part bits":  # one bit of a shape, a bitmask or row offsets
        key = rng.choice([k for k in parts if not k.endswith(".compressed")])
        b, e = meta[key]["data_offsets"]
        pos = end + rng.randrange(b, e)
        data[pos] ^= 1 << rng.randrange(8)
    elif kind == "truncate":
        data = data[:rng.randrange(len(data))]
    else:
        cfg = bytearray(files["config.json"])
        if kind == "config cut":
            cfg = cfg[:rng.randrange(len(cfg) - 2)]
        else:
            cfg[rng.randrange(len(cfg))] = rng.randrange(32, 127)
        out["config.json"] = bytes(cfg)
    out["model.safetensors"] = bytes(data)
    return kind, out


@pytest.mark.parametrize("fmt", ["sparse-bitmask", "sparse-24-bitmask"])
def test_fuzz_mutated_exports_read_whole_or_are_refused_by_name(tmp_path, exports, fmt):
    files, original = exports[fmt]
    rng = random.Random(20240611 if fmt == "sparse-bitmask" else 7)
    folder = tmp_path / "export"
    kinds = {}
    while sum(kinds.values()) < 30:
        kind, mutated = _mutations(files, rng)
        if mutated is None or mutated == files:
            continue
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir()
        for n, data in mutated.items():
            (folder / n).write_bytes(data)
        try:
            sd = read_compressed_tensors(str(folder))
        except UnreadableFileError as e:
            assert str(e).startswith(str(folder)), (kind, str(e))
            kinds[kind] = kinds.get(kind, 0) + 1
            continue
        assert _same(sd, original), f"{kind}: a mutated export read as other tensors"
        kinds[kind] = kinds.get(kind, 0) + 1
    assert len(kinds) == 6, kinds
