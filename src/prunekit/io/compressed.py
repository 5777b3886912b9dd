"""prunekit's compressed checkpoint format ("prunekit"): one entry of the encodings table.

A pruned tensor is mostly zeros. :func:`save_compressed` stores each such
tensor as a packed bitmask (one bit per element: zero or not) plus its
non-zero values; a tensor whose non-zero elements are all exactly one (a
pruning mask) is stored as the bitmask alone; every other tensor stays dense.
Whichever encoding is smallest wins, tensor by tensor.

The container is a `safetensors <https://github.com/huggingface/safetensors>`_
file written by the ``safetensors`` package: no pickle. Its metadata holds an
index (name, encoding, dtype, shape, number of non-zeros and a SHA-256 of the
original bytes of every tensor) and a SHA-256 of that index; with
``key=...`` also an HMAC-SHA-256 of the index, which authenticates the whole
file (the index pins every stored tensor's name, dtype, shape and checksum).

:func:`load_compressed` treats the file as hostile. Before decoding anything
it checks, through :mod:`prunekit.io.reader`, that the path is a regular
file, that the safetensors header fits the file (strict JSON, byte ranges that
match the shapes, do not overlap and cover the buffer) and that the index is
exactly what prunekit writes: known keys and types only, known dtypes and
encodings, each name once, and one stored tensor of exactly the expected
dtype and shape for each part of each entry, none missing, none extra. Any
failure -- and a bitmask population, a tensor checksum or a signature that
does not verify -- raises :class:`CorruptCheckpointError` (a ``ValueError``)
naming the path and the reason. A file that carries any of prunekit's
metadata keys or stored-entry suffixes is held to all of these rules, so a
flipped bit in a metadata key is an error, not a plain safetensors file.

Work and memory are linear in the file: each stored byte is read once; the
decoded tensors take at most ``8 x element size`` bytes per stored bitmask
byte (a bitmask expands to that) and the size of the stored values otherwise.
An index that names a tensor twice is refused before any tensor is read.

The round trip is bit-exact for every dtype (float64/32/16, bfloat16, float8
variants, complex, every integer width, bool): NaN payloads are kept as values,
and ``-0.0`` -- which ``w * mask`` leaves wherever a negative weight was pruned
-- is restored from one extra bit per zero element, stored only for tensors
that hold one (``keep_zero_sign=False`` stores it as ``0.0`` instead, for a
smaller file). Dtypes that safetensors has no tag for (complex128, ...) are
stored as raw bytes and re-typed on load.

Writing needs the ``safetensors`` package (``pip install prunekit[io]``);
reading does not.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import hmac
import json
import logging
import math
import os
import shutil
import warnings
from collections import OrderedDict
from typing import Any, Callable, Dict, IO, List, Mapping, Optional, Tuple, Union

import torch

from .. import _sharded, reparam
from .._backend import require_torch
from .errors import CheckpointSignatureError, CorruptCheckpointError, UnreadableFileError
from .reader import (
    SAFETENSORS_TAGS,
    SafetensorsHeader,
    loads_json_strict,
    open_regular,
    read_safetensors_header,
    read_safetensors_tensor,
)
from .writer import PathLike, atomic_path, atomic_write, unnamed_file

__all__ = [
    "CompressedWriter",
    "drop_masked",
    "write_compressed",
    "load_compressed",
    "is_compressed_header",
    "CorruptCheckpointError",
    "CheckpointSignatureError",
    "UnverifiedSignatureWarning",
    "FORMAT_NAME",
]

logger = logging.getLogger(__name__)

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


class UnverifiedSignatureWarning(UserWarning):
    """A signed checkpoint was loaded without a key, so its signature was not checked."""


# --------------------------------------------------------------------------- #
# safetensors access (optional dependency, for writing)
# --------------------------------------------------------------------------- #
def _safetensors_torch() -> Any:
    try:
        import safetensors.torch as st
    except ImportError as exc:  # pragma: no cover - exercised only without the extra
        raise ImportError(
            "writing prunekit's compressed checkpoints needs the 'safetensors' package; "
            "install it with `pip install prunekit[io]` (or `pip install safetensors`)."
        ) from exc
    return st


def _safetensors_dtypes() -> frozenset:
    st = _safetensors_torch()
    table = getattr(st, "_TYPES", None)
    known = frozenset(table.values()) if isinstance(table, dict) and table else frozenset(_TAGS.values())
    return known & frozenset(_TAG_OF)  # dtypes both sides know


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


def _state_dict_of(obj: Any) -> "OrderedDict[str, torch.Tensor]":
    state_dict = getattr(obj, "state_dict", None)
    if callable(state_dict) and not isinstance(obj, Mapping):
        items = state_dict().items()
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


def drop_masked(sd: Mapping[str, torch.Tensor],
                apply: Optional[Callable[[str, torch.Tensor, torch.Tensor], Optional[torch.Tensor]]] = None
                ) -> "OrderedDict[str, torch.Tensor]":
    """``sd`` with every ``X_orig`` zeroed wherever its ``X_mask`` is zero (the effective weight is unchanged).

    ``apply(key, value, mask)`` applies one mask (default :func:`prunekit.reparam.masked` with the mask's
    zeros only, so kept values stay exact); :mod:`prunekit.distributed` passes its shard-local form.

    Examples:
        >>> import torch
        >>> sd = {"w_orig": torch.tensor([1.0, -2.0]), "w_mask": torch.tensor([0.0, 1.0])}
        >>> drop_masked(sd)["w_orig"].tolist()
        [0.0, -2.0]
    """
    apply = apply or (lambda _key, value, mask: reparam.masked(value.detach(), mask != 0))
    out = OrderedDict(sd)
    for key, value in sd.items():
        if not key.endswith("_orig"):
            continue
        mask = sd.get(key[: -len("_orig")] + "_mask")
        if mask is None or tuple(mask.shape) != tuple(value.shape):
            continue
        masked = apply(key, value, mask)
        if masked is not None:
            out[key] = masked
    return out


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


def write_compressed(
    model_or_state_dict: Any,
    path: PathLike,
    *,
    drop_masked_values: bool = False,
    keep_zero_sign: bool = True,
    key: Union[bytes, str, None] = None,
) -> None:
    """Save a (pruned) model or state dict as a prunekit compressed safetensors file.

    The writer of the ``"prunekit-compressed"`` entry of the table of encodings;
    :func:`prunekit.save_compressed` calls it for the default format.

    Sparse tensors are stored as a packed bitmask plus their non-zero values,
    pruning masks as a bitmask alone, everything else dense. The round trip
    through :func:`load_compressed` is bit-exact. The file is written by
    prunekit's atomic writer (:mod:`prunekit.io.writer`): a failed save never
    leaves a half-written checkpoint or a temporary file, a new file gets the
    umask's permissions, and a symlink at ``path`` keeps pointing at the new
    content.

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
        keep_zero_sign: store which zeros are ``-0.0`` (one bit per zero, only
            for tensors that hold one); False stores them as ``0.0``.
        key: a secret (bytes or str). When given, an HMAC-SHA-256 of the
            index is stored, and :func:`load_compressed` with the same key
            refuses a file that anyone without the key has altered.

    Examples:
        >>> import os, tempfile, torch
        >>> from prunekit.io.compressed import write_compressed, load_compressed
        >>> w = torch.randn(256, 256)
        >>> w[torch.rand_like(w) < 0.9] = 0
        >>> path = os.path.join(tempfile.mkdtemp(), "pruned.safetensors")
        >>> write_compressed({"weight": w}, path)
        >>> torch.equal(load_compressed(path)["weight"], w)
        True
        >>> os.path.getsize(path) < 0.2 * w.numel() * 4
        True
    """
    require_torch(model_or_state_dict, "prunekit.io (save_compressed)")
    secret = _key_bytes(key) if key is not None else None
    st = _safetensors_torch()
    native = _safetensors_dtypes()
    sd = _state_dict_of(model_or_state_dict)
    sharded = [k for k, v in sd.items() if _sharded.handler_for(v) is not None]
    if sharded:
        raise TypeError(
            f"save_compressed: {sharded[0]!r} (and {len(sharded) - 1} more) are DTensor shards; call "
            "prunekit.distributed.save_compressed(model, path) on every rank instead (it writes one file from "
            "rank 0, gathering one tensor at a time)"
        )
    if drop_masked_values:
        sd = drop_masked(sd)
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
        _META_FORMAT: _FORMAT_TAG,
        _META_INDEX: index_json,
        _META_INDEX_SHA: hashlib.sha256(index_json.encode("utf-8")).hexdigest(),
    }
    if secret is not None:
        metadata[_META_HMAC] = _signature(secret, index_json)
    with atomic_path(path) as tmp:
        st.save_file(tensors, tmp, metadata=metadata)
    counts: Dict[str, int] = {}
    for e in index:
        counts[e["encoding"]] = counts.get(e["encoding"], 0) + 1
    logger.info("save_compressed: wrote %s (%d tensors: %s%s)", os.fspath(path), len(index), counts,
                ", signed" if secret is not None else "")


class CompressedWriter:
    """Write a compressed checkpoint one tensor at a time: memory holds one tensor, never the model.

    :meth:`add` encodes a tensor exactly as :func:`write_compressed` does and
    appends the stored bytes to a spool file beside ``path`` (one per element
    size, so every stored tensor ends up aligned, as safetensors lays them
    out; a spool has no name in the folder, so even a killed process leaves
    none behind); :meth:`close` writes the safetensors container -- header, then the
    spooled bytes, streamed -- through the atomic writer. The file holds what
    :func:`write_compressed` writes for the same tensors (the stored tensors
    may come in another order) and :func:`load_compressed` reads it the same
    way. On an exception inside ``with`` (or :meth:`abort`) nothing is
    written and the spools are removed. For writers that produce tensors one
    by one, such as ``prunekit.distributed.save_compressed`` gathering a
    sharded model.

    Examples:
        >>> import os, tempfile, torch
        >>> path = os.path.join(tempfile.mkdtemp(), "pruned.safetensors")
        >>> w = torch.randn(64, 64)
        >>> w[w.abs() < 1] = 0
        >>> with CompressedWriter(path) as out:
        ...     out.add("weight", w)
        ...     out.add("bias", torch.ones(64))
        >>> loaded = load_compressed(path)
        >>> list(loaded), torch.equal(loaded["weight"], w)
        (['weight', 'bias'], True)
    """

    def __init__(self, path: PathLike, *, keep_zero_sign: bool = True, key: Union[bytes, str, None] = None) -> None:
        self.path = os.fspath(path)
        self.keep_zero_sign = keep_zero_sign
        self._secret = _key_bytes(key) if key is not None else None
        _safetensors_torch()  # the optional dependency, checked before any work
        self._native = _safetensors_dtypes()
        self._directory = os.path.dirname(os.path.abspath(self.path))
        self._spools: Dict[int, Any] = {}  # element size -> [unnamed file, bytes written]
        self._layout: Dict[str, Tuple[int, str, List[int], int, int]] = {}
        self._index: List[Dict[str, Any]] = []
        self._closed = False

    def _spool(self, size: int) -> List[Any]:
        spool = self._spools.get(size)
        if spool is None:
            # a file without a name (prunekit.io.writer.unnamed_file): nothing to leave behind, ever
            spool = self._spools[size] = [unnamed_file(self._directory), 0]
        return spool

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Encode ``tensor`` and append it under ``name`` (the state dict's key)."""
        if self._closed:
            raise ValueError(f"CompressedWriter({self.path!r}) is closed; open a new one")
        if not isinstance(name, str):
            raise TypeError(f"save_compressed: state dict keys must be str, got {name!r} ({type(name).__name__})")
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"save_compressed: state dict entry {name!r} is a {type(tensor).__name__}, not a tensor")
        if name.endswith(_RESERVED):
            raise ValueError(
                f"save_compressed: state dict key {name!r} ends with a suffix prunekit reserves "
                f"{_RESERVED}; rename that entry before saving."
            )
        entry, stored = _encode(name, tensor, self._native, self.keep_zero_sign)
        clash = set(stored) & set(self._layout)
        if clash or any(e["name"] == name for e in self._index):
            raise ValueError(f"save_compressed: two entries would be stored under {sorted(clash) or [name]}; "
                             "rename one")
        for key, t in stored.items():
            t = t.detach().to("cpu").contiguous()
            spool = self._spool(t.element_size())
            n = t.numel() * t.element_size()
            if n:
                spool[0].write(memoryview(t.reshape(-1).view(torch.uint8).numpy()))  # the bytes, not a copy
            self._layout[key] = (t.element_size(), _TAG_OF[t.dtype], list(t.shape), spool[1], spool[1] + n)
            spool[1] += n
        self._index.append(entry)

    def close(self) -> None:
        """Write the file (atomically) and remove the spools."""
        if self._closed:
            raise ValueError(f"CompressedWriter({self.path!r}) is closed")
        index_json = json.dumps({"version": FORMAT_VERSION, "tensors": self._index}, separators=(",", ":"))
        metadata = {
            _META_FORMAT: _FORMAT_TAG,
            _META_INDEX: index_json,
            _META_INDEX_SHA: hashlib.sha256(index_json.encode("utf-8")).hexdigest(),
        }
        if self._secret is not None:
            metadata[_META_HMAC] = _signature(self._secret, index_json)
        sizes = sorted(self._spools, reverse=True)  # 8-byte elements first: every tensor aligned
        base, start = {}, 0
        for size in sizes:
            base[size] = start
            start += self._spools[size][1]
        header: Dict[str, Any] = {"__metadata__": metadata}
        for key, (size, tag, shape, begin, end) in self._layout.items():
            header[key] = {"dtype": tag, "shape": shape, "data_offsets": [base[size] + begin, base[size] + end]}
        raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
        raw += b" " * (-len(raw) % 8)
        try:
            with atomic_write(self.path, "wb") as f:
                f.write(len(raw).to_bytes(8, "little"))
                f.write(raw)
                for size in sizes:
                    spool = self._spools[size][0]
                    spool.flush()
                    spool.seek(0)
                    shutil.copyfileobj(spool, f, 1 << 20)
        finally:
            self.abort()
        logger.info("save_compressed: wrote %s (%d tensors, streamed%s)", self.path, len(self._index),
                    ", signed" if self._secret is not None else "")

    def abort(self) -> None:
        """Give up: remove the spools; nothing is written at ``path``."""
        self._closed = True
        while self._spools:
            _, spool = self._spools.popitem()
            with contextlib.suppress(OSError):
                spool[0].close()  # an unnamed file: closing it frees its space

    def __enter__(self) -> "CompressedWriter":
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.close()
        elif not self._closed:
            self.abort()


# --------------------------------------------------------------------------- #
# decoding: the index is validated whole before any tensor is read
# --------------------------------------------------------------------------- #
_ENTRY_KEYS = {
    "dense": ({"name", "dtype", "shape", "sha256", "encoding", "storage"}, set()),
    "binary": ({"name", "dtype", "shape", "sha256", "encoding", "nnz"}, set()),
    "sparse": ({"name", "dtype", "shape", "sha256", "encoding", "nnz", "storage"}, {"neg_zeros"}),
}
_MAX_DIMS = 64
_HEX = frozenset("0123456789abcdef")


class _Plan:
    """One validated index entry: what to read (stored key -> expected tag and shape) and how to rebuild."""

    __slots__ = ("name", "dtype", "shape", "numel", "encoding", "storage", "nnz", "neg_zeros", "sha256", "parts")

    def __init__(self, **kw: Any) -> None:
        for k, v in kw.items():
            setattr(self, k, v)


def _is_int(x: Any) -> bool:
    return type(x) is int


def _stored_form(dtype: torch.dtype, storage: str, count: int, shape: List[int], where: str) -> Tuple[str, List[int]]:
    """The (tag, shape) a stored tensor of ``count`` elements of ``dtype`` must have."""
    if storage == "native":
        tag = _TAG_OF.get(dtype)
        if tag is None:
            raise _damaged(f"{where}: dtype {_dtype_name(dtype)} cannot be stored natively in safetensors")
        return tag, shape
    if storage == "raw":
        return "U8", [count * torch.empty(0, dtype=dtype).element_size()]
    raise _damaged(f"{where}: unknown storage kind {storage!r} in the index")  # (a dict, a list, ...)


def _plan_entry(entry: Any, path: str, position: int) -> _Plan:
    if not isinstance(entry, dict):
        raise _damaged(f"{path}: index entry {position} is a {type(entry).__name__}, not an object")
    name = entry.get("name")
    if not isinstance(name, str):
        raise _damaged(f"{path}: index entry {position} has no string name")
    where = f"{path}: tensor {name!r}"
    if name.endswith(_RESERVED):
        raise _damaged(f"{where}: the name ends with a suffix prunekit reserves")
    encoding = entry.get("encoding")
    if not isinstance(encoding, str) or encoding not in _ENTRY_KEYS:
        raise _damaged(f"{where}: unknown encoding {encoding!r} in the index")
    required, optional = _ENTRY_KEYS[encoding]
    keys = set(entry)
    if not required <= keys or not keys <= required | optional:
        raise _damaged(f"{where}: index entry has keys {sorted(keys)}, expected {sorted(required)}"
                       + (f" (optionally {sorted(optional)})" if optional else ""))
    dtype = _dtype_from_name(entry["dtype"], where)
    shape = entry["shape"]
    if (not isinstance(shape, list) or len(shape) > _MAX_DIMS
            or not all(_is_int(s) and 0 <= s < 2 ** 62 for s in shape)):
        raise _damaged(f"{where}: bad shape {shape!r} in the index")
    numel = math.prod(shape)
    if numel >= 2 ** 62:
        raise _damaged(f"{where}: shape {shape} has more elements than any file holds")
    sha = entry["sha256"]
    if not isinstance(sha, str) or len(sha) != 64 or not set(sha) <= _HEX:
        raise _damaged(f"{where}: bad checksum {sha!r} in the index")
    plan = _Plan(name=name, dtype=dtype, shape=shape, numel=numel, encoding=encoding, storage=None, nnz=None,
                 neg_zeros=None, sha256=sha, parts={})
    if encoding == "dense":
        plan.storage = entry["storage"]
        plan.parts[name] = _stored_form(dtype, plan.storage, numel, shape, where)
        return plan
    nnz = entry["nnz"]
    if not _is_int(nnz) or not 0 <= nnz <= numel:
        raise _damaged(f"{where}: bad non-zero count {nnz!r} in the index")
    plan.nnz = nnz
    plan.parts[name + _BITMASK_SUFFIX] = ("U8", [math.ceil(numel / 8)])
    if encoding == "binary":
        if _one_word(dtype) is None:
            raise _damaged(f"{where}: dtype {dtype} cannot hold a binary mask")
        return plan
    plan.storage = entry["storage"]
    plan.parts[name + _VALUES_SUFFIX] = _stored_form(dtype, plan.storage, nnz, [nnz], where)
    if "neg_zeros" in entry:
        n_neg = entry["neg_zeros"]
        if not _is_int(n_neg) or not 1 <= n_neg <= numel - nnz or _neg_zero_word(dtype) is None:
            raise _damaged(f"{where}: bad zero-sign count {n_neg!r} in the index")
        plan.neg_zeros = n_neg
        plan.parts[name + _SIGNS_SUFFIX] = ("U8", [math.ceil((numel - nnz) / 8)])
    return plan


def _plan(index_json: str, header: SafetensorsHeader, path: str) -> List[_Plan]:
    """Validate the whole index against the container; refuse before reading any tensor."""
    index = loads_json_strict(index_json, f"{path}: index", error=CorruptCheckpointError, max_depth=6)
    if not isinstance(index, dict) or set(index) != {"version", "tensors"}:
        raise _damaged(f"{path}: the index must be an object with exactly 'version' and 'tensors'")
    if index["version"] != FORMAT_VERSION or not _is_int(index["version"]):
        raise _damaged(f"{path}: unsupported index version {index['version']!r}")
    entries = index["tensors"]
    if not isinstance(entries, list):
        raise _damaged(f"{path}: the index's 'tensors' is a {type(entries).__name__}, not a list")
    plans: List[_Plan] = []
    names: set = set()
    expected: Dict[str, Tuple[str, List[int]]] = {}
    for i, entry in enumerate(entries):
        plan = _plan_entry(entry, path, i)
        if plan.name in names:
            raise _damaged(f"{path}: tensor {plan.name!r} is listed more than once in the index")
        names.add(plan.name)
        for key, form in plan.parts.items():
            if key in expected:
                raise _damaged(f"{path}: stored entry {key!r} is claimed by two index entries")
            expected[key] = form
        plans.append(plan)
    stored = header.tensors
    missing = [k for k in expected if k not in stored]
    if missing:
        raise _damaged(f"{path}: entry {missing[0]!r} named in the index is missing")
    extra = [k for k in stored if k not in expected]
    if extra:
        raise _damaged(f"{path}: stored entry {extra[0]!r} is not in the index")
    for key, (tag, shape) in expected.items():
        found_tag, found_shape, _ = stored[key]
        if found_tag != tag or found_shape != shape:
            raise _damaged(f"{path}: stored entry {key!r} is {found_tag}{found_shape}, the index needs {tag}{shape}")
    return plans


def _read_stored(f: IO[bytes], header: SafetensorsHeader, key: str) -> torch.Tensor:
    try:
        return read_safetensors_tensor(f, header, key)
    except UnreadableFileError as e:
        raise _damaged(str(e)) from None


def _from_storable(stored: torch.Tensor, storage: str, dtype: torch.dtype) -> torch.Tensor:
    return stored.view(dtype) if storage == "raw" else stored


def _decode(plan: _Plan, get: Any, path: str) -> torch.Tensor:
    where = f"{path}: tensor {plan.name!r}"
    dtype, numel = plan.dtype, plan.numel
    if plan.encoding == "dense":
        out = _from_storable(get(plan.name), plan.storage, dtype).reshape(plan.shape)
    else:
        flags, padding_clean = _unpack_bits(get(plan.name + _BITMASK_SUFFIX), numel)
        found = int(torch.count_nonzero(flags))
        if found != plan.nnz or not padding_clean:
            raise _damaged(f"{where}: bitmask marks {found} non-zeros, the index says {plan.nnz}")
        template = torch.zeros(numel, dtype=dtype)
        words = _words(template)
        if plan.encoding == "binary":
            words.masked_scatter_(flags.unsqueeze(1), _one_word(dtype).expand(plan.nnz, -1))
        else:
            values = _from_storable(get(plan.name + _VALUES_SUFFIX), plan.storage, dtype)
            words.masked_scatter_(flags.unsqueeze(1), _words(values.contiguous()))
            if plan.neg_zeros is not None:
                neg_zero = _neg_zero_word(dtype)
                sign_flags, sign_clean = _unpack_bits(get(plan.name + _SIGNS_SUFFIX), numel - plan.nnz)
                if int(torch.count_nonzero(sign_flags)) != plan.neg_zeros or not sign_clean:
                    raise _damaged(f"{where}: zero-sign bitmask does not match the index")
                negative = torch.zeros(numel, dtype=torch.bool).masked_scatter_(~flags, sign_flags)
                for j in range(words.shape[1]):
                    words[:, j].masked_fill_(negative, neg_zero[j])
        out = template.reshape(plan.shape)
    if _sha256(out) != plan.sha256:
        raise _damaged(f"{where}: checksum mismatch")
    return out


def is_compressed_header(header: SafetensorsHeader) -> bool:
    """Whether a safetensors header claims, even partly, to be prunekit's compressed format.

    True when any of prunekit's metadata keys or stored-entry suffixes is
    present. Such a file is read with :func:`load_compressed` and held to every
    rule, so one damaged key (a flipped bit) cannot make it pass as a plain
    safetensors file.

    Examples:
        >>> import os, tempfile, torch
        >>> from prunekit.io.reader import open_regular, read_safetensors_header
        >>> p = os.path.join(tempfile.mkdtemp(), "m.safetensors")
        >>> write_compressed({"w": torch.zeros(64)}, p)
        >>> with open_regular(p) as f:
        ...     is_compressed_header(read_safetensors_header(f, p))
        True
    """
    if any(k in header.metadata for k in _META_KEYS) or any(k.startswith("prunekit") for k in header.metadata):
        return True
    return any(name.endswith(_RESERVED) for name in header.tensors)


def load_compressed(
    path: PathLike,
    *,
    device: Union[str, torch.device] = "cpu",
    key: Union[bytes, str, None] = None,
) -> "OrderedDict[str, torch.Tensor]":
    """Load a checkpoint written by :func:`save_compressed` as a state dict.

    Every tensor is rebuilt bit-exactly and checked against the SHA-256 stored
    at save time. The result holds the same keys in the same order as the
    saved state dict, so ``model.load_state_dict(load_compressed(path))``
    restores a model of the same structure (a pruned checkpoint, with its
    ``name_orig``/``name_mask`` keys, loads into a model pruned the same way).
    The file is treated as hostile (see the module's description): whatever is
    wrong with it, the error is a :class:`CorruptCheckpointError`.

    Args:
        path: a file written by :func:`save_compressed`.
        device: where to put the loaded tensors.
        key: the secret the file was signed with. With a key, a file whose
            signature is missing or does not verify raises
            :class:`CheckpointSignatureError`. Without one, a signed file
            loads (its checksums are still verified) with an
            :class:`UnverifiedSignatureWarning`.

    Raises:
        CorruptCheckpointError: (a ``ValueError``) the file is truncated,
            damaged, not a regular file, or not a prunekit compressed checkpoint.
        FileNotFoundError: no file at ``path``.

    Examples:
        >>> import os, tempfile, torch
        >>> from prunekit.io import save_compressed, load_compressed
        >>> model = torch.nn.Linear(8, 4)
        >>> path = os.path.join(tempfile.mkdtemp(), "m.safetensors")
        >>> save_compressed(model, path)
        >>> sd = load_compressed(path)
        >>> list(sd), torch.equal(sd["weight"], model.weight)
        (['weight', 'bias'], True)
    """
    secret = _key_bytes(key) if key is not None else None
    path = os.fspath(path)
    if not os.path.lexists(path):
        raise FileNotFoundError(f"load_compressed: no file at {path!r}")
    with open_regular(path, error=CorruptCheckpointError, what="checkpoint file") as f:
        try:
            header = read_safetensors_header(f, path, error=CorruptCheckpointError)
        except CorruptCheckpointError as e:
            raise _damaged(f"{e} (not a readable safetensors file)") from None
        out = _load_from(f, header, path, secret)
    if torch.device(device).type != "cpu":
        out = OrderedDict((k, v.to(device)) for k, v in out.items())
    logger.info("load_compressed: read %d tensors from %s", len(out), path)
    return out


def _load_from(f: IO[bytes], header: SafetensorsHeader, path: str,
               secret: Optional[bytes]) -> "OrderedDict[str, torch.Tensor]":
    meta = header.metadata
    if not is_compressed_header(header):
        raise CorruptCheckpointError(
            f"{path}: not a prunekit compressed checkpoint (no {_META_FORMAT!r} metadata); "
            "load plain safetensors files with safetensors.torch.load_file"
        )
    unknown = sorted(k for k in meta if k not in _META_KEYS)
    if unknown:
        raise _damaged(f"{path}: unexpected metadata key {unknown[0]!r}")
    for k in (_META_FORMAT, _META_INDEX, _META_INDEX_SHA):
        if k not in meta:
            raise _damaged(f"{path}: metadata key {k!r} is missing")
    if meta[_META_FORMAT] != _FORMAT_TAG:
        raise _damaged(f"{path}: unsupported checkpoint format {meta[_META_FORMAT]!r}")
    index_json = meta[_META_INDEX]
    if hashlib.sha256(index_json.encode("utf-8")).hexdigest() != meta[_META_INDEX_SHA]:
        raise _damaged(f"{path}: index checksum mismatch")
    signature = meta.get(_META_HMAC)
    if secret is not None:
        if signature is None:
            raise CheckpointSignatureError(f"{path}: the checkpoint is not signed, but a key was given; "
                                           "refusing an unauthenticated file")
        if not hmac.compare_digest(signature.encode("utf-8"), _signature(secret, index_json).encode("ascii")):
            raise CheckpointSignatureError(f"{path}: the signature does not verify (wrong key, or the file "
                                           "was altered)")
    elif signature is not None:
        warnings.warn(f"{path}: the checkpoint is signed but no key was given, so its signature was not "
                      "verified (checksums were); pass key=... to authenticate it",
                      UnverifiedSignatureWarning, stacklevel=3)
    plans = _plan(index_json, header, path)

    def get(key: str) -> torch.Tensor:
        return _read_stored(f, header, key)

    out: "OrderedDict[str, torch.Tensor]" = OrderedDict()
    for plan in plans:
        out[plan.name] = _decode(plan, get, path)
    return out
