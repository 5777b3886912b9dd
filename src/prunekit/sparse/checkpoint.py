"""Compressed checkpoints for pruned models.

A pruned tensor is mostly zeros. :func:`save_compressed` stores each such
tensor as a packed bitmask (one bit per element: zero or not) plus its
non-zero values; a tensor whose non-zero elements are all exactly one (a
pruning mask) is stored as the bitmask alone; every other tensor stays dense.
Whichever encoding is smallest wins, tensor by tensor.

The container is a `safetensors <https://github.com/huggingface/safetensors>`_
file: no pickle, safe to open when it comes from a stranger. Its metadata holds
an index (name, encoding, dtype, shape, number of non-zeros and a SHA-256 of
the original bytes of every tensor) and a SHA-256 of that index.
:func:`load_compressed` checks the file's structure, the index checksum, the
bitmask population against the stored count, and the checksum of every
rebuilt tensor; any mismatch raises :class:`CorruptCheckpointError` — a
damaged file never yields wrong weights.

The round trip is bit-exact for every dtype (float64/32/16, bfloat16, float8
variants, complex, every integer width, bool): NaN payloads are kept as values,
and ``-0.0`` — which ``w * mask`` leaves wherever a negative weight was pruned
— is restored from one extra bit per zero element, stored only for tensors
that hold one (``keep_zero_sign=False`` stores it as ``0.0`` instead, for a
smaller file). Dtypes that safetensors has no tag for
(complex128, sub-byte types, ...) are stored as raw bytes and re-typed on load.

Needs the ``safetensors`` package (``pip install prunekit[io]``).
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import logging
import math
import os
import tempfile
from collections import OrderedDict
from typing import Any, Dict, List, Mapping, Optional, Tuple, Union

import torch
from torch import nn

from .. import reparam
from .._backend import require_torch

__all__ = ["save_compressed", "load_compressed", "CorruptCheckpointError", "FORMAT_NAME"]

logger = logging.getLogger(__name__)

FORMAT_NAME = "prunekit-compressed"
FORMAT_VERSION = 1
_META_FORMAT = "prunekit.format"
_META_INDEX = "prunekit.index"
_META_INDEX_SHA = "prunekit.index_sha256"
_BITMASK_SUFFIX = "::bitmask"
_VALUES_SUFFIX = "::values"
_SIGNS_SUFFIX = "::zero_signs"
_RESERVED = (_BITMASK_SUFFIX, _VALUES_SUFFIX, _SIGNS_SUFFIX)
# A rough cost of one extra safetensors entry (its JSON header line), so that
# tiny tensors are not split in two for a saving the header eats again.
_ENTRY_OVERHEAD = 96

PathLike = Union[str, "os.PathLike[str]"]


class CorruptCheckpointError(ValueError):
    """The compressed checkpoint is damaged, truncated or not a prunekit file.

    Example:
        >>> import os, tempfile, torch
        >>> from prunekit.sparse import save_compressed, load_compressed, CorruptCheckpointError
        >>> path = os.path.join(tempfile.mkdtemp(), "m.safetensors")
        >>> save_compressed({"w": torch.ones(64)}, path)
        >>> with open(path, "r+b") as f:
        ...     _ = f.truncate(os.path.getsize(path) - 3)
        >>> try:
        ...     load_compressed(path)
        ... except CorruptCheckpointError as e:
        ...     print("damaged" in str(e))
        True
    """


# --------------------------------------------------------------------------- #
# safetensors access (optional dependency)
# --------------------------------------------------------------------------- #
def _safetensors() -> Tuple[Any, Any]:
    try:
        import safetensors
        import safetensors.torch as st
    except ImportError as exc:  # pragma: no cover - exercised only without the extra
        raise ImportError(
            "prunekit's compressed checkpoints need the 'safetensors' package; "
            "install it with `pip install prunekit[io]` (or `pip install safetensors`)."
        ) from exc
    return safetensors, st


def _safetensors_dtypes() -> frozenset:
    _, st = _safetensors()
    table = getattr(st, "_TYPES", None)
    if isinstance(table, dict) and table:
        return frozenset(table.values())
    return frozenset(  # the set every safetensors >= 0.4 knows
        {torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64,
         torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool}
    )


# --------------------------------------------------------------------------- #
# pure tensor helpers
# --------------------------------------------------------------------------- #
def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _damaged(message: str) -> "CorruptCheckpointError":
    return CorruptCheckpointError(f"{message} — the file is damaged or was not written by prunekit")


def _dtype_from_name(name: str, where: str) -> torch.dtype:
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise _damaged(f"{where}: unknown dtype {name!r} in the checkpoint index")
    return dtype


def _raw_bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a CPU tensor as a flat uint8 tensor (no copy when contiguous)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _sha256(t: torch.Tensor) -> str:
    raw = _raw_bytes(t)
    h = hashlib.sha256()
    n = raw.numel()
    if n:
        buf = (ctypes.c_char * n).from_address(raw.data_ptr())
        h.update(memoryview(buf))
    return h.hexdigest()


_WORD = {1: (torch.uint8, 1), 2: (torch.int16, 1), 4: (torch.int32, 1), 8: (torch.int64, 1), 16: (torch.int64, 2)}


def _words(t: torch.Tensor) -> torch.Tensor:
    """View a tensor's elements as rows of integer words: shape ``(numel, k)``."""
    size = t.element_size()
    if size not in _WORD:
        raise TypeError(f"dtype {t.dtype} has an element size of {size} bytes, which prunekit cannot store")
    word, k = _WORD[size]
    return _raw_bytes(t).view(word).reshape(t.numel(), k)


# Multiplying eight little-endian 0/1 bytes (one int64) by this constant
# gathers them, lowest byte first, into the top byte of the product.
_GATHER_BITS = 0x0102040810204080


def _pack_bits(flags: torch.Tensor) -> torch.Tensor:
    """Pack a flat bool tensor into uint8, least-significant bit first."""
    n = flags.numel()
    padded = torch.zeros(math.ceil(n / 8) * 8, dtype=torch.uint8)
    padded[:n] = flags.reshape(-1)
    gathered = padded.view(torch.int64).mul(_GATHER_BITS).bitwise_right_shift(56).bitwise_and(0xFF)
    return gathered.to(torch.uint8)


def _unpack_bits(packed: torch.Tensor, n: int) -> Tuple[torch.Tensor, bool]:
    """Inverse of :func:`_pack_bits`; also says whether the padding bits are all zero."""
    shifts = torch.arange(8, dtype=torch.uint8)
    bits = packed.reshape(-1, 1).bitwise_right_shift(shifts).bitwise_and_(1).reshape(-1)
    return bits[:n].view(torch.bool), not bool(bits[n:].any())


def _one_word(dtype: torch.dtype) -> Optional[torch.Tensor]:
    """The bit pattern of the value one in ``dtype`` (None when it has none)."""
    try:
        return _words(torch.ones(1, dtype=dtype))[0]
    except (RuntimeError, TypeError):
        return None


def _neg_zero_word(dtype: torch.dtype) -> Optional[torch.Tensor]:
    """The bit pattern of ``-0.0`` in a real floating dtype that has one, else None."""
    if not dtype.is_floating_point:
        return None
    try:
        word = _words(torch.tensor([-0.0]).to(dtype))[0]
    except (RuntimeError, TypeError):
        return None
    return word if bool(word.ne(0).any()) else None


def _row_eq(words: torch.Tensor, word: torch.Tensor) -> torch.Tensor:
    return words.eq(word).all(dim=1)


# --------------------------------------------------------------------------- #
# encoding
# --------------------------------------------------------------------------- #
def _as_storable(t: torch.Tensor, native: frozenset) -> Tuple[torch.Tensor, str]:
    """A tensor safetensors can hold: the tensor itself, or its raw bytes."""
    if t.dtype in native:
        return t.contiguous(), "native"
    return _raw_bytes(t).clone(), "raw"


def _encode(
    name: str, t: torch.Tensor, native: frozenset, keep_zero_sign: bool
) -> Tuple[Dict[str, Any], Dict[str, torch.Tensor]]:
    """Choose the smallest encoding of ``t``; return (index entry, stored tensors).

    Encodings: ``dense`` (as is), ``sparse`` (bitmask of the non-zero elements
    plus their values; where the tensor holds ``-0.0``, a second bitmask over
    the zero elements records which are negative), ``binary`` (bitmask alone,
    every marked element is one).
    """
    if t.is_quantized:
        raise TypeError(
            f"save_compressed: tensor {name!r} is quantized ({t.dtype}); quantized tensors are "
            "not supported. Save the float model, or use torch.save for quantized modules."
        )
    if t.layout != torch.strided:
        t = t.to_dense()
    t = t.detach().to("cpu").contiguous()
    numel, item = t.numel(), t.element_size()
    neg_zero = _neg_zero_word(t.dtype) if numel else None
    if neg_zero is not None and not keep_zero_sign:
        words = _words(t)
        is_neg_zero = _row_eq(words, neg_zero)
        if bool(is_neg_zero.any()):
            t = t.clone()
            _words(t)[is_neg_zero] = 0
    entry: Dict[str, Any] = {
        "name": name,
        "dtype": _dtype_name(t.dtype),
        "shape": list(t.shape),
        "sha256": _sha256(t),
    }
    dense_cost = numel * item
    if numel:
        words = _words(t)
        zero = words.eq(0).all(dim=1)
        is_neg_zero = _row_eq(words, neg_zero) if neg_zero is not None else torch.zeros_like(zero)
        n_neg_zero = int(torch.count_nonzero(is_neg_zero))
        nonzero = ~(zero | is_neg_zero)
        nnz = int(torch.count_nonzero(nonzero))
        mask_cost = math.ceil(numel / 8) + _ENTRY_OVERHEAD
        sign_cost = math.ceil((numel - nnz) / 8) + _ENTRY_OVERHEAD if n_neg_zero else 0
        sparse_cost = mask_cost + nnz * item + _ENTRY_OVERHEAD + sign_cost
        one = _one_word(t.dtype)
        is_binary = (n_neg_zero == 0 and one is not None
                     and bool(torch.where(nonzero.unsqueeze(1), words.eq(one), True).all()))
        best = min(dense_cost, sparse_cost, mask_cost if is_binary else dense_cost)
        if best < dense_cost:
            entry["nnz"] = nnz
            stored = {name + _BITMASK_SUFFIX: _pack_bits(nonzero)}
            if is_binary and best == mask_cost:
                entry["encoding"] = "binary"
                return entry, stored
            entry["encoding"] = "sparse"
            values = torch.masked_select(words, nonzero.unsqueeze(1)).view(torch.uint8).view(t.dtype)
            values, storage = _as_storable(values, native)
            entry["storage"] = storage
            stored[name + _VALUES_SUFFIX] = values
            if n_neg_zero:
                entry["neg_zeros"] = n_neg_zero
                stored[name + _SIGNS_SUFFIX] = _pack_bits(torch.masked_select(is_neg_zero, ~nonzero))
            return entry, stored
    entry["encoding"] = "dense"
    dense, storage = _as_storable(t, native)
    entry["storage"] = storage
    return entry, {name: dense}


def _state_dict_of(obj: Union[nn.Module, Mapping[str, torch.Tensor]]) -> "OrderedDict[str, torch.Tensor]":
    if isinstance(obj, nn.Module):
        items = obj.state_dict().items()
    elif isinstance(obj, Mapping):
        items = obj.items()
    else:
        raise TypeError(
            f"save_compressed: expected an nn.Module or a state dict (a mapping of names to tensors), "
            f"got {type(obj).__name__}. Pass `model` or `model.state_dict()`."
        )
    out: "OrderedDict[str, torch.Tensor]" = OrderedDict()
    for key, value in items:
        if not isinstance(key, str):
            raise TypeError(f"save_compressed: state dict keys must be str, got {key!r} ({type(key).__name__})")
        if not isinstance(value, torch.Tensor):
            raise TypeError(
                f"save_compressed: state dict entry {key!r} is a {type(value).__name__}, not a tensor; "
                "only tensors can be stored (drop or convert that entry first)."
            )
        if key.endswith(_RESERVED):
            raise ValueError(
                f"save_compressed: state dict key {key!r} ends with a suffix prunekit reserves "
                f"{_RESERVED}; rename that entry before saving."
            )
        out[key] = value
    return out


def _drop_masked(sd: "OrderedDict[str, torch.Tensor]") -> "OrderedDict[str, torch.Tensor]":
    """Zero ``X_orig`` wherever ``X_mask`` is zero (the effective weight is unchanged)."""
    out = OrderedDict(sd)
    for key, value in sd.items():
        if not key.endswith("_orig"):
            continue
        mask_key = key[: -len("_orig")] + "_mask"
        mask = sd.get(mask_key)
        if mask is None or mask.shape != value.shape:
            continue
        # zero where masked, keep the rest: masked() with the mask's zeros only, so the
        # effective weight X_orig * X_mask is unchanged even for masks that scale
        out[key] = reparam.masked(value, mask != 0)
    return out


def save_compressed(
    model_or_state_dict: Union[nn.Module, Mapping[str, torch.Tensor]],
    path: PathLike,
    *,
    drop_masked_values: bool = False,
    keep_zero_sign: bool = True,
) -> None:
    """Save a (pruned) model or state dict as a compressed safetensors file.

    Sparse tensors are stored as a packed bitmask plus their non-zero values,
    pruning masks as a bitmask alone, everything else dense. The round trip
    through :func:`load_compressed` is bit-exact. The file is written to a
    temporary name and moved into place, so a failed save never leaves a
    half-written checkpoint at ``path``.

    Args:
        model_or_state_dict: an ``nn.Module`` (its ``state_dict()`` is saved) or
            a mapping of names to tensors. A model that still carries pruning
            reparameterizations is saved with its ``name_orig`` and
            ``name_mask`` entries. Tensors in a sparse layout (COO, CSR)
            are saved, and load, as ordinary strided tensors.
        path: file to write (by convention ending in ``.safetensors``).
        drop_masked_values: when True, every ``X_orig`` entry that has an
            ``X_mask`` partner is stored with zeros where the mask is zero.
            The pruned weights ``X_orig * X_mask`` are unchanged (up to the
            sign of zero) and the file is much smaller, but the values the
            mask hides are gone, so a mask cannot later be relaxed.

    Example:
        >>> import os, tempfile, torch
        >>> from prunekit.sparse import save_compressed, load_compressed
        >>> w = torch.randn(256, 256)
        >>> w[torch.rand_like(w) < 0.9] = 0
        >>> path = os.path.join(tempfile.mkdtemp(), "pruned.safetensors")
        >>> save_compressed({"weight": w}, path)
        >>> torch.equal(load_compressed(path)["weight"], w)
        True
        >>> os.path.getsize(path) < 0.2 * w.numel() * 4
        True
    """
    require_torch(model_or_state_dict, "prunekit.sparse (save_compressed)")
    _, st = _safetensors()
    native = _safetensors_dtypes()
    sd = _state_dict_of(model_or_state_dict)
    if drop_masked_values:
        sd = _drop_masked(sd)
    index: List[Dict[str, Any]] = []
    tensors: Dict[str, torch.Tensor] = {}
    for name, t in sd.items():
        entry, stored = _encode(name, t, native, keep_zero_sign)
        clash = set(stored) & set(tensors)
        if clash:
            raise ValueError(f"save_compressed: two entries would be stored under {sorted(clash)}; rename one")
        index.append(entry)
        tensors.update(stored)
    index_json = json.dumps({"version": FORMAT_VERSION, "tensors": index}, separators=(",", ":"))
    metadata = {
        _META_FORMAT: f"{FORMAT_NAME}/{FORMAT_VERSION}",
        _META_INDEX: index_json,
        _META_INDEX_SHA: hashlib.sha256(index_json.encode("utf-8")).hexdigest(),
    }
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".prunekit-", suffix=".tmp", dir=directory)
    os.close(fd)
    try:
        st.save_file(tensors, tmp, metadata=metadata)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    counts: Dict[str, int] = {}
    for e in index:
        counts[e["encoding"]] = counts.get(e["encoding"], 0) + 1
    logger.info("save_compressed: wrote %s (%d tensors: %s, %d bytes)", path, len(index), counts,
                os.path.getsize(path))


# --------------------------------------------------------------------------- #
# decoding
# --------------------------------------------------------------------------- #
def _from_storable(stored: torch.Tensor, storage: Any, dtype: torch.dtype, count: int, where: str) -> torch.Tensor:
    if storage == "native":
        if stored.dtype != dtype:
            raise _damaged(f"{where}: stored dtype {stored.dtype} does not match the index ({dtype})")
        return stored
    if storage == "raw":
        if stored.dtype != torch.uint8 or stored.dim() != 1:
            raise _damaged(f"{where}: raw entry has dtype {stored.dtype} and {stored.dim()} dims")
        item = torch.empty(0, dtype=dtype).element_size()
        if stored.numel() != count * item:
            raise CorruptCheckpointError(
                f"{where}: raw entry has {stored.numel()} bytes, expected {count * item}"
            )
        # a fresh (aligned) buffer: the mapped file may place raw bytes at any offset
        return stored.clone().view(dtype)
    raise _damaged(f"{where}: unknown storage kind {storage!r} in the index")


def _decode(entry: Mapping[str, Any], get: Any, path: str) -> Tuple[str, torch.Tensor]:
    name = entry.get("name")
    if not isinstance(name, str):
        raise _damaged(f"{path}: index entry without a name: {entry!r}")
    where = f"{path}: tensor {name!r}"
    dtype = _dtype_from_name(entry.get("dtype"), where)
    shape = entry.get("shape")
    if not isinstance(shape, list) or not all(isinstance(s, int) and s >= 0 for s in shape):
        raise _damaged(f"{where}: bad shape {shape!r} in the index")
    numel = math.prod(shape)
    encoding = entry.get("encoding")
    if encoding == "dense":
        stored = _from_storable(get(name), entry.get("storage"), dtype, numel, where)
        if stored.numel() != numel:
            raise _damaged(f"{where}: {stored.numel()} elements stored, the index says {numel}")
        out = stored.reshape(shape)
    elif encoding in ("sparse", "binary"):
        nnz = entry.get("nnz")
        if not isinstance(nnz, int) or not 0 <= nnz <= numel:
            raise _damaged(f"{where}: bad non-zero count {nnz!r} in the index")
        packed = get(name + _BITMASK_SUFFIX)
        if packed.dtype != torch.uint8 or packed.dim() != 1 or packed.numel() != math.ceil(numel / 8):
            raise CorruptCheckpointError(
                f"{where}: bitmask has shape {tuple(packed.shape)} and dtype {packed.dtype}, "
                f"expected ({math.ceil(numel / 8)},) uint8"
            )
        flags, padding_clean = _unpack_bits(packed, numel)
        found = int(torch.count_nonzero(flags))
        if found != nnz or not padding_clean:
            raise _damaged(f"{where}: bitmask marks {found} non-zeros, the index says {nnz}")
        template = torch.zeros(numel, dtype=dtype)
        words = _words(template)
        if encoding == "binary":
            one = _one_word(dtype)
            if one is None:
                raise _damaged(f"{where}: dtype {dtype} cannot hold a binary mask")
            words.masked_scatter_(flags.unsqueeze(1), one.expand(nnz, -1))
        else:
            values = _from_storable(get(name + _VALUES_SUFFIX), entry.get("storage"), dtype, nnz, where)
            if values.numel() != nnz:
                raise _damaged(f"{where}: {values.numel()} values stored, the index says {nnz}")
            words.masked_scatter_(flags.unsqueeze(1), _words(values.contiguous()))
            n_neg = entry.get("neg_zeros")
            if n_neg is not None:
                neg_zero = _neg_zero_word(dtype)
                signs = get(name + _SIGNS_SUFFIX)
                zeros = numel - nnz
                if (neg_zero is None or not isinstance(n_neg, int) or signs.dtype != torch.uint8
                        or signs.dim() != 1 or signs.numel() != math.ceil(zeros / 8)):
                    raise _damaged(f"{where}: bad zero-sign record")
                sign_flags, sign_clean = _unpack_bits(signs, zeros)
                if int(torch.count_nonzero(sign_flags)) != n_neg or not sign_clean:
                    raise _damaged(f"{where}: zero-sign bitmask does not match the index")
                negative = torch.zeros(numel, dtype=torch.bool).masked_scatter_(~flags, sign_flags)
                for j in range(words.shape[1]):
                    words[:, j].masked_fill_(negative, neg_zero[j])
        out = template.reshape(shape)
    else:
        raise _damaged(f"{where}: unknown encoding {encoding!r} in the index")
    if _sha256(out) != entry.get("sha256"):
        raise _damaged(f"{where}: checksum mismatch")
    return name, out.clone() if encoding == "dense" else out


def load_compressed(path: PathLike, *, device: Union[str, torch.device] = "cpu") -> "OrderedDict[str, torch.Tensor]":
    """Load a checkpoint written by :func:`save_compressed` as a state dict.

    Every tensor is rebuilt bit-exactly and checked against the SHA-256 stored
    at save time. The result holds the same keys in the same order as the
    saved state dict, so ``model.load_state_dict(load_compressed(path))``
    restores a model of the same structure (a pruned checkpoint, with its
    ``name_orig``/``name_mask`` keys, loads into a model pruned the same way).

    Args:
        path: a file written by :func:`save_compressed`.
        device: where to put the loaded tensors.

    Raises:
        CorruptCheckpointError: (a ``ValueError``) the file is truncated,
            damaged, or not a prunekit compressed checkpoint.
        FileNotFoundError: no file at ``path``.

    Example:
        >>> import os, tempfile, torch
        >>> from prunekit.sparse import save_compressed, load_compressed
        >>> model = torch.nn.Linear(8, 4)
        >>> path = os.path.join(tempfile.mkdtemp(), "m.safetensors")
        >>> save_compressed(model, path)
        >>> sd = load_compressed(path)
        >>> list(sd), torch.equal(sd["weight"], model.weight)
        (['weight', 'bias'], True)
    """
    safetensors, _ = _safetensors()
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"load_compressed: no file at {path!r}")
    damaged = f"{path}: the file is damaged, truncated or not a safetensors file"
    try:
        handle = safetensors.safe_open(path, framework="pt", device="cpu")
    except Exception as exc:  # safetensors raises its own error types for bad headers
        raise CorruptCheckpointError(f"{damaged} ({exc})") from exc
    with handle as f:
        try:
            meta = f.metadata() or {}
            keys = set(f.keys())
        except Exception as exc:
            raise CorruptCheckpointError(f"{damaged} ({exc})") from exc
        fmt = meta.get(_META_FORMAT)
        if fmt is None:
            raise CorruptCheckpointError(
                f"{path}: not a prunekit compressed checkpoint (no {_META_FORMAT!r} metadata); "
                "load plain safetensors files with safetensors.torch.load_file"
            )
        if fmt != f"{FORMAT_NAME}/{FORMAT_VERSION}":
            raise _damaged(f"{path}: unsupported checkpoint format {fmt!r}")
        index_json = meta.get(_META_INDEX, "")
        if hashlib.sha256(index_json.encode("utf-8")).hexdigest() != meta.get(_META_INDEX_SHA):
            raise _damaged(f"{path}: index checksum mismatch")
        try:
            entries = json.loads(index_json)["tensors"]
        except (ValueError, KeyError, TypeError) as exc:
            raise _damaged(f"{path}: unreadable index ({exc})") from exc

        def get(key: str) -> torch.Tensor:
            if key not in keys:
                raise _damaged(f"{path}: entry {key!r} named in the index is missing")
            try:
                return f.get_tensor(key)
            except Exception as exc:
                raise CorruptCheckpointError(f"{damaged}: cannot read {key!r} ({exc})") from exc

        out: "OrderedDict[str, torch.Tensor]" = OrderedDict()
        for entry in entries:
            if not isinstance(entry, dict):
                raise _damaged(f"{path}: bad index entry {entry!r}")
            name, tensor = _decode(entry, get, path)
            out[name] = tensor if torch.device(device).type == "cpu" else tensor.to(device)
    logger.info("load_compressed: read %d tensors from %s", len(out), path)
    return out
