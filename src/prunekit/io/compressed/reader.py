"""Reading prunekit's compressed checkpoints: the file is hostile until every check has passed.

:func:`load_compressed` checks, through :mod:`prunekit.io.reader`, that the
path is a regular file and that the safetensors header fits the file (strict
JSON, byte ranges that match the shapes, do not overlap and cover the
buffer); then that the metadata and the index are exactly what prunekit
writes: known keys and types only, known dtypes and encodings, each name
once, and one stored tensor of exactly the expected dtype and shape for each
part of each entry, none missing, none extra. The index is validated whole
before any tensor is read. Each tensor is then decoded by :mod:`.codec`,
which checks its bitmask population and its checksum. Any failure raises
:class:`CorruptCheckpointError` naming the path and the reason; a signature
that does not verify raises :class:`CheckpointSignatureError` (a subclass).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import math
import os
import warnings
from collections import OrderedDict
from typing import Any, Dict, IO, List, Optional, Tuple, Union

import torch

from ..errors import CheckpointSignatureError, CorruptCheckpointError, UnreadableFileError
from ..reader import (
    SafetensorsHeader,
    loads_json_strict,
    open_regular,
    read_safetensors_header,
    read_safetensors_tensor,
)
from ..writer import PathLike
from .codec import (
    _BITMASK_SUFFIX,
    _FORMAT_TAG,
    _META_FORMAT,
    _META_HMAC,
    _META_INDEX,
    _META_INDEX_SHA,
    _META_KEYS,
    _RESERVED,
    _SIGNS_SUFFIX,
    _TAG_OF,
    _VALUES_SUFFIX,
    FORMAT_VERSION,
    _damaged,
    _decode,
    _dtype_from_name,
    _dtype_name,
    _key_bytes,
    _neg_zero_word,
    _one_word,
    _Plan,
    _signature,
)

__all__ = ["load_compressed", "is_compressed_header", "UnverifiedSignatureWarning"]

logger = logging.getLogger(__name__)


class UnverifiedSignatureWarning(UserWarning):
    """A signed checkpoint was loaded without a key, so its signature was not checked."""


# --------------------------------------------------------------------------- #
# the index, validated whole before any tensor is read
# --------------------------------------------------------------------------- #
_ENTRY_KEYS = {
    "dense": ({"name", "dtype", "shape", "sha256", "encoding", "storage"}, set()),
    "binary": ({"name", "dtype", "shape", "sha256", "encoding", "nnz"}, set()),
    "sparse": ({"name", "dtype", "shape", "sha256", "encoding", "nnz", "storage"}, {"neg_zeros"}),
    "alias": ({"name", "encoding", "of"}, set()),  # a tied tensor: the very tensor of entry "of"
}
_MAX_DIMS = 64
_HEX = frozenset("0123456789abcdef")


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
    if encoding == "alias":
        if not isinstance(entry["of"], str) or entry["of"] == name:
            raise _damaged(f"{where}: an alias of {entry['of']!r}; it must name another tensor of the index")
        return _Plan(name=name, dtype=None, shape=None, numel=0, encoding=encoding, storage=None, nnz=None,
                     neg_zeros=None, sha256=None, parts={}, of=entry["of"])
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
        plan.storage = storage = entry["storage"]
        plan.parts[name] = _stored_form(dtype, storage, numel, shape, where)
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
    plan.storage = storage = entry["storage"]
    plan.parts[name + _VALUES_SUFFIX] = _stored_form(dtype, storage, nnz, [nnz], where)
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
    kinds = {p.name: p.encoding for p in plans}
    for p in plans:
        if p.of is not None and kinds.get(p.of) in (None, "alias"):
            raise _damaged(f"{path}: tensor {p.name!r} is an alias of {p.of!r}, which the index "
                           + ("does not list" if p.of not in kinds else "lists as an alias too"))
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


def is_compressed_header(header: SafetensorsHeader) -> bool:
    """Whether a safetensors header claims, even partly, to be prunekit's compressed format.

    True when any of prunekit's metadata keys or stored-entry suffixes is
    present. Such a file is read with :func:`load_compressed` and held to every
    rule, so one damaged key (a flipped bit) cannot make it pass as a plain
    safetensors file.

    Examples:
        >>> import os, tempfile, torch
        >>> from prunekit.io.reader import open_regular, read_safetensors_header
        >>> from prunekit.io.compressed import write_compressed
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
        moved: Dict[int, torch.Tensor] = {}  # tied tensors stay one tensor
        out = OrderedDict((k, moved.setdefault(id(v), v.to(device))) for k, v in out.items())
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

    decoded = {plan.name: _decode(plan, get, path) for plan in plans if plan.encoding != "alias"}
    # a tied tensor is the very tensor it is tied to, as in the model's state dict
    return OrderedDict((p.name, decoded[p.name if p.of is None else p.of]) for p in plans)
