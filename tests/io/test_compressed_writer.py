"""CompressedWriter: the streaming form of the compressed checkpoint writer."""

import os

import pytest
import torch

pytest.importorskip("safetensors")

from prunekit.io.compressed import CompressedWriter, load_compressed, write_compressed  # noqa: E402


def _state():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 32, generator=g)
    mask = (torch.rand(64, 32, generator=g) > 0.8).float()
    return {
        "a.weight_orig": w * mask,  # -0.0 where negative weights were pruned
        "a.weight_mask": mask,
        "a.bias": torch.randn(64, generator=g),
        "half": torch.randn(9, generator=g).to(torch.bfloat16),
        "bits": torch.rand(11, generator=g) > 0.5,
        "ints": torch.arange(7, dtype=torch.int64),
        "wide": torch.randn(3, dtype=torch.float64, generator=g),
    }


def _bits(t):
    return t if t.dtype == torch.bool else t.contiguous().view(torch.uint8)


def test_same_content_as_write_compressed(tmp_path):
    sd = _state()
    streamed, whole = tmp_path / "s.safetensors", tmp_path / "w.safetensors"
    with CompressedWriter(streamed, key="secret") as out:
        for k, v in sd.items():
            out.add(k, v)
    write_compressed(sd, whole, key="secret")
    a, b = load_compressed(streamed, key="secret"), load_compressed(whole, key="secret")
    assert list(a) == list(sd) == list(b)
    for k, v in sd.items():
        assert a[k].dtype == v.dtype and torch.equal(_bits(a[k]), _bits(v)), k  # bit-exact, -0.0 included
    from safetensors.torch import load_file  # the stored tensors themselves are the same, bit for bit

    x, y = load_file(streamed), load_file(whole)
    assert sorted(x) == sorted(y) and all(torch.equal(_bits(x[k]), _bits(y[k])) for k in x)
    assert sorted(os.listdir(tmp_path)) == ["s.safetensors", "w.safetensors"]  # no spool left behind


def test_failure_writes_nothing_and_removes_the_spools(tmp_path):
    path = tmp_path / "m.safetensors"
    with pytest.raises(RuntimeError, match="disk full"):
        with CompressedWriter(path) as out:
            out.add("w", torch.ones(100))
            raise RuntimeError("disk full")
    assert os.listdir(tmp_path) == []
    out = CompressedWriter(path)
    out.add("w", torch.ones(3))
    with pytest.raises(ValueError, match="two entries would be stored under"):
        out.add("w", torch.ones(3))
    with pytest.raises(ValueError, match="suffix prunekit reserves"):
        out.add("x::bitmask", torch.ones(3))
    out.abort()
    assert os.listdir(tmp_path) == []
    with pytest.raises(ValueError, match="is closed"):
        out.add("y", torch.ones(1))


def test_a_ctrl_c_at_every_step_leaves_no_spool_and_no_half_file(tmp_path):
    from helpers.interrupts import every_step

    path = tmp_path / "m.safetensors"
    sd = _state()

    def setup():
        if path.exists():
            path.unlink()

    def write():
        with CompressedWriter(path) as out:
            for k, v in sd.items():
                out.add(k, v)

    def check(error, steps):
        names = sorted(os.listdir(tmp_path))
        assert names in ([], ["m.safetensors"]), (steps.names, names)  # no spool, no temporary file
        if error is None or names:
            loaded = load_compressed(path)
            assert list(loaded) == list(sd) and all(torch.equal(_bits(loaded[k]), _bits(v)) for k, v in sd.items())

    assert every_step(write, check, setup=setup) > 10


def test_spools_have_no_name_even_while_writing(tmp_path):
    out = CompressedWriter(tmp_path / "m.safetensors")
    out.add("w", torch.ones(100))
    out.add("i", torch.arange(10))
    assert os.listdir(tmp_path) == []  # a crash now (kill -9) would leave nothing either
    out.close()
    assert os.listdir(tmp_path) == ["m.safetensors"]
