"""Everything prunekit reads and writes: one atomic writer, one hostile reader, a table of encodings.

* :mod:`~prunekit.io.writer` -- the one atomic writer (temp file, fsync,
  rename, directory fsync, umask permissions, symlinks followed, nothing left
  behind on failure, errors naming your path): :func:`atomic_write`,
  :func:`atomic_path`, :func:`write_bytes`, :func:`write_text`,
  :func:`write_json`, :func:`write_with`, :func:`save_torch`.
* :mod:`~prunekit.io.reader` -- the one hostile-input reader (regular files
  only, bounded reads, strict JSON, validated safetensors headers):
  :func:`open_regular`, :func:`read_text`, :func:`read_json`,
  :func:`read_yaml`, :func:`read_config`, :func:`read_safetensors`.
* :mod:`~prunekit.io.formats` -- the table of encodings
  (:data:`ENCODINGS`): prunekit's compressed checkpoints, plain safetensors,
  ``torch.save`` files, compressed-tensors model folders, compacted-model
  descriptions. :func:`save_compressed` writes any of them,
  :func:`read_checkpoint` recognises and reads them.

The file layer deals in tensors, dicts, bytes and files; it never changes a
model. It imports nothing from prunekit's other packages except the backend
check, so every layer may use it.
"""

from __future__ import annotations

from typing import Any

from .errors import CheckpointSignatureError, CorruptCheckpointError, UnreadableFileError, UnsafeCheckpointError
from .formats import ENCODINGS, Encoding, Probe, encoding, probe, read, register_encoding, save
from .reader import (
    loads_json_strict,
    open_regular,
    read_config,
    read_json,
    read_safetensors,
    read_text,
    read_yaml,
)
from .writer import atomic_path, atomic_write, resolve_target, write_bytes, write_json, write_text, write_with
from .api import save_compressed
from .compressed import UnverifiedSignatureWarning, load_compressed
from .checkpoint import read_checkpoint

__all__ = [
    "CheckpointSignatureError",
    "CorruptCheckpointError",
    "ENCODINGS",
    "Encoding",
    "Probe",
    "UnreadableFileError",
    "UnsafeCheckpointError",
    "UnverifiedSignatureWarning",
    "atomic_path",
    "atomic_write",
    "encoding",
    "load_compressed",
    "loads_json_strict",
    "open_regular",
    "probe",
    "read",
    "read_checkpoint",
    "read_config",
    "read_json",
    "read_safetensors",
    "read_text",
    "read_yaml",
    "register_encoding",
    "resolve_target",
    "save",
    "save_compressed",
    "save_torch",
    "write_bytes",
    "write_json",
    "write_text",
    "write_with",
]


def save_torch(obj: Any, path: Any) -> None:
    """``torch.save(obj, path)`` through the atomic writer (a file object is written directly).

    Examples:
        >>> import os, tempfile, torch
        >>> p = os.path.join(tempfile.mkdtemp(), "x.pt")
        >>> save_torch({"w": torch.ones(2)}, p)
        >>> torch.load(p, weights_only=True)["w"].tolist()
        [1.0, 1.0]
    """
    import torch

    write_with(path, lambda f: torch.save(obj, f))


# ----------------------------------------------------------------------------- the table
def _is_prunekit(p: Probe) -> bool:
    from .compressed import is_compressed_header

    return p.safetensors is not None and is_compressed_header(p.safetensors)


register_encoding(Encoding(
    "prunekit-compressed", "prunekit's compressed checkpoint: one safetensors file, bitmask + values, checksummed",
    writer=".compressed:write_compressed", reader=".checkpoint:read_prunekit", claims=_is_prunekit,
    extra="io", aliases=("prunekit",)))
register_encoding(Encoding(
    "compressed-tensors", "a Hugging Face model folder in the compressed-tensors sparse layout (what vLLM serves)",
    writer=".compressed_tensors:write_compressed_tensors", reader=".compressed_tensors:read_compressed_tensors",
    claims=lambda p: p.kind == "directory" and "config.json" in p.entries, extra="compressed-tensors"))
register_encoding(Encoding(
    "safetensors", "a plain safetensors file (dense tensors)",
    writer=".plain:write_safetensors", reader=".checkpoint:read_plain_safetensors",
    claims=lambda p: p.kind == "file" and (p.safetensors is not None or p.path.endswith(".safetensors")),
    extra="io"))
register_encoding(Encoding(
    "prunekit-compacted", "a compacted model: torch.save of a plain state dict + the JSON description of its shapes",
    writer=".compacted:_write_entry", reader=".compacted:_read_entry"))
register_encoding(Encoding(
    "torch", "a torch.save file (read with weights_only=True unless trust_pickle)",
    writer=".checkpoint:write_torch", reader=".checkpoint:read_torch", claims=lambda p: p.kind == "file"))
