"""Reading DCP's ``.metadata`` without running code from it, and checking what it says.

DCP writes ``.metadata`` with ``pickle`` and reads it back with
``pickle.load``, which calls whatever the file names. :func:`read_metadata`
unpickles it with an unpickler that resolves only DCP's metadata classes and
the few torch and ``pathlib`` values they hold (``torch.Size``, dtypes,
layouts); any other global -- ``os.system``, ``builtins.eval``, a class of
yours -- is refused before it is called, and so are persistent ids.

Then :func:`check_metadata` checks every field for type and range: tensor
entries have a dtype, a size and chunks that tile the tensor exactly (no gap,
no overlap); every chunk and byte entry is stored in a shard the manifest
lists, inside that file; no stream transforms are asked for. What the load
does not need (the saver's planner data and storage notes) is dropped.
"""

from __future__ import annotations

import io
import pathlib
import pickle
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Dict, List, Mapping, Optional, Tuple

import torch

if TYPE_CHECKING:
    from typing_extensions import TypeGuard

from .errors import CorruptDistributedCheckpointError, UnsafeDistributedCheckpointError
from .manifest import METADATA_NAME, Entry

__all__ = ["check_metadata", "read_metadata"]

_METADATA_CLASSES = ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                     "TensorProperties", "StorageMeta", "MetadataIndex", "_MEM_FORMAT_ENCODING")
_ALLOWED: Dict[Tuple[str, str], Any] = {}
_PAIR_BUDGET = 10_000_000  # chunk pairs compared per tensor, at most


def _allowed() -> Dict[Tuple[str, str], Any]:
    if not _ALLOWED:
        import torch.distributed.checkpoint.filesystem as fs
        import torch.distributed.checkpoint.metadata as md

        for name in _METADATA_CLASSES:
            _ALLOWED[(md.__name__, name)] = getattr(md, name)
        _ALLOWED[(fs.__name__, "_StorageInfo")] = fs._StorageInfo
        _ALLOWED[("torch", "Size")] = torch.Size
        _ALLOWED[("torch.serialization", "_get_layout")] = torch.serialization._get_layout  # returns layouts only
        for name, value in vars(torch).items():
            if isinstance(value, (torch.dtype, torch.layout)):
                _ALLOWED[("torch", name)] = value
        for cls in (pathlib.PosixPath, pathlib.PurePosixPath, pathlib.WindowsPath, pathlib.PureWindowsPath):
            _ALLOWED[("pathlib", cls.__name__)] = cls
            _ALLOWED[(cls.__module__, cls.__name__)] = cls
        _ALLOWED[("collections", "OrderedDict")] = OrderedDict
    return _ALLOWED


class _Unpickler(pickle.Unpickler):
    def __init__(self, data: bytes, folder: str) -> None:
        super().__init__(io.BytesIO(data))
        self.folder = folder

    def find_class(self, module: str, name: str) -> Any:
        value = _allowed().get((module, name))
        if value is None:
            raise UnsafeDistributedCheckpointError(
                f"{self.folder}: {METADATA_NAME} asks for {module}.{name}, which is not one of DCP's metadata "
                "classes; refused (nothing from the file was run). Only load checkpoints from sources you trust")
        return value

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeDistributedCheckpointError(
            f"{self.folder}: {METADATA_NAME} holds a persistent reference, which DCP's metadata never does; refused")


def read_metadata(data: bytes, folder: str, files: Mapping[str, Entry]) -> Any:
    """Unpickle DCP's ``.metadata`` bytes (only DCP's metadata classes) and check them (:func:`check_metadata`).

    Example (a pickle that would run ``os.system``):
        >>> import os, pickle
        >>> class Evil:
        ...     def __reduce__(self):
        ...         return (os.system, ("echo owned",))
        >>> try:
        ...     read_metadata(pickle.dumps(Evil()), "ckpt", {})
        ... except UnsafeDistributedCheckpointError as e:
        ...     print(str(e).split(";")[0])
        ckpt: .metadata asks for posix.system, which is not one of DCP's metadata classes
    """
    try:
        meta = _Unpickler(data, folder).load()
    except UnsafeDistributedCheckpointError:
        raise
    except Exception as e:  # a malformed pickle: any error the unpickler or an allowed constructor raises
        raise CorruptDistributedCheckpointError(
            f"{folder}: {METADATA_NAME} is not DCP metadata ({type(e).__name__}: {e})") from None
    check_metadata(meta, folder, files)
    return meta


def _is_int(x: Any) -> TypeGuard[int]:
    return type(x) is int


def _is_size(x: Any) -> TypeGuard[torch.Size]:
    return type(x) is torch.Size and all(_is_int(d) and d >= 0 for d in x)


def _chunks_tile(size: torch.Size, boxes: List[Tuple[torch.Size, torch.Size]]) -> Optional[str]:
    """``None`` if the boxes (offsets, sizes) cover the tensor exactly once, else why not."""
    numel = 1
    for d in size:
        numel *= d
    total = 0
    for offsets, sizes in boxes:
        if len(offsets) != len(size) or len(sizes) != len(size):
            return "a chunk has another number of dimensions than the tensor"
        if any(o + s > d for o, s, d in zip(offsets, sizes, size)):
            return "a chunk reaches past the tensor's end"
        n = 1
        for s in sizes:
            n *= s
        total += n
    if total != numel:
        return f"its chunks hold {total} entries, the tensor {numel}"
    if len(size) == 0:
        return None if len(boxes) == 1 else "a scalar is stored in more than one chunk"
    live = sorted((b for b in boxes if all(s > 0 for s in b[1])), key=lambda b: tuple(b[0]))
    budget = _PAIR_BUDGET
    for i, (oa, sa) in enumerate(live):  # sorted by the first offset: only boxes that start before a's end can meet it
        for ob, sb in live[i + 1:]:
            if ob[0] >= oa[0] + sa[0]:
                break
            budget -= 1
            if budget < 0:
                return f"it has too many chunks side by side ({len(live)}) to check"
            if all(b < a + s and a < b + t for a, s, b, t in zip(oa, sa, ob, sb)):
                return "two of its chunks overlap"
    return None


def check_metadata(meta: Any, folder: str, files: Mapping[str, Entry]) -> None:
    """Check every field of unpickled DCP metadata against what DCP writes and the manifest's ``files``.

    Raises :class:`CorruptDistributedCheckpointError` naming the entry and the
    reason. Drops ``planner_data`` and ``storage_meta`` (a load never needs them).
    """
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    def bad(why: str) -> CorruptDistributedCheckpointError:
        return CorruptDistributedCheckpointError(f"{folder}: {METADATA_NAME} is not valid DCP metadata: {why}")

    if type(meta) is not Metadata:
        raise bad(f"it holds a {type(meta).__name__}, not a Metadata")
    entries = getattr(meta, "state_dict_metadata", None)
    if type(entries) is not dict:
        raise bad("state_dict_metadata is not a dict")
    needed = []
    for fqn, md in entries.items():
        if type(fqn) is not str:
            raise bad(f"entry name {fqn!r} is not a string")
        if type(md) is BytesStorageMetadata:
            needed.append(MetadataIndex(fqn))
            continue
        if type(md) is not TensorStorageMetadata:
            raise bad(f"entry {fqn!r} is a {type(md).__name__}")
        props, size, chunks = getattr(md, "properties", None), getattr(md, "size", None), getattr(md, "chunks", None)
        if type(props) is not TensorProperties or type(getattr(props, "dtype", None)) is not torch.dtype:
            raise bad(f"entry {fqn!r} has no dtype")
        if not _is_size(size):
            raise bad(f"entry {fqn!r} has no valid size")
        if type(chunks) is not list or not all(type(c) is ChunkStorageMetadata and _is_size(getattr(c, "offsets", None))
                                                and _is_size(getattr(c, "sizes", None)) for c in chunks):
            raise bad(f"entry {fqn!r} has malformed chunks")
        why = _chunks_tile(size, [(c.offsets, c.sizes) for c in chunks])
        if why is not None:
            raise bad(f"entry {fqn!r}: {why}")
        needed.extend(MetadataIndex(fqn, c.offsets) for c in chunks)
    storage = getattr(meta, "storage_data", None)
    if type(storage) is not dict:
        raise bad("storage_data is not a dict")
    for index, info in storage.items():
        if (type(index) is not MetadataIndex or type(getattr(index, "fqn", None)) is not str
                or not (index.offset is None or _is_size(index.offset))
                or not (index.index is None or _is_int(index.index))):
            raise bad(f"a storage key is malformed ({type(index).__name__})")
        if type(info) is not _StorageInfo:
            raise bad(f"storage of {index.fqn!r} is a {type(info).__name__}")
        rel, offset, length = (getattr(info, k, None) for k in ("relative_path", "offset", "length"))
        if type(rel) is not str or rel == METADATA_NAME or rel not in files:
            raise bad(f"{index.fqn!r} is stored in {rel!r}, which is not a shard the manifest lists")
        if not (_is_int(offset) and _is_int(length) and offset >= 0 and length >= 0
                and offset + length <= files[rel].size):
            raise bad(f"{index.fqn!r} is stored at bytes {offset!r}+{length!r}, outside {rel} "
                      f"({files[rel].size} bytes)")
        if getattr(info, "transform_descriptors", None):
            raise bad(f"{index.fqn!r} asks for stream transforms {info.transform_descriptors!r}; "
                      "prunekit never writes them")
    for index in needed:
        if index not in storage:
            raise bad(f"entry {index.fqn!r} has a chunk that is stored nowhere")
    if not (meta.version is None or type(meta.version) is str):
        raise bad("version is not a string")
    meta.planner_data = None
    meta.storage_meta = None
