"""Compacted-model files: a plain state dict plus the JSON description of the new shapes.

The file is a ``torch.save`` archive of ``{"state_dict": ..., "description": ...}``
that ``torch.load(weights_only=True)`` reads (no code is unpickled), sealed with
a SHA-256 checksum in the zip archive's comment (``prunekit-sha256:<hex>``,
over every byte before the comment's length field, so every byte of the file
is covered). The atomic writer writes it; :func:`read_compacted` reads it as
hostile input, in this order, before anything is unpickled or allocated:

1. the file is a regular file (the hostile reader's :func:`open_regular`);
2. its checksum verifies (streamed, no allocation); a file without one
   (written before prunekit sealed compacted files, or by another tool) is
   refused unless the caller passes ``require_checksum=False``;
3. its zip records are stored uncompressed and lie inside the file, so
   ``torch.load`` allocates at most the file's own size;
4. after ``torch.load(weights_only=True)``, the description is checked as data
   (:func:`check_description`) and every size it gives is checked against the
   state dict's shapes (:func:`check_sizes`).

What the description may change in a model, and to which values, is checked
against the model by :func:`prunekit.compact.load_compacted` -- that rebuilding,
which changes modules, belongs to :mod:`prunekit.compact`.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import math
import os
import zipfile
from collections import OrderedDict
from typing import IO, Any, Dict, Mapping, Optional, Sequence, Tuple

import torch

from .errors import UnreadableFileError
from .reader import TEXT_LIMIT, open_regular
from .writer import write_with

logger = logging.getLogger(__name__)

__all__ = [
    "COMPACT_FORMAT",
    "CompactedModelError",
    "MAX_TENSOR_ELEMENTS",
    "check_description",
    "check_sizes",
    "file_checksum",
    "read_compacted",
    "write_compacted",
]

COMPACT_FORMAT = "prunekit.compact/1"
#: the most elements one tensor of a description may have (checked before anything is allocated)
MAX_TENSOR_ELEMENTS = 2 ** 40
_ENTRY_KEYS = {"class", "init", "tensors", "attrs", "name"}
_TOP_KEYS = {"format", "modules", "kept", "hf_config", "approximate"}  # what compaction writes
_MAX_NAME = 4096  # characters of a module name or tensor/attribute path
_MAX_NODES = 1_000_000  # values in the description's informational parts ("kept", "approximate")

_MAGIC = b"prunekit-sha256:"
_COMMENT = len(_MAGIC) + 64  # the archive comment: magic + 64 hex digits
_EOCD = b"PK\x05\x06"  # a zip archive's end-of-central-directory record: 22 bytes, then the comment
_EOCD_SIZE = 22
_CHUNK = 1 << 20
_MAX_RECORDS = 10_000_000


class CompactedModelError(UnreadableFileError):
    """A compacted model's file, description or state dict is refused (a ``ValueError``).

    The message starts with the file's path (or ``compaction description`` for
    one passed in memory) and says what is wrong and what to give instead.

    Examples:
        >>> try:
        ...     check_description({"format": "prunekit.compact/1", "modules": {"0": {"tensors": {"w": [-1]}}}})
        ... except CompactedModelError as e:
        ...     print(e)
        compaction description: module '0': 'tensors' must map tensor paths to shapes of non-negative ints
    """


# ----------------------------------------------------------------------------- the description as data
def _scalar_or_list(v: Any) -> bool:
    if isinstance(v, (bool, int, float, str)) or v is None:
        return not (isinstance(v, float) and not math.isfinite(v))
    if isinstance(v, (list, tuple)):
        return len(v) <= 64 and all(_scalar_or_list(x) and not isinstance(x, (list, tuple)) for x in v)
    return False


def _plain_data(obj: Any, limit: int = _MAX_NODES) -> bool:
    """JSON-like data only (dicts with string keys, lists, finite numbers, strings, bools, None), bounded."""
    stack, seen = [(obj, 0)], 0
    while stack:
        o, depth = stack.pop()
        seen += 1
        if seen > limit or depth > 16:
            return False
        if isinstance(o, dict):
            if not all(isinstance(k, str) for k in o):
                return False
            stack.extend((v, depth + 1) for v in o.values())
        elif isinstance(o, (list, tuple)):
            stack.extend((v, depth + 1) for v in o)
        elif not _scalar_or_list(o):
            return False
    return True


def _shape_ok(s: Any) -> bool:
    return (isinstance(s, (list, tuple)) and len(s) <= 64 and all(type(d) is int and 0 <= d < 2 ** 40 for d in s)
            and math.prod(s) <= MAX_TENSOR_ELEMENTS)


def _name_ok(k: Any) -> bool:
    return isinstance(k, str) and len(k) <= _MAX_NAME


def check_description(description: Any, where: str = "compaction description") -> Dict[str, Any]:
    """Check a compaction description's structure and types; return it, or raise :class:`CompactedModelError`.

    A description is ``{"format": "prunekit.compact/1", "modules": {name: entry}}``
    (plus what compaction records for information: ``kept``, ``hf_config``,
    ``approximate``); each entry may hold ``class`` (a name), ``init`` (keyword
    arguments), ``tensors`` (tensor path -> shape: non-negative ints, at most
    :data:`MAX_TENSOR_ELEMENTS` elements) and ``attrs`` (attribute path -> a number,
    string, bool or a short list of them). Which attributes may be set, and to what,
    depends on the model: :func:`prunekit.compact.rebuild_from_description` checks that.

    Examples:
        >>> d = {"format": "prunekit.compact/1", "modules": {"0": {"tensors": {"weight": [8, 8]},
        ...                                                       "attrs": {"out_features": 8}}}}
        >>> check_description(d) is d
        True
    """
    if not isinstance(description, dict) or description.get("format") != COMPACT_FORMAT:
        got = description.get("format") if isinstance(description, dict) else type(description).__name__
        raise CompactedModelError(f"{where}: not a compaction description (expected format "
                                  f"{COMPACT_FORMAT!r}, got {got!r})")
    extra = sorted(str(k) for k in set(description) - _TOP_KEYS)
    if extra:
        raise CompactedModelError(f"{where}: unexpected keys {extra}; a description holds only {sorted(_TOP_KEYS)}")
    informational = {k: v for k, v in description.items() if k not in ("format", "modules")}
    if not _plain_data(informational):
        raise CompactedModelError(f"{where}: 'kept', 'hf_config' and 'approximate' must be plain JSON data")
    modules = description.get("modules")
    if not isinstance(modules, dict):
        raise CompactedModelError(f"{where}: 'modules' must map module names to entries")
    for name, entry in modules.items():
        at = f"{where}: module {name!r}"
        if not _name_ok(name) or not isinstance(entry, dict) or not set(entry) <= _ENTRY_KEYS:
            raise CompactedModelError(f"{at}: an entry holds only {sorted(_ENTRY_KEYS - {'name'})}")
        if "class" in entry and not isinstance(entry["class"], str):
            raise CompactedModelError(f"{at}: 'class' must be a class name")
        init = entry.get("init", {})
        if not isinstance(init, dict) or not all(_name_ok(k) and _scalar_or_list(v) for k, v in init.items()):
            raise CompactedModelError(f"{at}: 'init' must map argument names to plain values")
        tensors = entry.get("tensors", {})
        if not isinstance(tensors, dict) or not all(_name_ok(k) and _shape_ok(s) for k, s in tensors.items()):
            raise CompactedModelError(f"{at}: 'tensors' must map tensor paths to shapes of non-negative ints")
        attrs = entry.get("attrs", {})
        if not isinstance(attrs, dict) or not all(_name_ok(k) and _scalar_or_list(v) for k, v in attrs.items()):
            raise CompactedModelError(f"{at}: 'attrs' must map attribute paths to plain values")
    return description


def check_sizes(description: Mapping[str, Any], shapes: Mapping[str, Sequence[int]],
                where: str = "compaction description") -> None:
    """Check every tensor shape of a (checked) description against the state dict's shapes.

    ``shapes`` maps state-dict keys to shapes (``{k: v.shape}`` of a state dict, or
    the shapes of a safetensors header): nothing is allocated. A masked tensor is
    stored as ``name_orig`` and ``name_mask``; both must have the described shape.

    Examples:
        >>> d = {"format": "prunekit.compact/1", "modules": {"0": {"tensors": {"weight": [8, 4]}}}}
        >>> check_sizes(d, {"0.weight": (8, 4)})
        >>> try:
        ...     check_sizes(d, {"0.weight": (8, 5)})
        ... except CompactedModelError as e:
        ...     print(e)
        compaction description: module '0' tensor 'weight': the description says [8, 4], the state dict holds [8, 5]
    """
    for mname, entry in description["modules"].items():
        for path, shape in entry.get("tensors", {}).items():
            key = f"{mname}.{path}" if mname else path
            at = f"{where}: module {mname!r} tensor {path!r}"
            found = [k for k in (key, key + "_orig") if k in shapes]
            if not found:
                raise CompactedModelError(f"{at}: the state dict has no {key!r}; give the state dict saved with "
                                          "this description")
            if key + "_orig" in shapes and key + "_mask" in shapes:
                found.append(key + "_mask")
            for k in found:
                if list(shapes[k]) != list(shape):
                    raise CompactedModelError(f"{at}: the description says {list(shape)}, the state dict holds "
                                              f"{list(shapes[k])}" + ("" if k == key else f" (as {k!r})"))


# ----------------------------------------------------------------------------- the checksum
class _SealingWriter:
    """Forwards ``torch.save``'s bytes to ``f``, hashing them, and seals the archive when finished.

    The last 22 bytes (the end-of-central-directory record) are held back: its final
    two bytes, the comment's length, become the length of the checksum comment.
    """

    def __init__(self, f: Any) -> None:
        self._f = f
        self._hash = hashlib.sha256()
        self._tail = b""

    def _emit(self, data: Any) -> None:
        if len(data):
            self._hash.update(data)
            self._f.write(data)

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        n = len(view)
        if n >= _EOCD_SIZE:
            self._emit(self._tail)
            self._emit(view[: n - _EOCD_SIZE])
            self._tail = bytes(view[n - _EOCD_SIZE:])
        else:
            both = self._tail + bytes(view)
            self._emit(both[: max(len(both) - _EOCD_SIZE, 0)])
            self._tail = both[-_EOCD_SIZE:]
        return n

    def flush(self) -> None:
        if hasattr(self._f, "flush"):
            self._f.flush()

    def finish(self) -> None:
        tail = self._tail
        if len(tail) != _EOCD_SIZE or tail[:4] != _EOCD or tail[-2:] != b"\x00\x00":  # pragma: no cover - torch's format
            raise RuntimeError("torch.save did not end its archive with an end-of-central-directory record "
                               "without a comment; prunekit cannot seal this file")
        self._emit(tail[:-2])
        comment = _MAGIC + self._hash.hexdigest().encode("ascii")
        self._f.write(len(comment).to_bytes(2, "little") + comment)


def _sealed_save(obj: Any, f: Any) -> None:
    w = _SealingWriter(f)
    torch.save(obj, w)  # type: ignore[arg-type]  # torch.save takes any object with write and flush
    w.finish()


def _read_at(f: IO[bytes], offset: int, n: int) -> bytes:
    f.seek(offset)
    return f.read(n)


def file_checksum(f: IO[bytes], path: str, size: int) -> Optional[str]:
    """Verify the checksum of a compacted-model file open as ``f`` (``size`` bytes); return it.

    Returns the hex digest, or None when the file has no prunekit checksum (an archive
    whose comment is empty). A checksum that does not verify, or a damaged trailer, is a
    :class:`CompactedModelError` naming the path. The file is streamed: nothing the size
    of the file is allocated.

    Examples:
        >>> import os, tempfile, torch
        >>> p = os.path.join(tempfile.mkdtemp(), "small.pt")
        >>> write_compacted({"w": torch.ones(2)}, {"format": "prunekit.compact/1", "modules": {}}, p)
        >>> with open(p, "rb") as f:
        ...     len(file_checksum(f, p, os.path.getsize(p)))
        64
    """
    sealed = _EOCD_SIZE + _COMMENT
    if size >= sealed:
        tail = _read_at(f, size - sealed, sealed)
        if tail[:4] == _EOCD and tail[20:22] == _COMMENT.to_bytes(2, "little") and tail[22:22 + len(_MAGIC)] == _MAGIC:
            want = tail[22 + len(_MAGIC):]
            if not all(c in b"0123456789abcdef" for c in want):
                raise CompactedModelError(f"{path}: damaged: its checksum is not 64 hex digits; the file was altered "
                                          "after it was written -- save it again with prunekit.compact.save_compacted")
            digest = hashlib.sha256()
            f.seek(0)
            left = size - _COMMENT - 2
            while left > 0:
                chunk = f.read(min(_CHUNK, left))
                if not chunk:  # pragma: no cover - the file shrank while being read
                    raise CompactedModelError(f"{path}: truncated while its checksum was verified")
                digest.update(chunk)
                left -= len(chunk)
            got = digest.hexdigest()
            if not hmac.compare_digest(got.encode("ascii"), want):
                raise CompactedModelError(f"{path}: damaged: its SHA-256 checksum does not verify (the file says "
                                          f"{want.decode()[:16]}..., its bytes hash to {got[:16]}...); the file was "
                                          "altered or truncated after it was written -- save it again")
            return got
    if size >= _EOCD_SIZE:
        tail = _read_at(f, size - _EOCD_SIZE, _EOCD_SIZE)
        if tail[:4] == _EOCD and tail[-2:] == b"\x00\x00":
            return None
    raise CompactedModelError(f"{path}: damaged or not a compacted model file: it does not end with a sealed zip "
                              "archive (truncated, or altered after it was written); give a file written by "
                              "prunekit.compact.save_compacted")


def _check_archive(f: IO[bytes], path: str, size: int) -> None:
    """Refuse archives whose records ``torch.load`` would inflate or read from outside the file."""
    f.seek(0)
    try:
        with zipfile.ZipFile(f) as z:
            infos = z.infolist()
    except Exception as e:  # zipfile raises BadZipFile, ValueError, struct.error, OverflowError ... on junk
        raise CompactedModelError(f"{path}: not a compacted model file (not a zip archive: {e}); give a file "
                                  "written by prunekit.compact.save_compacted") from None
    if len(infos) > _MAX_RECORDS:
        raise CompactedModelError(f"{path}: {len(infos)} records; a compacted model file never has that many")
    for i in infos:
        if i.compress_type != zipfile.ZIP_STORED or i.file_size != i.compress_size:
            raise CompactedModelError(f"{path}: record {i.filename!r} is compressed; torch.save stores records "
                                      "uncompressed -- give a file written by prunekit.compact.save_compacted")
        if i.header_offset < 0 or i.header_offset + i.file_size > size:
            raise CompactedModelError(f"{path}: record {i.filename!r} ({i.file_size} bytes at {i.header_offset}) "
                                      f"lies outside the {size}-byte file (truncated or damaged)")
        if i.filename.endswith("data.pkl") and i.file_size > TEXT_LIMIT:
            raise CompactedModelError(f"{path}: its pickle holds {i.file_size} bytes, over the {TEXT_LIMIT}-byte limit")


# ----------------------------------------------------------------------------- writing and reading
def write_compacted(state_dict: Mapping[str, torch.Tensor], description: Mapping[str, Any], path: Any) -> None:
    """Write a compacted model's state dict and description atomically (or into a file object), sealed.

    The archive's comment carries the SHA-256 checksum that :func:`read_compacted` verifies.

    Examples:
        >>> import os, tempfile, torch
        >>> p = os.path.join(tempfile.mkdtemp(), "small.pt")
        >>> write_compacted({"w": torch.ones(2)}, {"format": "prunekit.compact/1", "modules": {}}, p)
        >>> read_compacted(p)[1]["format"]
        'prunekit.compact/1'
        >>> torch.load(p, weights_only=True)["state_dict"]["w"].tolist()  # plain torch reads it too
        [1.0, 1.0]
    """
    check_description(dict(description))
    data = {"state_dict": OrderedDict(state_dict), "description": dict(description)}
    write_with(path, lambda f: _sealed_save(data, f))


def read_compacted(path: Any, *, require_checksum: bool = True
                   ) -> Tuple["OrderedDict[str, torch.Tensor]", Dict[str, Any]]:
    """Read a file written by :func:`write_compacted` (or ``prunekit compact --out``): ``(state_dict, description)``.

    The checksum is verified and the archive's records checked before ``torch.load``
    (``weights_only=True``) reads it; the description is checked with
    :func:`check_description` and its sizes against the state dict with
    :func:`check_sizes`. Anything wrong is a :class:`CompactedModelError` (a
    ``ValueError``) naming the path.

    Args:
        require_checksum: refuse a file without a checksum (the default). A file
            written before prunekit sealed compacted files has none: pass False to
            read it anyway (every other check still applies; a warning is logged),
            then save it again to seal it.

    Examples:
        >>> import os, tempfile, torch
        >>> p = os.path.join(tempfile.mkdtemp(), "small.pt")
        >>> write_compacted({"w": torch.ones(2)}, {"format": "prunekit.compact/1", "modules": {}}, p)
        >>> sd, desc = read_compacted(p); list(sd)
        ['w']
    """
    path = os.fspath(path)
    with open_regular(path, what="compacted model file") as f:
        size = os.fstat(f.fileno()).st_size
        if file_checksum(f, path, size) is None:
            if require_checksum:
                raise CompactedModelError(
                    f"{path}: has no prunekit checksum (written before prunekit sealed compacted files, or by another "
                    "tool), so damage to it cannot be detected; if you trust it, read it with "
                    "read_compacted(path, require_checksum=False) and save it again with write_compacted")
            logger.warning("%s: compacted model file without a checksum, read because require_checksum=False", path)
        _check_archive(f, path, size)
        f.seek(0)
        try:
            obj = torch.load(f, map_location="cpu", weights_only=True)
        except Exception as e:  # torch.load raises UnpicklingError, RuntimeError, struct.error, ... on junk
            lines = str(e).strip().splitlines()
            raise CompactedModelError(f"{path}: not a compacted model file ({lines[0] if lines else type(e).__name__})"
                                      "; give a file written by prunekit.compact.save_compacted") from None
    if not isinstance(obj, dict) or set(obj) != {"state_dict", "description"}:
        raise CompactedModelError(f"{path}: not a compacted model file (expected a dict with 'state_dict' and "
                                  "'description'); give a file written by prunekit.compact.save_compacted")
    sd = obj["state_dict"]
    if not isinstance(sd, Mapping) or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in sd.items()):
        raise CompactedModelError(f"{path}: its 'state_dict' is not a mapping of names to tensors")
    desc = check_description(obj["description"], f"{path}: description")
    check_sizes(desc, {k: v.shape for k, v in sd.items()}, f"{path}: description")
    return OrderedDict(sd), desc


def _write_entry(obj: Mapping[str, Any], path: Any) -> None:
    """The table's writer: ``obj`` is ``{"state_dict": ..., "description": ...}``."""
    if not isinstance(obj, Mapping) or set(obj) != {"state_dict", "description"}:
        raise TypeError("format 'prunekit-compacted' writes {'state_dict': ..., 'description': ...}; "
                        "for a compacted model use prunekit.compact.save_compacted(model, path)")
    write_compacted(obj["state_dict"], obj["description"], path)


def _read_entry(path: Any, *, require_checksum: bool = True, **_options: Any) -> Dict[str, Any]:
    """The table's reader: ``{"state_dict": ..., "description": ...}``."""
    sd, desc = read_compacted(path, require_checksum=require_checksum)
    return {"state_dict": sd, "description": desc}
