"""The codec of prunekit's compressed checkpoints: one tensor to its stored parts and back.

Encodings, tensor by tensor, whichever is smallest: ``dense`` (the tensor as
is), ``sparse`` (a packed bitmask of the non-zero elements, one bit per
element, least-significant bit first, plus their values; where the tensor
holds ``-0.0``, a second bitmask over the zero elements records which are
negative) and ``binary`` (the bitmask alone: every non-zero element is one, a
pruning mask). Elements are compared as integer words of their bytes, so NaN
payloads and the sign of zero survive: the round trip is bit-exact for every
dtype. Dtypes that safetensors has no tag for are stored as raw bytes
(``storage="raw"``) and re-typed on load.

This module also holds the format's names (metadata keys, stored-entry
suffixes), its index signature (HMAC-SHA-256) and the checksum of a tensor;
:mod:`.writer` and :mod:`.reader` build on it.
"""

from __future__ import annotations

import ctypes
import hashlib
import hmac
import json
import math
from typing import Any, Dict, List, Optional, Tuple

import torch

from ..errors import CorruptCheckpointError
from ..reader import SAFETENSORS_TAGS

FORMAT_NAME = "prunekit-compressed"
FORMAT_VERSION = 1
_FORMAT_TAG = f"{FORMAT_NAME}/{FORMAT_VERSION}"
_META_FORMAT = "prunekit.format"
_META_INDEX = "prunekit.index"
_META_INDEX_SHA = "prunekit.index_sha256"
_META_HMAC = "prunekit.index_hmac"
_META_KEYS = (_META_FORMAT, _META_INDEX, _META_INDEX_SHA, _META_HMAC)
_BITMASK_SUFFIX = "::bitmask"
_VALUES_SUFFIX = "::values"
_SIGNS_SUFFIX = "::zero_signs"
_RESERVED = (_BITMASK_SUFFIX, _VALUES_SUFFIX, _SIGNS_SUFFIX)
# A rough cost of one extra safetensors entry (its JSON header line), so that
# tiny tensors are not split in two for a saving the header eats again.
_ENTRY_OVERHEAD = 96

_TAGS = SAFETENSORS_TAGS
_TAG_OF = {v: k for k, v in _TAGS.items()}


# --------------------------------------------------------------------------- #
# pure tensor helpers
# --------------------------------------------------------------------------- #
def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _damaged(message: str) -> "CorruptCheckpointError":
    return CorruptCheckpointError(f"{message} — the file is damaged or was not written by prunekit")


_QUANTIZED = frozenset(getattr(torch, n) for n in ("qint8", "quint8", "qint32", "quint4x2", "quint2x4")
                       if hasattr(torch, n))


def _dtype_from_name(name: Any, where: str) -> torch.dtype:
    """The torch dtype an index names (its canonical spelling only), or a CorruptCheckpointError."""
    dtype = getattr(torch, name, None) if isinstance(name, str) and name.isidentifier() else None
    if not isinstance(dtype, torch.dtype) or _dtype_name(dtype) != name or dtype in _QUANTIZED:
        raise _damaged(f"{where}: unknown dtype {name!r} in the checkpoint index")
    try:
        size = torch.empty(0, dtype=dtype).element_size()
    except (RuntimeError, TypeError):
        raise _damaged(f"{where}: dtype {name!r} cannot be stored") from None
    if size not in _WORD:
        raise _damaged(f"{where}: dtype {name!r} has {size}-byte elements, which prunekit never stores")
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


# --------------------------------------------------------------------------- #
# signature
# --------------------------------------------------------------------------- #
def _key_bytes(key: Any) -> bytes:
    if isinstance(key, str):
        key = key.encode("utf-8")
    if not isinstance(key, (bytes, bytearray, memoryview)):
        raise TypeError(f"key: expected bytes or str, got {type(key).__name__}; e.g. key=os.urandom(32)")
    key = bytes(key)
    if not key:
        raise ValueError("key: an empty key authenticates nothing; give a secret, e.g. key=os.urandom(32)")
    return key


def _signature(key: bytes, index_json: str) -> str:
    return hmac.new(key, f"{_FORMAT_TAG}\n{index_json}".encode("utf-8"), hashlib.sha256).hexdigest()


def _metadata(index: List[Dict[str, Any]], secret: Optional[bytes]) -> Dict[str, str]:
    """The safetensors metadata of a file whose index entries are ``index``: format, index, its checksum
    and, with a secret, its signature."""
    index_json = json.dumps({"version": FORMAT_VERSION, "tensors": index}, separators=(",", ":"))
    metadata = {
        _META_FORMAT: _FORMAT_TAG,
        _META_INDEX: index_json,
        _META_INDEX_SHA: hashlib.sha256(index_json.encode("utf-8")).hexdigest(),
    }
    if secret is not None:
        metadata[_META_HMAC] = _signature(secret, index_json)
    return metadata


# --------------------------------------------------------------------------- #
# decoding (of an index entry the reader has validated)
# --------------------------------------------------------------------------- #
class _Plan:
    """One validated index entry: what to read (stored key -> expected tag and shape) and how to rebuild."""

    __slots__ = ("name", "dtype", "shape", "numel", "encoding", "storage", "nnz", "neg_zeros", "sha256", "parts", "of")
    name: str
    dtype: Optional[torch.dtype]  # None for an alias, as are shape, storage, nnz, neg_zeros and sha256
    shape: Optional[List[int]]
    numel: int
    encoding: str  # "dense", "sparse", "binary" or "alias"
    storage: Optional[str]  # "native" or "raw"; None for "binary"
    nnz: Optional[int]  # None for "dense"
    neg_zeros: Optional[int]  # None unless a "sparse" entry stores zero signs
    sha256: Optional[str]
    parts: Dict[str, Tuple[str, List[int]]]  # stored key -> (safetensors tag, shape)
    of: Optional[str]  # the name of the tensor an alias is; None exactly when the encoding is not "alias"

    def __init__(self, **kw: Any) -> None:
        self.of = None  # the entry an alias (a tied tensor) is
        for k, v in kw.items():
            setattr(self, k, v)


def _from_storable(stored: torch.Tensor, storage: Optional[str], dtype: torch.dtype) -> torch.Tensor:
    return stored.view(dtype) if storage == "raw" else stored


def _decode(plan: _Plan, get: Any, path: str) -> torch.Tensor:
    where = f"{path}: tensor {plan.name!r}"
    dtype, shape, numel, nnz = plan.dtype, plan.shape, plan.numel, plan.nnz
    assert dtype is not None and shape is not None, "an alias has nothing to decode"
    if plan.encoding == "dense":
        out = _from_storable(get(plan.name), plan.storage, dtype).reshape(shape)
    else:
        assert nnz is not None, "the reader sets nnz of every bitmask entry"
        flags, padding_clean = _unpack_bits(get(plan.name + _BITMASK_SUFFIX), numel)
        found = int(torch.count_nonzero(flags))
        if found != nnz or not padding_clean:
            raise _damaged(f"{where}: bitmask marks {found} non-zeros, the index says {nnz}")
        template = torch.zeros(numel, dtype=dtype)
        words = _words(template)
        if plan.encoding == "binary":
            one = _one_word(dtype)
            assert one is not None, "the reader refuses a binary entry of a dtype without a one"
            words.masked_scatter_(flags.unsqueeze(1), one.expand(nnz, -1))
        else:
            values = _from_storable(get(plan.name + _VALUES_SUFFIX), plan.storage, dtype)
            words.masked_scatter_(flags.unsqueeze(1), _words(values.contiguous()))
            if plan.neg_zeros is not None:
                neg_zero = _neg_zero_word(dtype)
                assert neg_zero is not None, "the reader refuses zero signs of a dtype without -0.0"
                sign_flags, sign_clean = _unpack_bits(get(plan.name + _SIGNS_SUFFIX), numel - nnz)
                if int(torch.count_nonzero(sign_flags)) != plan.neg_zeros or not sign_clean:
                    raise _damaged(f"{where}: zero-sign bitmask does not match the index")
                negative = torch.zeros(numel, dtype=torch.bool).masked_scatter_(~flags, sign_flags)
                for j in range(words.shape[1]):
                    words[:, j].masked_fill_(negative, neg_zero[j])
        out = template.reshape(shape)
    if _sha256(out) != plan.sha256:
        raise _damaged(f"{where}: checksum mismatch")
    return out
