"""DCP's reader and load planner, narrowed to what a verified load needs.

* :class:`VerifiedReader` is DCP's ``FileSystemReader`` that returns the
  metadata prunekit already read and checked (it never unpickles
  ``.metadata`` itself, nor falls back to rank-local ``__<rank>.metadata``
  files), and opens each shard only if it is still the file that was hashed
  (:func:`~prunekit.distributed.manifest.open_stamped`).
* :class:`SafeLoadPlanner` is DCP's ``DefaultLoadPlanner`` for a flat state
  dict whose non-tensor entries load with ``torch.load(weights_only=True)``
  (DCP's own planner uses ``weights_only=False``: any pickle, code included).
  Tensor chunks already load with ``weights_only=True`` in DCP's reader.
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
from typing import Any, Dict, Iterator, Mapping

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.filesystem import FileSystem

from .errors import CorruptDistributedCheckpointError, UnsafeDistributedCheckpointError
from .manifest import Stamp, open_stamped

__all__ = ["SafeLoadPlanner", "VerifiedReader"]


class _StampedFileSystem(FileSystem):
    """DCP's local file system that opens only the stamped files of one folder, for reading."""

    def __init__(self, folder: str, stamps: Mapping[str, Stamp]) -> None:
        self.folder = folder
        self.stamps = dict(stamps)

    @contextlib.contextmanager
    def create_stream(self, path: Any, mode: str) -> Iterator[io.IOBase]:
        name = os.path.basename(os.fspath(path))
        if mode != "rb" or os.path.dirname(os.fspath(path)) != self.folder or name not in self.stamps:
            raise CorruptDistributedCheckpointError(
                f"{self.folder}: the load asked for {os.fspath(path)!r} ({mode}), which the manifest does not list")
        with open_stamped(self.folder, name, self.stamps[name]) as f:
            yield f  # type: ignore[misc]


class VerifiedReader(FileSystemReader):
    """A ``FileSystemReader`` over ``folder`` that uses ``metadata`` as given and reads only stamped files."""

    fs: _StampedFileSystem

    def __init__(self, folder: str, metadata: Any, stamps: Mapping[str, Stamp]) -> None:
        super().__init__(folder)
        self.fs = _StampedFileSystem(folder, stamps)
        self.path = self.fs.init_path(folder)
        self._verified = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("rank") is not None:  # rank-local metadata: never written by save, never read
            raise CorruptDistributedCheckpointError(f"{self.fs.folder}: rank-local metadata is never read")
        from torch.distributed.checkpoint.metadata import StorageMeta

        self._verified.storage_meta = StorageMeta(load_id=self.load_id)
        return self._verified


class SafeLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` over a flat state dict; non-tensor entries load with ``weights_only=True``."""

    def __init__(self, folder: str) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.folder = folder
        self.state_dict: Dict[str, Any] = {}

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(value, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as e:
            if "weights_only" in str(e) or "Weights only" in str(e):
                raise UnsafeDistributedCheckpointError(
                    f"{self.folder}: entry {fqn!r} is not plain data (rebuilding it would run code the file "
                    "names); refused. Only load checkpoints from sources you trust") from None
            raise CorruptDistributedCheckpointError(f"{self.folder}: entry {fqn!r} cannot be read ({e})") from None
        except Exception as e:
            raise CorruptDistributedCheckpointError(
                f"{self.folder}: entry {fqn!r} cannot be read ({type(e).__name__}: {e})") from None
        self.state_dict[fqn] = obj
