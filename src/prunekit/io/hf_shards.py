"""A Hugging Face model folder's safetensors weights, read one tensor at a time and rewritten in a copy.

For models larger than memory: nothing here holds more than one tensor.

* :class:`ShardedWeights` -- the folder's weights (``model.safetensors``, or the
  shards a ``model.safetensors.index.json`` names), every header validated
  before a byte of data is read (the hostile reader's checks: lengths against
  the file's size, byte ranges inside the file and covering it exactly, the
  index against the shards), then each tensor read on demand
  (:meth:`ShardedWeights.read`) -- never memory-mapped, so a process whose
  address space is limited below the model's size can read it;
* :func:`copy_model_files` -- the folder's regular files (config,
  tokenizer, index, shards, sub-folders) copied into another folder (the kernel copies;
  no byte passes through this process);
* :class:`ShardPatcher` -- tensors of that copy overwritten in place, each
  with one of the same dtype and shape, so the copy keeps the source's shard
  layout, headers and index byte for byte except the bytes of the tensors
  written.

Files only: nothing here knows a model.

Examples:
    >>> import os, tempfile, torch
    >>> from safetensors.torch import save_file
    >>> src, out = tempfile.mkdtemp(), tempfile.mkdtemp()
    >>> save_file({"a": torch.ones(2), "b": torch.zeros(3)}, os.path.join(src, "model.safetensors"))
    >>> with ShardedWeights(src) as weights:
    ...     _ = copy_model_files(src, out)
    ...     with ShardPatcher(out, weights) as patch:
    ...         patch.write("b", torch.full((3,), 7.0))
    ...     weights.names(), weights.read("a").tolist()
    (['a', 'b'], [1.0, 1.0])
    >>> with ShardedWeights(out) as copy:
    ...     copy.read("b").tolist()
    [7.0, 7.0, 7.0]
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
from typing import IO, Any, Dict, List, Optional, Tuple, TypeVar

import torch

from .errors import UnreadableFileError
from .plain import SAFETENSORS_TAG_OF, tensor_bytes
from .reader import (
    TEXT_LIMIT,
    SafetensorsHeader,
    loads_json_strict,
    open_in_folder,
    read_safetensors_header,
    read_safetensors_tensor,
)

__all__ = ["INDEX_FILE", "SINGLE_FILE", "ShardPatcher", "ShardedWeights", "copy_model_files", "weight_map_of"]

_S = TypeVar("_S", bound="_Shards")

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def weight_map_of(index: Any, where: str) -> Dict[str, str]:
    """The ``weight_map`` (tensor name -> shard file name) of a parsed index file, checked.

    Examples:
        >>> weight_map_of({"weight_map": {"w": "model-1.safetensors"}}, "index")
        {'w': 'model-1.safetensors'}
    """
    if not isinstance(index, dict) or not isinstance(index.get("weight_map"), dict) or not index["weight_map"]:
        raise UnreadableFileError(f"{where}: must be an object with a non-empty 'weight_map' (tensor name -> file)")
    weight_map = index["weight_map"]
    bad = [(k, v) for k, v in weight_map.items() if not isinstance(v, str) or not v.endswith(".safetensors")]
    if bad:
        raise UnreadableFileError(f"{where}: weight_map puts {bad[0][0]!r} in {bad[0][1]!r}, which is not a "
                                  ".safetensors file name")
    return weight_map


def read_json_file(f: IO[bytes], where: str) -> Any:
    """Strict JSON from the open file ``f`` (at most :data:`~prunekit.io.reader.TEXT_LIMIT` bytes)."""
    # sized by the file, not by the limit: read(limit) would set aside the whole limit first
    size = os.fstat(f.fileno()).st_size
    data = f.read(min(size, TEXT_LIMIT) + 1)
    if len(data) > TEXT_LIMIT:
        raise UnreadableFileError(f"{where}: larger than {TEXT_LIMIT} bytes; a JSON file is never that large")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UnreadableFileError(f"{where}: not UTF-8 text (byte {e.start})") from None
    return loads_json_strict(text, where)


class _Shards:
    """Open shard files by name, closed together by :meth:`close` (or at the end of a ``with``)."""

    _files: Dict[str, IO[bytes]]

    def close(self) -> None:
        """Close the shards (flushing what was written)."""
        while self._files:
            self._files.popitem()[1].close()

    def __enter__(self: _S) -> _S:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class ShardedWeights(_Shards):
    """The safetensors weights of the Hugging Face model folder ``folder``, read lazily.

    Opening checks every shard's header (and the index against them); :meth:`read` then reads one
    tensor. Close it (or use it in a ``with``) to close the shards.
    """

    def __init__(self, folder: Any) -> None:
        self.folder = os.fspath(folder)
        try:
            st = os.stat(self.folder)
        except FileNotFoundError:
            raise FileNotFoundError(errno.ENOENT, "no such model folder", self.folder) from None
        if not stat.S_ISDIR(st.st_mode):
            raise UnreadableFileError(f"{self.folder}: not a folder; give a Hugging Face model folder")
        self._files: Dict[str, IO[bytes]] = {}
        self.headers: Dict[str, SafetensorsHeader] = {}
        self.where: Dict[str, str] = {}  # tensor name -> shard file name
        self.index: Optional[str] = None
        try:
            self._open()
        except BaseException:
            self.close()
            raise

    def _open(self) -> None:
        names = set(os.listdir(self.folder))
        weight_map: Optional[Dict[str, str]] = None
        if SINGLE_FILE in names:  # what transformers loads first
            files = [SINGLE_FILE]
        elif INDEX_FILE in names:
            where = os.path.join(self.folder, INDEX_FILE)
            with open_in_folder(self.folder, INDEX_FILE, what="index file") as f:
                weight_map = weight_map_of(read_json_file(f, where), where)
            files = sorted(set(weight_map.values()))
            self.index = INDEX_FILE
        else:
            raise UnreadableFileError(f"{self.folder}: no {SINGLE_FILE} and no {INDEX_FILE}; expected a Hugging Face "
                                      "model folder with safetensors weights (save it with "
                                      "save_pretrained(..., safe_serialization=True))")
        for name in files:  # every name is checked (plain names, regular files, no links) before a byte is read
            self._files[name] = open_in_folder(self.folder, name, what="safetensors file")
        for name, f in self._files.items():
            p = os.path.join(self.folder, name)
            header = read_safetensors_header(f, p)
            self.headers[name] = header
            for k in header.tensors:
                if weight_map is not None and weight_map.get(k) != name:
                    raise UnreadableFileError(f"{p}: holds tensor {k!r}, which {INDEX_FILE} "
                                              + (f"puts in {weight_map[k]!r}" if k in weight_map else "does not list"))
                if k in self.where:
                    raise UnreadableFileError(f"{p}: holds tensor {k!r}, which {self.where[k]} holds too")
                self.where[k] = name
        if weight_map is not None:
            missing = [k for k in weight_map if k not in self.where]
            if missing:
                raise UnreadableFileError(f"{os.path.join(self.folder, weight_map[missing[0]])}: has no tensor "
                                          f"{missing[0]!r}, which {INDEX_FILE} puts there")

    def names(self) -> List[str]:
        """Every tensor name, shard by shard in file order."""
        return list(self.where)

    def __contains__(self, name: object) -> bool:
        return name in self.where

    def entry(self, name: str) -> Tuple[str, List[int]]:
        """``(safetensors dtype tag, shape)`` of tensor ``name``."""
        tag, shape, _ = self.headers[self.where[name]].tensors[name]
        return tag, list(shape)

    def nbytes(self) -> int:
        """Bytes of every tensor's data."""
        return sum(end - begin for h in self.headers.values() for _, _, (begin, end) in h.tensors.values())

    def read(self, name: str) -> torch.Tensor:
        """Tensor ``name``, read from its shard now (a CPU tensor of its stored dtype)."""
        if name not in self.where:
            raise KeyError(f"{self.folder}: no tensor named {name!r} in the model's safetensors files")
        shard = self.where[name]
        return read_safetensors_tensor(self._files[shard], self.headers[shard], name)



def copy_model_files(src: Any, dst: Any) -> List[str]:
    """Copy the regular files of the folder ``src`` (and of its sub-folders: a sentence-transformers model
    keeps its pooling there) into the folder ``dst``; return their relative names.

    Links are left out (a model folder holds plain files; a link could lead anywhere). The kernel copies
    the bytes (``copy_file_range``/``sendfile``): none passes through this process.
    """
    src, dst = os.fspath(src), os.fspath(dst)
    copied = []
    for root, dirs, files in os.walk(src):
        dirs[:] = sorted(d for d in dirs if not os.path.islink(os.path.join(root, d)))
        rel = os.path.relpath(root, src)
        target = dst if rel == "." else os.path.join(dst, rel)
        if rel != ".":
            os.mkdir(target)
        for name in sorted(files):
            p = os.path.join(root, name)
            if os.path.islink(p) or not os.path.isfile(p):
                continue
            shutil.copyfile(p, os.path.join(target, name))
            copied.append(name if rel == "." else os.path.join(rel, name))
    return copied


class ShardPatcher(_Shards):
    """Overwrite tensors of ``folder`` -- a copy of the folder ``weights`` was read from -- in place.

    Each tensor written must have the dtype and shape the header gives it; its bytes replace the stored
    ones at the same offset, so every header and the index stay valid.
    """

    def __init__(self, folder: Any, weights: ShardedWeights) -> None:
        self.folder = os.fspath(folder)
        self.weights = weights
        self._files: Dict[str, IO[bytes]] = {}

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Replace the stored bytes of tensor ``name`` by ``tensor``'s."""
        tag, shape = self.weights.entry(name)
        if SAFETENSORS_TAG_OF.get(tensor.dtype) != tag or list(tensor.shape) != shape:
            raise ValueError(f"{self.folder}: tensor {name!r} is stored as {tag} {shape}; cannot write a "
                             f"{tensor.dtype} {list(tensor.shape)} in its place")
        shard = self.weights.where[name]
        header = self.weights.headers[shard]
        f = self._files.get(shard)
        if f is None:
            f = self._files[shard] = open(os.path.join(self.folder, shard), "r+b")
        f.seek(header.data_start + header.tensors[name][2][0])
        f.write(tensor_bytes(tensor))

