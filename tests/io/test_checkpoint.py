"""Compressed checkpoints: bit-exact round trips, compression, corruption detection."""

from __future__ import annotations

import json
import os
import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

pytest.importorskip("safetensors")
import safetensors.torch  # noqa: E402

from prunekit.sparse import CorruptCheckpointError, load_compressed, save_compressed  # noqa: E402
from prunekit.io.compressed.codec import _pack_bits, _unpack_bits  # noqa: E402


def _prune_module():
    """prunekit once the core is importable, torch.nn.utils.prune until then."""
    try:
        import prunekit

        prunekit.custom_from_mask  # noqa: B018
        return prunekit
    except (ImportError, AttributeError):
        import torch.nn.utils.prune as torch_prune

        return torch_prune


prune = _prune_module()

DTYPES = [
    torch.float64, torch.float32, torch.float16, torch.bfloat16,
    torch.float8_e4m3fn, torch.float8_e5m2,
    torch.complex64, torch.complex128,
    torch.int8, torch.int16, torch.int32, torch.int64,
    torch.uint8, torch.uint16, torch.uint32, torch.uint64,
    torch.bool,
]
SPARSITIES = [0.0, 0.5, 0.9, 1.0]


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of a tensor, for bit-exact comparison (NaN payloads, -0.0)."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def random_tensor(shape, dtype, sparsity, seed=0) -> torch.Tensor:
    """Random bit patterns (NaNs, -0.0, infinities included) with an exact share of all-zero elements."""
    g = torch.Generator().manual_seed(seed)
    numel = 1
    for s in shape:
        numel *= s
    if dtype == torch.bool:
        t = torch.randint(0, 2, (numel,), generator=g).bool() | True
    else:
        size = torch.empty(0, dtype=dtype).element_size()
        raw = torch.randint(0, 256, (numel * size,), dtype=torch.uint8, generator=g)
        raw = raw.view(numel, size)
        raw[:, 0] |= 1  # no element is accidentally all-zero bits
        t = raw.reshape(-1).view(dtype)
    k = round(sparsity * numel)
    zero_at = torch.randperm(numel, generator=g)[:k]
    t = t.clone()
    size = t.element_size()
    t.view(torch.uint8).view(numel, size)[zero_at] = 0
    return t.reshape(shape)


@pytest.fixture
def path(tmp_path):
    return str(tmp_path / "ckpt.safetensors")


# --------------------------------------------------------------------------- #
# round trips
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("sparsity", SPARSITIES)
def test_round_trip_every_dtype_and_sparsity(path, dtype, sparsity):
    t = random_tensor((37, 29), dtype, sparsity)
    save_compressed({"w": t, "scalar": torch.tensor(7), "empty": torch.empty(0, 4, dtype=dtype)}, path)
    out = load_compressed(path)
    assert list(out) == ["w", "scalar", "empty"]
    assert bit_equal(out["w"], t)
    assert bit_equal(out["scalar"], torch.tensor(7))
    assert out["empty"].shape == (0, 4) and out["empty"].dtype == dtype


def test_special_float_values_are_kept_bit_exact(path):
    t = torch.tensor([0.0, -0.0, float("nan"), float("inf"), -float("inf"), 1e-45] + [0.0] * 100)
    t16 = t.to(torch.bfloat16)
    neg_nan = bits(torch.tensor([float("nan")])).clone()
    neg_nan[3] |= 0x80  # a NaN with the sign bit set
    t[2] = neg_nan.view(torch.float32)[0]
    save_compressed({"f32": t, "bf16": t16}, path)
    out = load_compressed(path)
    assert bit_equal(out["f32"], t) and bit_equal(out["bf16"], t16)
    assert bits(out["f32"][1:2]).tolist() == [0, 0, 0, 0x80]  # -0.0 survived as -0.0


def test_encodings_chosen_by_size(path):
    sparse = random_tensor((64, 64), torch.float32, 0.9)
    mask = (sparse != 0).to(torch.float32)
    dense = random_tensor((64, 64), torch.float32, 0.0)
    save_compressed({"sparse": sparse, "mask": mask, "dense": dense, "tiny": torch.zeros(3)}, path)
    with safetensors.safe_open(path, "pt") as f:
        keys = set(f.keys())
        index = json.loads(f.metadata()["prunekit.index"])["tensors"]
    enc = {e["name"]: e["encoding"] for e in index}
    assert enc == {"sparse": "sparse", "mask": "binary", "dense": "dense", "tiny": "dense"}
    assert keys == {"sparse::bitmask", "sparse::values", "mask::bitmask", "dense", "tiny"}
    assert {e["name"]: e.get("nnz") for e in index}["sparse"] == 4096 - round(0.9 * 4096)


@pytest.mark.parametrize("sparsity,limit", [(0.5, 0.60), (0.9, 0.15), (0.95, 0.10)])
def test_file_size_against_dense_safetensors(tmp_path, sparsity, limit):
    t = random_tensor((256, 256), torch.float32, sparsity)
    dense_path, comp_path = str(tmp_path / "dense.safetensors"), str(tmp_path / "comp.safetensors")
    safetensors.torch.save_file({"w": t}, dense_path)
    save_compressed({"w": t}, comp_path)
    ratio = os.path.getsize(comp_path) / os.path.getsize(dense_path)
    assert ratio <= limit, ratio


def test_bitmask_packing_round_trip():
    for n in [0, 1, 7, 8, 9, 1000]:
        flags = torch.rand(n, generator=torch.Generator().manual_seed(n)) < 0.5
        packed = _pack_bits(flags)
        assert packed.numel() == (n + 7) // 8
        back, clean = _unpack_bits(packed, n)
        assert torch.equal(back, flags) and clean
    assert _pack_bits(torch.tensor([True, False, False, True])).tolist() == [0b1001]


@settings(max_examples=40, deadline=None)
@given(
    shape=st.lists(st.integers(0, 9), min_size=0, max_size=3),
    dtype=st.sampled_from(DTYPES),
    sparsity=st.floats(0, 1),
    seed=st.integers(0, 2**16),
)
def test_round_trip_property(tmp_path_factory, shape, dtype, sparsity, seed):
    path = str(tmp_path_factory.mktemp("h") / "c.safetensors")
    t = random_tensor(tuple(shape), dtype, sparsity, seed)
    save_compressed({"t": t}, path)
    assert bit_equal(load_compressed(path)["t"], t)


# --------------------------------------------------------------------------- #
# models: pruned-and-removed, and still carrying name_orig / name_mask
# --------------------------------------------------------------------------- #
def small_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 48), nn.ReLU(), nn.BatchNorm1d(48), nn.Linear(48, 10))


def test_pruned_model_with_reparameterization_round_trips(path):
    model = small_model()
    prune.l1_unstructured(model[0], "weight", amount=0.9)
    prune.random_unstructured(model[3], "weight", amount=0.5)
    sd = model.state_dict()
    assert "0.weight_orig" in sd and "0.weight_mask" in sd
    save_compressed(model, path)
    out = load_compressed(path)
    assert list(out) == list(sd)
    for k in sd:
        assert bit_equal(out[k], sd[k]), k
    # the masks are kept: a model pruned the same way loads it and computes the same
    fresh = small_model()
    prune.identity(fresh[0], "weight")
    prune.identity(fresh[3], "weight")
    fresh.load_state_dict(out)
    assert torch.equal(fresh[0].weight_mask, model[0].weight_mask)
    model.eval(), fresh.eval()
    x = torch.randn(5, 64)
    assert torch.equal(fresh(x), model(x))
    assert torch.equal(fresh[0].weight, model[0].weight)


def test_bool_masks_round_trip(path):
    model = small_model()
    mask = torch.rand(48, 64, generator=torch.Generator().manual_seed(1)) < 0.3
    prune.custom_from_mask(model[0], "weight", mask)
    sd = dict(model.state_dict())
    sd["0.weight_mask"] = sd["0.weight_mask"].bool()  # what a lean-mask user stores
    save_compressed(sd, path)
    out = load_compressed(path)
    assert out["0.weight_mask"].dtype == torch.bool
    assert torch.equal(out["0.weight_mask"], mask)


def test_removed_model_round_trips_and_compresses(tmp_path):
    model = small_model()
    prune.l1_unstructured(model[0], "weight", amount=0.9)
    prune.remove(model[0], "weight")
    path = str(tmp_path / "m.safetensors")
    save_compressed(model, path)
    out = load_compressed(path)
    fresh = small_model()
    fresh.load_state_dict(out)
    for k, v in model.state_dict().items():
        assert bit_equal(fresh.state_dict()[k], v), k
    dense_path = str(tmp_path / "d.safetensors")
    safetensors.torch.save_file(model.state_dict(), dense_path)
    assert os.path.getsize(path) < 0.6 * os.path.getsize(dense_path)


def test_signed_zeros_from_masking(tmp_path):
    """``w * mask`` leaves -0.0 where a negative weight was pruned; the sign is kept by default."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(128, 128, generator=g)
    mask = (torch.rand(128, 128, generator=g) >= 0.9).float()
    pruned = w * mask
    n_neg_zero = int(((pruned == 0) & torch.signbit(pruned)).sum())
    assert n_neg_zero > 1000
    exact, lean = str(tmp_path / "exact.safetensors"), str(tmp_path / "lean.safetensors")
    save_compressed({"w": pruned}, exact)
    save_compressed({"w": pruned}, lean, keep_zero_sign=False)
    assert bit_equal(load_compressed(exact)["w"], pruned)
    out = load_compressed(lean)["w"]
    assert torch.equal(out, pruned) and not bool(torch.signbit(out[out == 0]).any())
    zeros = 128 * 128 - int(mask.sum())
    # the sign record costs one bit per zero element, and nothing more
    assert 0 <= os.path.getsize(exact) - os.path.getsize(lean) - (zeros + 7) // 8 <= 200
    with safetensors.safe_open(exact, "pt") as f:
        index = json.loads(f.metadata()["prunekit.index"])["tensors"]
    assert index[0]["neg_zeros"] == n_neg_zero


def test_drop_masked_values_keeps_effective_weights_and_shrinks(tmp_path):
    model = small_model()
    prune.l1_unstructured(model[0], "weight", amount=0.9)
    keep, drop = str(tmp_path / "keep.safetensors"), str(tmp_path / "drop.safetensors")
    save_compressed(model, keep)
    save_compressed(model, drop, drop_masked_values=True)
    assert os.path.getsize(drop) < 0.5 * os.path.getsize(keep)
    out = load_compressed(drop)
    assert torch.equal(out["0.weight_mask"], model[0].weight_mask)
    assert torch.equal(out["0.weight_orig"] * out["0.weight_mask"], model[0].weight.detach())
    assert int((out["0.weight_orig"] != 0).sum()) == int((model[0].weight != 0).sum())
    # the model itself was not touched
    assert int((model[0].weight_orig != 0).sum()) == 48 * 64


def test_non_cpu_layouts_and_shared_tensors(path):
    w = random_tensor((20, 20), torch.float32, 0.9)
    sd = {"a": w, "tied": w, "view": w.t(), "coo": w.to_sparse()}
    save_compressed(sd, path)
    out = load_compressed(path)
    assert bit_equal(out["a"], w) and bit_equal(out["tied"], w)
    assert bit_equal(out["view"], w.t().contiguous())
    assert out["coo"].layout == torch.strided and bit_equal(out["coo"], sd["coo"].to_dense())


# --------------------------------------------------------------------------- #
# damaged files never give wrong weights
# --------------------------------------------------------------------------- #
def _saved_bytes(path):
    sd = {
        "w": random_tensor((16, 16), torch.float32, 0.9),
        "m": (random_tensor((16, 16), torch.float32, 0.5) != 0).float(),
        "d": random_tensor((4,), torch.float16, 0.0),
    }
    save_compressed(sd, path)
    with open(path, "rb") as f:
        return sd, f.read()


def test_every_flipped_byte_is_detected_or_harmless(path):
    sd, data = _saved_bytes(path)
    header_len = struct.unpack("<Q", data[:8])[0]
    detected = 0
    for pos in range(len(data)):
        damaged = bytearray(data)
        damaged[pos] ^= 0xFF
        with open(path, "wb") as f:
            f.write(damaged)
        try:
            out = load_compressed(path)
        except CorruptCheckpointError:
            detected += 1
            continue
        # a flip that goes unnoticed must not have changed a single weight
        assert list(out) == list(sd), pos
        for k in sd:
            assert bit_equal(out[k], sd[k]), (pos, k)
    # every byte of the tensor data is covered by a checksum
    assert detected >= len(data) - 8 - header_len


def test_flipped_data_byte_message(path):
    _, data = _saved_bytes(path)
    damaged = bytearray(data)
    damaged[-1] ^= 0x01
    with open(path, "wb") as f:
        f.write(damaged)
    with pytest.raises(CorruptCheckpointError, match="damaged"):
        load_compressed(path)


def test_every_truncation_is_detected(path):
    _, data = _saved_bytes(path)
    for length in range(0, len(data), max(1, len(data) // 200)):
        with open(path, "wb") as f:
            f.write(data[:length])
        with pytest.raises(CorruptCheckpointError):
            load_compressed(path)
    with open(path, "wb") as f:
        f.write(data[:-1])
    with pytest.raises(CorruptCheckpointError, match="truncated"):
        load_compressed(path)


def test_plain_safetensors_file_is_refused(path):
    safetensors.torch.save_file({"w": torch.zeros(3)}, path)
    with pytest.raises(CorruptCheckpointError, match="not a prunekit compressed checkpoint"):
        load_compressed(path)


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="no file"):
        load_compressed(str(tmp_path / "nope.safetensors"))


# --------------------------------------------------------------------------- #
# user errors
# --------------------------------------------------------------------------- #
def test_bad_inputs_raise_and_leave_existing_file_alone(path):
    save_compressed({"w": torch.ones(3)}, path)
    with open(path, "rb") as f:
        before = f.read()
    with pytest.raises(TypeError, match="'step' is a int"):
        save_compressed({"w": torch.zeros(3), "step": 3}, path)
    with pytest.raises(ValueError, match="reserves"):
        save_compressed({"w::bitmask": torch.zeros(3)}, path)
    with pytest.raises(TypeError, match="nn.Module or a state dict"):
        save_compressed([torch.zeros(3)], path)
    q = torch.quantize_per_tensor(torch.ones(4), 0.1, 0, torch.qint8)
    with pytest.raises(TypeError, match="'q' is quantized"):
        save_compressed({"q": q}, path)
    with open(path, "rb") as f:
        assert f.read() == before
    assert [p for p in os.listdir(os.path.dirname(path)) if p.startswith(".prunekit-")] == []


# --------------------------------------------------------------------------- #
# a key means "authenticated files only": nothing is unpickled before the check
# --------------------------------------------------------------------------- #
class _Payload:
    """Unpickling it creates a folder: proof that the file's code ran."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def _pickle_payload(tmp_path):
    marker = str(tmp_path / "the-pickle-ran")
    path = str(tmp_path / "evil.pt")
    torch.save({"w": torch.ones(2), "x": _Payload(marker)}, path)
    return path, marker


def test_a_key_refuses_a_torch_file_before_unpickling_it_even_with_trust_pickle(tmp_path):
    from prunekit.io import CheckpointSignatureError, read_checkpoint
    from prunekit.io.checkpoint import read_torch
    from prunekit.io.formats import read

    path, marker = _pickle_payload(tmp_path)
    for call in (lambda: read_checkpoint(path, key=b"k" * 32, trust_pickle=True),
                 lambda: read_checkpoint(path, key=b"k" * 32),
                 lambda: read_torch(path, key=b"k" * 32, trust_pickle=True),
                 lambda: read(path, key=b"k" * 32, trust_pickle=True),
                 lambda: read(path, format="torch", key=b"k" * 32, trust_pickle=True)):
        with pytest.raises(CheckpointSignatureError, match=r"evil.pt: a key was given, but this torch file carries "
                                                          r"no signature"):
            call()
        assert not os.path.exists(marker)
    # the same file without a key: refused without trust, and (the proof the payload is real) run with it
    with pytest.raises(ValueError, match="needs full unpickling"):
        read_checkpoint(path)
    assert not os.path.exists(marker)
    read_checkpoint(path, trust_pickle=True)
    assert os.path.isdir(marker)


def test_a_key_refuses_plain_safetensors_before_reading_it(tmp_path, monkeypatch):
    from prunekit.io import CheckpointSignatureError, read_checkpoint
    from prunekit.io import checkpoint

    p = str(tmp_path / "plain.safetensors")
    safetensors.torch.save_file({"w": torch.zeros(3)}, p)
    reads = []
    monkeypatch.setattr(checkpoint, "read_safetensors", lambda *a, **k: reads.append(a))
    for call in (lambda: read_checkpoint(p, key=b"k"), lambda: checkpoint.read_plain_safetensors(p, key=b"k")):
        with pytest.raises(CheckpointSignatureError, match="this safetensors file carries no signature"):
            call()
    assert reads == []
