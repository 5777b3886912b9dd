"""Compressed checkpoints are read as hostile input.

Every malformed file raises CorruptCheckpointError (a ValueError) naming the
path and the reason; work is bounded; non-regular files are refused before
reading; signed files are authenticated; `prunekit inspect` exits 2 with one
line on every unreadable file. The fuzz test at the end uses a fixed seed.
"""

import hashlib
import json
import os
import random
import re
import struct
import threading
import warnings

import pytest
import torch

pytest.importorskip("safetensors")

from prunekit.cli import main  # noqa: E402
from prunekit.io import (  # noqa: E402
    CheckpointSignatureError,
    CorruptCheckpointError,
    UnverifiedSignatureWarning,
    load_compressed,
    read_checkpoint,
    save_compressed,
)
from prunekit.io.reader import read_safetensors_header, open_regular  # noqa: E402


def _state(seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(24, 16, generator=g)
    w[torch.rand(24, 16, generator=g) < 0.9] = 0
    w[0, :4] = -0.0  # a zero-sign record
    return {
        "layer.weight": w,  # sparse
        "layer.weight_mask": (w != 0).float(),  # binary
        "layer.bias": torch.randn(24, generator=g),  # dense
        "cplx": torch.zeros(8, dtype=torch.complex128),  # raw storage
    }


@pytest.fixture
def saved(tmp_path):
    path = str(tmp_path / "ckpt.safetensors")
    sd = _state()
    save_compressed(sd, path)
    with open(path, "rb") as f:
        return path, sd, f.read()


def _split(data):
    n = struct.unpack("<Q", data[:8])[0]
    return json.loads(data[8:8 + n]), data[8 + n:]


def _assemble(header, buffer):
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + buffer


def _with_index(data, index, *, fix_sha=True, extra_meta=None):
    """The file with its index replaced -- and its SHA-256 recomputed, as an attacker would."""
    header, buffer = _split(data)
    meta = header["__metadata__"]
    text = index if isinstance(index, str) else json.dumps(index, separators=(",", ":"))
    meta["prunekit.index"] = text
    if fix_sha:
        meta["prunekit.index_sha256"] = hashlib.sha256(text.encode()).hexdigest()
    meta.update(extra_meta or {})
    return _assemble(header, buffer)


def _write(path, data):
    if os.path.exists(path):
        os.unlink(path)  # a new file: much cheaper than truncating the old one, on a busy disk
    with open(path, "wb") as f:
        f.write(data)


def _load_bytes(path, data, **kw):
    _write(path, data)
    return load_compressed(path, **kw)


def _bit_equal(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8))


# ----------------------------------------------------------------------------- crafted indexes
def _index(data):
    return json.loads(_split(data)[0]["__metadata__"]["prunekit.index"])


def _entry(index, name):
    return next(e for e in index["tensors"] if e["name"] == name)


def _crafted(data):
    """(description, malformed file bytes) for every class of malformed file the issue names."""
    base = _index(data)
    cases = []

    def mutate(desc, fn):
        idx = json.loads(json.dumps(base))
        fn(idx)
        cases.append((desc, _with_index(data, idx)))

    # the index itself of the wrong type or shape
    for bad in ([], "x", 1, None, {"version": 1}, {"version": 1, "tensors": {}}, {"version": 2, "tensors": []},
                {"version": True, "tensors": []}, {"version": 1, "tensors": [], "extra": 1}):
        cases.append((f"index {bad!r}", _with_index(data, bad)))
    cases.append(("index not JSON", _with_index(data, "{not json")))
    cases.append(("index NaN", _with_index(data, '{"version": NaN, "tensors": []}')))
    cases.append(("index nested 100k deep", _with_index(data, "[" * 100_000 + "]" * 100_000)))
    cases.append(("index with duplicate keys", _with_index(data, '{"version": 1, "version": 1, "tensors": []}')))
    # entries of the wrong type or shape
    for field, values in {
        "shape": [None, "16", [16.0, 24], [True, 16], [-1, 16], [[24], 16], [2 ** 70], [24] * 65, {"a": 1}, [24, 17]],
        "dtype": ["float128", "qint8", "Tensor", "__class__", "float", 3, None, "torch.float32", "bits8"],
        "nnz": [-1, 10 ** 9, True, 1.5, "3", None],
        "encoding": ["zip", None, 1, "Dense"],
        "sha256": ["0" * 63, "g" * 64, None, 5],
        "name": [None, 1, ["layer.weight"], "layer.weight::bitmask"],
        "storage": ["pickle", None, "raw"],
    }.items():
        for v in values:
            mutate(f"weight {field}={v!r}", lambda idx, f=field, v=v: _entry(idx, "layer.weight").__setitem__(f, v))
    mutate("dense storage raw for a native dtype", lambda idx: _entry(idx, "layer.bias").__setitem__("storage", "raw"))
    mutate("entry is a list", lambda idx: idx["tensors"].__setitem__(0, ["layer.weight"]))
    mutate("entry nested", lambda idx: idx["tensors"].__setitem__(0, {"name": {"name": {"name": "x"}}}))
    mutate("extra key", lambda idx: _entry(idx, "layer.bias").__setitem__("pickle", "os.system"))
    mutate("missing key", lambda idx: _entry(idx, "layer.bias").pop("sha256"))
    mutate("neg_zeros on a dense entry", lambda idx: _entry(idx, "layer.bias").__setitem__("neg_zeros", 1))
    mutate("neg_zeros count wrong", lambda idx: _entry(idx, "layer.weight").__setitem__("neg_zeros", 3))
    mutate("neg_zeros dropped", lambda idx: _entry(idx, "layer.weight").pop("neg_zeros"))
    mutate("duplicate entry", lambda idx: idx["tensors"].append(dict(_entry(idx, "layer.bias"))))
    mutate("entry listed 200 times", lambda idx: idx["tensors"].extend([dict(_entry(idx, "layer.weight"))] * 200))
    mutate("entry missing from the index", lambda idx: idx["tensors"].pop())
    mutate("binary claimed for a sparse tensor",
           lambda idx: (_entry(idx, "layer.weight").__setitem__("encoding", "binary"),
                        _entry(idx, "layer.weight").pop("storage"), _entry(idx, "layer.weight").pop("neg_zeros")))
    mutate("sizes do not add up (shape)", lambda idx: _entry(idx, "layer.bias").__setitem__("shape", [23]))
    mutate("sizes do not add up (nnz)", lambda idx: _entry(idx, "layer.weight").__setitem__("nnz", 1))
    mutate("dtype changed to a same-size one", lambda idx: _entry(idx, "layer.bias").__setitem__("dtype", "int32"))
    mutate("two names swapped", lambda idx: (_entry(idx, "layer.bias").__setitem__("name", "tmp"),
                                             _entry(idx, "cplx").__setitem__("name", "layer.bias"),
                                             _entry(idx, "tmp").__setitem__("name", "cplx")))
    # the container: overlapping entries, gaps, extra entries, a bad header
    header, buffer = _split(data)
    h = json.loads(json.dumps(header))
    first, second = [k for k in h if k != "__metadata__"][:2]
    h[second]["data_offsets"] = list(h[first]["data_offsets"])
    cases.append(("overlapping byte ranges", _assemble(h, buffer)))
    h = json.loads(json.dumps(header))
    h["extra"] = {"dtype": "U8", "shape": [4], "data_offsets": [len(buffer), len(buffer) + 4]}
    cases.append(("stored entry not in the index", _assemble(h, buffer + b"\0" * 4)))
    h = json.loads(json.dumps(header))
    h["__metadata__"]["prunekit.extra"] = "1"
    cases.append(("unknown metadata key", _assemble(h, buffer)))
    h = json.loads(json.dumps(header))
    h["__metadata__"]["prunekit.format"] = "prunekit-compressed/2"
    cases.append(("unknown format version", _assemble(h, buffer)))
    h = json.loads(json.dumps(header))
    del h["__metadata__"]["prunekit.format"]
    cases.append(("format key missing", _assemble(h, buffer)))
    h = json.loads(json.dumps(header))
    h["__metadata__"]["prunekit.index_sha256"] = "0" * 64
    cases.append(("index checksum wrong", _assemble(h, buffer)))
    cases.append(("header length past the end", struct.pack("<Q", 10 ** 12) + data[8:]))
    cases.append(("header of 4 GiB claimed in a small file", struct.pack("<Q", 2 ** 32) + b"{" + b" " * 100))
    cases.append(("empty file", b""))
    cases.append(("padding", data + b"\0" * 8))
    return cases


def test_every_crafted_file_is_a_corrupt_checkpoint_error_naming_path_and_reason(saved):
    path, _, data = saved
    cases = _crafted(data)
    assert len(cases) == 79
    for desc, bad in cases:
        with pytest.raises(CorruptCheckpointError) as info:
            _load_bytes(path, bad)
        msg = str(info.value)
        assert msg.startswith(path + ": "), (desc, msg)
        assert len(msg) > len(path) + 10, (desc, msg)
        # read_checkpoint (what `prunekit inspect` uses) refuses it too: never a plain safetensors file
        with pytest.raises(ValueError):
            read_checkpoint(path)


def test_crafted_reasons_are_specific(saved):
    path, _, data = saved
    idx = _index(data)
    idx["tensors"].append(dict(_entry(idx, "layer.bias")))
    with pytest.raises(CorruptCheckpointError, match="'layer.bias' is listed more than once"):
        _load_bytes(path, _with_index(data, idx))
    idx = _index(data)
    _entry(idx, "layer.weight")["dtype"] = "float128"
    with pytest.raises(CorruptCheckpointError, match="unknown dtype 'float128'"):
        _load_bytes(path, _with_index(data, idx))
    idx = _index(data)
    _entry(idx, "layer.bias")["shape"] = [23]
    with pytest.raises(CorruptCheckpointError, match=r"'layer.bias' is F32\[24\], the index needs F32\[23\]"):
        _load_bytes(path, _with_index(data, idx))
    with pytest.raises(CorruptCheckpointError, match="nested too deeply"):
        _load_bytes(path, _with_index(data, "[" * 100_000 + "]" * 100_000))


def test_duplicates_are_refused_before_any_tensor_is_read(saved, monkeypatch):
    """An index listing one entry N times costs no tensor read at all (it used to cost N decodes)."""
    from prunekit.io.compressed import reader

    path, _, data = saved
    idx = _index(data)
    idx["tensors"].extend([dict(_entry(idx, "layer.weight"))] * 5000)
    reads = []
    real = reader._read_stored
    monkeypatch.setattr(reader, "_read_stored", lambda *a: reads.append(a[-1]) or real(*a))
    with pytest.raises(CorruptCheckpointError, match="listed more than once"):
        _load_bytes(path, _with_index(data, idx))
    assert reads == []
    # and a valid file reads each stored tensor exactly once
    _load_bytes(path, data)
    assert sorted(reads) == sorted(k for k in _split(data)[0] if k != "__metadata__")


def test_a_flipped_bit_in_a_metadata_key_is_not_a_plain_safetensors_file(tmp_path, capsys):
    """The issue's example: a 90%-sparse file whose format key lost one bit was shown as 0% sparse, exit 0."""
    path = str(tmp_path / "m.safetensors")
    w = torch.randn(64, 64)
    w[torch.rand(64, 64) < 0.9] = 0
    save_compressed({"w": w}, path)
    data = open(path, "rb").read()
    for key in (b"prunekit.format", b"prunekit.index_sha256", b"prunekit.index\""):
        for bit in range(8 * (len(key) - 1)):
            pos = data.index(key) + bit // 8
            bad = bytearray(data)
            bad[pos] ^= 1 << (bit % 8)
            _write(path, bad)
            with pytest.raises(CorruptCheckpointError):
                load_compressed(path)
            with pytest.raises(ValueError):
                read_checkpoint(path)
    assert main(["inspect", path]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and path in err


# ----------------------------------------------------------------------------- non-regular files
def _nonregular(tmp_path):
    fifo = str(tmp_path / "pipe.safetensors")
    os.mkfifo(fifo)
    return {"FIFO": fifo, "/dev/zero": "/dev/zero", "directory": str(tmp_path)}


def _no_hang(fn, *args):
    """Run fn in a thread; fail (instead of hanging the suite) if it blocks."""
    box = {}

    def target():
        try:
            box["value"] = fn(*args)
        except BaseException as e:  # noqa: BLE001 - handed to the test
            box["error"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(10)
    assert not t.is_alive(), f"{fn.__name__}{args} blocked on a non-regular file"
    return box


def test_non_regular_files_are_refused_before_reading(tmp_path):
    for kind, path in _nonregular(tmp_path).items():
        box = _no_hang(load_compressed, path)
        assert isinstance(box.get("error"), CorruptCheckpointError), (kind, box)
        assert "not a regular file" in str(box["error"]) and str(box["error"]).startswith(path)
        if kind != "directory":
            box = _no_hang(read_checkpoint, path)
            assert isinstance(box.get("error"), ValueError) and "not a regular file" in str(box["error"]), kind


def test_inspect_exits_2_with_one_line_on_every_unreadable_file(saved, tmp_path, capsys):
    path, _, data = saved
    bad_files = []
    for i, (desc, bad) in enumerate(_crafted(data)[::4]):
        p = str(tmp_path / f"bad{i}.safetensors")
        with open(p, "wb") as f:
            f.write(bad)
        bad_files.append((desc, p))
    bad_files += [(k, p) for k, p in _nonregular(tmp_path).items()]
    for desc, p in bad_files:
        code = _no_hang(main, ["inspect", p]).get("value")
        out, err = capsys.readouterr()
        assert code == 2, (desc, code, err)
        assert out == "" and len(err.strip().splitlines()) == 1, (desc, err)


# ----------------------------------------------------------------------------- authentication
def test_signed_checkpoints(tmp_path):
    path = str(tmp_path / "s.safetensors")
    sd = _state()
    save_compressed(sd, path, key=b"k" * 32)
    out = load_compressed(path, key=b"k" * 32)
    assert all(_bit_equal(out[k], sd[k]) for k in sd)
    assert list(load_compressed(path, key="k" * 32)) == list(sd)  # a str key is its UTF-8 bytes
    with pytest.raises(CheckpointSignatureError, match="signature does not verify"):
        load_compressed(path, key=b"wrong")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = load_compressed(path)
    assert [w.category for w in caught] == [UnverifiedSignatureWarning]
    assert "signed but no key was given" in str(caught[0].message)
    # an unsigned file, when a key is expected
    plain = str(tmp_path / "p.safetensors")
    save_compressed(sd, plain)
    with pytest.raises(CheckpointSignatureError, match="not signed"):
        load_compressed(plain, key=b"k" * 32)
    # bad keys are user errors
    with pytest.raises(ValueError, match="empty key"):
        save_compressed(sd, plain, key=b"")
    with pytest.raises(TypeError, match="bytes or str"):
        save_compressed(sd, plain, key=123)


def test_read_checkpoint_with_a_key_refuses_every_file_that_carries_no_signature(tmp_path):
    sd = _state()
    torch_file = str(tmp_path / "m.pt")
    torch.save(sd, torch_file)
    plain = str(tmp_path / "plain.safetensors")
    import safetensors.torch as st

    st.save_file({k: v for k, v in sd.items() if k != "cplx"}, plain)
    for path, kind in ((torch_file, "torch"), (plain, "safetensors")):
        assert read_checkpoint(path)[1] == kind  # without a key: read as before
        with pytest.raises(CheckpointSignatureError, match=f"{kind} file carries no signature"):
            read_checkpoint(path, key=b"k" * 32)


def test_inspect_verifies_a_signed_file_with_key_file_or_env(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("PRUNEKIT_KEY", raising=False)
    signed = str(tmp_path / "signed.safetensors")
    save_compressed(_state(), signed, key=b"s3cret\n")  # the key file's exact bytes, newline included
    unsigned = str(tmp_path / "unsigned.safetensors")
    save_compressed(_state(), unsigned)
    key_file, wrong, empty = tmp_path / "key", tmp_path / "wrong", tmp_path / "empty"
    key_file.write_bytes(b"s3cret\n")
    wrong.write_bytes(b"s3cret")
    empty.write_bytes(b"")

    def inspect(*argv):
        code = main(["inspect", *argv])
        out, err = capsys.readouterr()
        return code, out, err

    code, out, err = inspect(signed, "--key-file", str(key_file), "--json")
    assert code == 0 and err == ""
    d = json.loads(out)
    assert d["signature"] == "verified" and d["format"] == "prunekit-compressed"
    code, out, _ = inspect(signed, "--key-file", str(key_file))
    assert code == 0 and "signature verified" in out
    # no key: read (checksums checked), and said so once on stderr
    code, out, err = inspect(signed, "--json")
    assert code == 0 and json.loads(out)["signature"] == "not verified"
    assert err.count("\n") == 1 and "is signed; its signature was not verified" in err and "--key-file" in err
    code, out, err = inspect(unsigned, "--json")
    assert code == 0 and json.loads(out)["signature"] == "none" and err == ""
    # a wrong key, an unsigned file, a key file that is empty or missing: one line, exit 2
    for argv, words in (([signed, "--key-file", str(wrong)], "signature does not verify"),
                        ([unsigned, "--key-file", str(key_file)], "not signed"),
                        ([signed, "--key-file", str(empty)], "is empty"),
                        ([signed, "--key-file", str(tmp_path / "nope")], "key file not found")):
        code, out, err = inspect(*argv)
        assert code == 2 and out == "" and len(err.strip().splitlines()) == 1 and words in err, (argv, err)
    # the environment variable (UTF-8), when no --key-file is given
    monkeypatch.setenv("PRUNEKIT_KEY", "s3cret\n")
    code, out, err = inspect(signed, "--json")
    assert code == 0 and json.loads(out)["signature"] == "verified" and err == ""
    monkeypatch.setenv("PRUNEKIT_KEY", "other")
    code, out, err = inspect(signed)
    assert code == 2 and "signature does not verify" in err


def test_an_attacker_who_rewrites_the_index_and_its_checksum_fails_the_signature(tmp_path):
    path = str(tmp_path / "s.safetensors")
    save_compressed(_state(), path, key=b"secret")
    data = open(path, "rb").read()
    idx = _index(data)
    _entry(idx, "layer.bias")["sha256"] = "0" * 64
    with pytest.raises(CheckpointSignatureError):
        _load_bytes(path, _with_index(data, idx), key=b"secret")
    # ... or strips the signature
    header, buffer = _split(data)
    del header["__metadata__"]["prunekit.index_hmac"]
    with pytest.raises(CheckpointSignatureError, match="not signed"):
        _load_bytes(path, _assemble(header, buffer), key=b"secret")
    # ... or re-signs with a key of their own
    save_compressed(_state(1), path, key=b"attacker")
    with pytest.raises(CheckpointSignatureError):
        load_compressed(path, key=b"secret")


def test_a_non_ascii_signature_is_a_signature_error(tmp_path, capsys):
    """hmac.compare_digest refuses non-ASCII str: the forged signature must still be a signature error."""
    path = str(tmp_path / "s.safetensors")
    save_compressed(_state(), path, key=b"secret")
    header, buffer = _split(open(path, "rb").read())
    for forged in ("\u00e9" * 64, "0" * 63 + "\u00e9", "\u2603", ""):
        header["__metadata__"]["prunekit.index_hmac"] = forged
        with pytest.raises(CheckpointSignatureError, match="signature does not verify"):
            _load_bytes(path, _assemble(header, buffer), key=b"secret")
        with pytest.raises(CheckpointSignatureError):
            read_checkpoint(path, key=b"secret")
    key_file = tmp_path / "key"
    key_file.write_bytes(b"secret")
    code = main(["inspect", path, "--key-file", str(key_file)])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1 and "signature does not verify" in err


# ----------------------------------------------------------------------------- the fuzz test
FUZZ_SEED = 20240610


def test_fuzz_flips_truncations_and_crafted_indexes(saved, tmp_path):
    """Fixed seed: single-bit flips (every bit of the length field and of the metadata keys, 1,500 random bits
    of the header, 120 of the data), truncations at every 13th length, and 200 indexes with random hostile
    values at random places (their checksum recomputed, as an attacker would). Every one is refused with
    CorruptCheckpointError; a flip that loaded would have to give bit-identical tensors (none does)."""
    path, sd, data = saved
    rng = random.Random(FUZZ_SEED)
    header_end = 8 + struct.unpack("<Q", data[:8])[0]
    flips = [(pos, bit) for pos in range(8) for bit in range(8)]
    for key in (b"__metadata__", b"prunekit.format", b"prunekit.index_sha256", b"prunekit.index\""):
        start = data.index(key)
        flips += [(pos, bit) for pos in range(start, start + len(key)) for bit in range(8)]
    flips += [(rng.randrange(8, header_end), rng.randrange(8)) for _ in range(1500)]
    flips += [(rng.randrange(header_end, len(data)), rng.randrange(8)) for _ in range(120)]
    harmless = 0
    for pos, bit in flips:
        bad = bytearray(data)
        bad[pos] ^= 1 << bit
        try:
            out = _load_bytes(path, bytes(bad))
        except CorruptCheckpointError:
            continue
        harmless += 1
        assert list(out) == list(sd) and all(_bit_equal(out[k], sd[k]) for k in sd), (pos, bit)
    assert harmless == 0
    for length in range(0, len(data), 13):
        with pytest.raises(CorruptCheckpointError):
            _load_bytes(path, data[:length])
    hostile = [None, True, -1, 0, 2 ** 64, 1.5, "", "x" * 100, "float64", "raw", "native", "binary", "sparse",
               [], [0], [-1], [2 ** 40, 2 ** 40], {}, {"a": 1}, [[[]]], "layer.bias", "cplx"]
    base = _index(data)
    crafted = 0
    for _ in range(200):
        idx = json.loads(json.dumps(base))
        for _ in range(rng.randint(1, 3)):
            entries = [e for e in idx["tensors"] if isinstance(e, dict)]
            e = rng.choice(entries) if entries else None
            op = rng.random()
            if e is None or op < 0.1:
                idx["tensors"].append(rng.choice(hostile))
            elif op < 0.2:
                idx["tensors"].append(dict(e))
            elif op < 0.3:
                e.pop(rng.choice(sorted(e)))
            else:
                e[rng.choice(sorted(e) + ["neg_zeros", "extra"])] = rng.choice(hostile)
        if idx == base:
            continue
        crafted += 1
        with pytest.raises(CorruptCheckpointError):
            _load_bytes(path, _with_index(data, idx))
    assert crafted >= 190


def test_a_valid_file_round_trips_through_the_hostile_reader(saved):
    path, sd, data = saved
    out = _load_bytes(path, data)
    assert list(out) == list(sd) and all(_bit_equal(out[k], sd[k]) for k in sd)
    with open_regular(path) as f:
        header = read_safetensors_header(f, path)
    assert header.metadata["prunekit.format"] == "prunekit-compressed/1"


# ----------------------------------------------------------------------------- the YAML fuzz test
YAML_SEED = 20240611

# prunekit's own config YAML, and Neural Compressor's 1.x (with !Pruner tags) and 2.x files
PRUNEKIT_YAML = """\
prune_type: magnitude
target_sparsity: 0.5
pattern: 4x1
start_step: 0
end_step: 4
pruners:
  - names: ['^fc1$', 'conv.*']
    target_sparsity: 0.75
  - op_names: [fc2]
    pattern: '2:4'
"""
NC1_YAML = """\
model: {name: imagenet_prune, framework: pytorch}
pruning:
  approach:
    weight_compression_pytorch:
      initial_sparsity: 0.0
      target_sparsity: 0.9
      start_step: 0
      end_step: 10
      excluded_names: ["classifier"]
      sparsity_decay_type: "exp"
      pruners:
        - !Pruner
            prune_type: "magnitude"
            names: ['layer1.*']
            prune_domain: "global"
            pattern: "tile_pattern_4x1"
        - !Pruner {start_step: 1, end_step: 1, target_sparsity: 0.5, names: ['layer2.*'], pattern: "tile_pattern_2:4"}
"""
NC2_YAML = """\
pruning_type: snip_momentum
target_sparsity: 0.8
pattern: 4x1
start_step: 0
end_step: 20
pruning_configs:
  - op_names: ['layer1.*']
    pruning_scope: local
  - op_names: ['fc']
    pattern: '2:4'
    target_sparsity: 0.5
"""
YAML_TOKENS = [
    "&a ", "*a", "&b [*a, *a, *a]", "*b", "!!python/object/apply:os.system ", "!!python/name:os.system ",
    "!Pruner ", "!PrunerV2 ", "!Other ", "!!binary ", "!!int ", "!!float ", "!!timestamp ", "!!set ", "!!omap ",
    "!!str ", "!!map ", "!!seq ", "<<: ", "<<: *a\n", "? ", ": ", "- ", "[", "]", "{", "}", ",", "'", '"', "|", ">",
    "# ", "%YAML 1.1\n", "%TAG ! tag:x,2000:\n", "---\n", "...\n", "\t", "\x00", "\ufeff", "\\x", "1:1:1:1:1",
    "9" * 200, "1" + ":1" * 80, ".inf", ".nan", "~", "null", "yes", "2001-13-45", "0x", "0o9", "1e9999", "\n", "  ",
    "@", "`", "\u2028", "\ud7ff", "é",
]


def _yaml_mutants(base, rng, n):
    """n hostile variants of one YAML file: bit flips, inserted YAML syntax, deletions, duplicated and
    reindented lines, truncations."""
    data = base.encode()
    out = []
    for _ in range(n):
        b = bytearray(data)
        for _ in range(rng.randint(1, 2)):
            op = rng.random()
            pos = rng.randrange(len(b) + 1)
            if op < 0.25 and b:
                b[min(pos, len(b) - 1)] ^= 1 << rng.randrange(8)
            elif op < 0.6:
                b[pos:pos] = rng.choice(YAML_TOKENS).encode("utf-8", "surrogatepass")
            elif op < 0.75:
                del b[pos:pos + rng.randint(1, 12)]
            elif op < 0.9:
                lines = bytes(b).split(b"\n")
                i = rng.randrange(len(lines))
                lines.insert(rng.randrange(len(lines) + 1), b" " * rng.randint(0, 6) + lines[i])
                b = bytearray(b"\n".join(lines))
            else:
                del b[pos:]
        out.append(bytes(b))
    return out


def _yaml_crafted():
    """Documents built to hurt a YAML reader: alias bombs (lists, maps, merge keys), recursion, deep nesting,
    quadratic numbers, many documents, huge scalars."""
    docs = []
    for width, depth in ((9, 9), (10, 6), (100, 3), (2, 20)):
        items = ["&l0 [" + ", ".join(["x"] * width) + "]"]
        items += [f"&l{i} [" + ", ".join([f"*l{i - 1}"] * width) + "]" for i in range(1, depth)]
        docs.append("names: [" + ", ".join(items) + "]\n")
    maps = ["m0: &m0 {" + ", ".join(f"k{j}: v" for j in range(9)) + "}"]
    maps += [f"m{i}: &m{i} {{" + ", ".join(f"k{j}: *m{i - 1}" for j in range(9)) + "}" for i in range(1, 8)]
    docs.append("\n".join(maps) + "\n")
    merges = ["a0: &a0 {" + ", ".join(f"k{j}: v" for j in range(9)) + "}"]
    merges += [f"a{i}: &a{i} {{<<: [" + ", ".join([f"*a{i - 1}"] * 9) + "]}" for i in range(1, 8)]
    docs.append("\n".join(merges) + "\n")
    docs += ["&a [*a]\n", "&a {k: *a}\n", "pruners: &p [{names: *p}]\n", "a: &a [&b [*a]]\n"]
    docs += ["[" * n + "]" * n for n in (65, 1000, 100_000)]
    docs += ["{a: " * n + "1" + "}" * n for n in (65, 2000)]
    docs += ["".join("  " * i + f"k{i}:\n" for i in range(n)) for n in (70, 1500)]
    docs += ["- " * n + "x\n" for n in (70, 1500)]
    docs += ["start_step: 1" + ":1" * 200_000 + "\n", "target_sparsity: 1" + ":1" * 100_000 + ".5\n"]
    docs += ["---\n" * 10_000, "a: '" + "x" * 900_000 + "'\n", "a: " + "x" * 900_000 + "\n", "? " * 30_000]
    docs += [f"a: {v}\n" for v in ("!!timestamp fc2", "!!int", "!!int abc", "!!bool maybe", "!!float .",
                                    "!!timestamp 2001-02-30", "!!int 0x", "!!set [1]", "!!python/name:os.system")]
    docs += ["a: !!binary " + "A" * 100_001 + "\n", "!!set {" + ", ".join(f"k{i}" for i in range(200_000)) + "}"]
    return docs


def _hostile_yaml_files(rng):
    files = []
    for name, base in (("prunekit", PRUNEKIT_YAML), ("nc1", NC1_YAML), ("nc2", NC2_YAML)):
        files += [(name, m) for m in _yaml_mutants(base, rng, 120)]
    return files


def test_fuzz_yaml_configs_of_both_dialects(tmp_path):
    """Fixed seed: 360 mutants of prunekit's and Neural Compressor's config files,
    read by prunekit's YAML reader, PruningConfig.from_yaml and Neural Compressor's load_config. Every file
    either reads or raises a ValueError/TypeError; the reader's own refusals are UnreadableFileError starting
    with the path, and short. No RecursionError, UnicodeDecodeError, hang or other exception."""
    from prunekit.compat import neural_compressor as nc
    from prunekit.io import UnreadableFileError, read_yaml
    from prunekit.training import PruningConfig

    rng = random.Random(YAML_SEED)
    files = _hostile_yaml_files(rng)
    assert len(files) == 360
    path = str(tmp_path / "c.yaml")
    dialects = ((lambda p: read_yaml(p), PruningConfig.from_yaml),
                (lambda p: read_yaml(p, mapping_tags=("!Pruner", "!PrunerV2")),
                 lambda p: nc.load_config(p).to_pruning_config()))
    outcomes = {"read": 0, "refused by the reader": 0, "refused as a config": 0}
    for i, (origin, data) in enumerate(files):
        _write(path, data)
        for read, load in dialects:
            try:
                read(path)
                parsed = True
                outcomes["read"] += 1
            except UnreadableFileError as e:
                msg = str(e)
                assert msg.startswith(path + ": ") and len(msg) < 500, (i, origin, msg[:500])
                parsed = False
                outcomes["refused by the reader"] += 1
            try:
                load(path)
            except UnreadableFileError as e:  # the same refusal, through the config's own reader
                assert not parsed and str(e).startswith(path + ": "), (i, origin, str(e)[:300])
            except (ValueError, TypeError) as e:  # a config error, about a document that did parse
                assert parsed, (i, origin, str(e)[:300])
                outcomes["refused as a config"] += 1
    # the fuzz exercises every side: files that parse and are judged as configs, and files the reader refuses
    assert min(outcomes.values()) >= 100, outcomes


def test_every_crafted_yaml_bomb_is_refused_by_the_reader(tmp_path):
    """Alias bombs, recursion, deep nesting, quadratic numbers, huge files: refused before anything is built,
    by prunekit's YAML reader and so by PruningConfig.from_yaml and Neural Compressor's load_config."""
    from prunekit.compat import neural_compressor as nc
    from prunekit.io import UnreadableFileError, read_yaml
    from prunekit.training import PruningConfig

    path = str(tmp_path / "c.yaml")
    read, refused = [], set()
    for doc in _yaml_crafted():
        _write(path, doc.encode())
        try:
            read.append(len(read_yaml(path)["a"]))
            continue
        except UnreadableFileError as e:
            assert str(e).startswith(path + ": ") and len(str(e)) < 300
            refused.add(str(e)[len(path) + 2:].split(" (")[0].split(";")[0])
        for load in (PruningConfig.from_yaml, nc.load_config):  # the config readers refuse it the same way
            with pytest.raises(UnreadableFileError, match="^" + re.escape(path + ": ")):
                load(path)
    assert read == [900_000, 900_000]  # one long string is a legal config value (under the 1 MiB limit)
    assert refused == {"expands to more than 100000 values through aliases", "an alias refers to a value that contains it",
                       "not valid YAML", "a number 200003 characters long", "a number 400001 characters long",
                       "larger than 1048576 bytes"}


def test_the_pure_python_yaml_parser_refuses_the_same_bombs(tmp_path, monkeypatch):
    """Without libyaml (pyyaml built without it) the same documents are refused the same way."""
    yaml = pytest.importorskip("yaml")
    from prunekit.io import UnreadableFileError, read_yaml
    from prunekit.io import reader

    monkeypatch.delattr(yaml, "CSafeLoader", raising=False)
    monkeypatch.setattr(reader, "_YAML_LOADERS", {})
    assert reader._yaml_loader(()).__mro__[1] is yaml.SafeLoader
    path = str(tmp_path / "c.yaml")
    small = [d for d in _yaml_crafted() if len(d) < 50_000] + ["[" * 100_000 + "]" * 100_000]
    assert len(small) >= 15
    for doc in small:
        _write(path, doc.encode())
        with pytest.raises(UnreadableFileError) as info:
            read_yaml(path)
        assert str(info.value).startswith(path + ": ") and len(str(info.value)) < 300
    _write(path, b"pruners:\n  - !Pruner {names: [fc], target_sparsity: 0.5}\n")
    assert read_yaml(path, mapping_tags=("!Pruner",)) == {"pruners": [{"names": ["fc"], "target_sparsity": 0.5}]}


def test_fuzzed_configs_on_the_command_line_exit_0_or_2_with_one_line(tmp_path, capsys):
    """prunekit prune --config on mutants of a config: it prunes (exit 0), or one line and exit 2."""
    here = os.path.dirname(os.path.abspath(__file__))
    tests = here if os.path.isdir(os.path.join(here, "helpers")) else os.path.dirname(here)
    model = os.path.join(tests, "helpers", "cli_models.py") + ":make_mlp"
    rng = random.Random(YAML_SEED + 1)
    config = PRUNEKIT_YAML.replace("^fc1$', 'conv.*'", "^0$', '^2$'").replace("[fc2]", "['^4$']")
    codes = []
    for i, data in enumerate([config.encode()] + _yaml_mutants(config, rng, 16)):
        path = tmp_path / f"c{i}.yaml"
        path.write_bytes(data)
        out = tmp_path / f"o{i}.safetensors"
        code = main(["prune", "--model", model, "--config", str(path), "--out", str(out), "--json"])
        stdout, err = capsys.readouterr()
        codes.append(code)
        assert code in (0, 2), (i, data, err)
        if code == 2:
            assert stdout == "" and len(err.strip().splitlines()) == 1 and err.startswith("prunekit: error: ")
            assert not out.exists()
    assert codes[0] == 0 and codes.count(2) >= 12, codes
