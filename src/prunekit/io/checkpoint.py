"""Reading checkpoint files of any kind as a state dict (what ``prunekit inspect`` accepts).

:func:`read_checkpoint` recognises the file through the table of encodings
(:mod:`prunekit.io.formats`): a prunekit compressed checkpoint, a plain
safetensors file, a Hugging Face folder in the compressed-tensors layout, or a
``torch.save`` file -- read with ``torch.load(weights_only=True)``, never
unpickling arbitrary objects unless asked to. Every path goes through the
hostile reader first: a FIFO, a device or a directory that holds no model is
refused before a byte is read, and whatever is wrong with a file is a
``ValueError`` (or ``FileNotFoundError``) whose message starts with the path.

The readers here share one signature, ``reader(path, *, trust_pickle=False,
key=None)``, so the table can call any of them.
"""

from __future__ import annotations

import os
import pickle
import zipfile
from collections import OrderedDict
from typing import Any, Mapping, Optional, Tuple, Union

import torch

from ..errors import first_line
from .errors import CheckpointSignatureError, UnreadableFileError, UnsafeCheckpointError
from .plain import tied_of
from .reader import open_regular, read_safetensors

__all__ = ["read_checkpoint", "read_torch", "read_plain_safetensors", "read_prunekit", "unwrap_state_dict"]

PathLike = Union[str, "os.PathLike[str]"]


def _unreadable(path: str, detail: str = "") -> UnreadableFileError:
    """The error for a file that is neither a torch checkpoint nor safetensors, saying what to give instead."""
    return UnreadableFileError(
        f"{path}: not a torch checkpoint or a safetensors file" + (f" ({detail})" if detail else "")
        + "; give a file written by torch.save(model.state_dict(), path), safetensors.torch.save_file "
        "or prunekit.sparse.save_compressed"
    )


def _unsigned(path: str, kind: str) -> CheckpointSignatureError:
    """The error for a file read with a key that cannot carry a signature (checked before it is read)."""
    return CheckpointSignatureError(
        f"{path}: a key was given, but this {kind} file carries no signature (only prunekit compressed "
        "checkpoints written with save_compressed(..., key=...) are signed); refusing an unauthenticated file"
    )


def unwrap_state_dict(obj: Any, path: str) -> "OrderedDict[str, torch.Tensor]":
    """A state dict out of what ``torch.load`` returned (a dict, a ``{'state_dict': ...}``, a module).

    Examples:
        >>> import torch
        >>> list(unwrap_state_dict({"state_dict": {"w": torch.ones(1)}, "epoch": 3}, "ckpt.pt"))
        ['w']
    """
    state_dict = getattr(obj, "state_dict", None)
    if callable(state_dict) and not isinstance(obj, Mapping):  # a (trusted, unpickled) module
        return OrderedDict(state_dict())
    if isinstance(obj, Mapping):
        for key in ("state_dict", "model_state_dict", "model"):
            inner = obj.get(key)
            if isinstance(inner, Mapping) and inner and all(isinstance(v, torch.Tensor) for v in inner.values()):
                return OrderedDict(inner)
        tensors = OrderedDict((k, v) for k, v in obj.items() if isinstance(k, str) and isinstance(v, torch.Tensor))
        if tensors:
            return tensors
    raise UnreadableFileError(
        f"{path}: holds a {type(obj).__name__} with no tensors; expected a state dict "
        "(torch.save(model.state_dict(), path)) or a dict with a 'state_dict' entry"
    )


def read_torch(path: PathLike, *, trust_pickle: bool = False, key: Any = None) -> "OrderedDict[str, torch.Tensor]":
    """Read a ``torch.save`` file: ``weights_only=True`` unless ``trust_pickle``; a state dict.

    A torch file carries no signature: with a ``key`` it is refused before a
    byte is read (so nothing is unpickled, ``trust_pickle`` or not).

    Examples:
        >>> import os, tempfile, torch
        >>> p = os.path.join(tempfile.mkdtemp(), "m.pt"); torch.save(torch.nn.Linear(2, 2).state_dict(), p)
        >>> list(read_torch(p))
        ['weight', 'bias']
    """
    path = os.fspath(path)
    if key is not None:
        raise _unsigned(path, "torch")
    with open_regular(path, what="checkpoint file") as f:
        try:
            obj = torch.load(f, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as e:
            if not trust_pickle:
                if "Unsupported global" not in str(e) and not zipfile.is_zipfile(f):
                    detail = [ln.strip() for ln in str(e).splitlines() if ln.strip().startswith("Unsupported")]
                    raise _unreadable(path, " ".join(detail)) from e
                raise UnsafeCheckpointError(
                    f"{path}: loading it needs full unpickling, which can run arbitrary code; "
                    "pass --trust-pickle (trust_pickle=True) only if you trust where the file comes from"
                ) from e
            f.seek(0)
            try:
                obj = torch.load(f, map_location="cpu", weights_only=False)
            except (pickle.UnpicklingError, RuntimeError, EOFError) as e2:
                raise _unreadable(path, first_line(e2, with_type=True)) from e2
        except Exception as e:  # torch.load raises RuntimeError, EOFError, KeyError, ... on files it cannot read
            raise _unreadable(path, first_line(e, with_type=True)) from e
    return unwrap_state_dict(obj, path)


def read_plain_safetensors(path: PathLike, *, trust_pickle: bool = False,
                           key: Any = None) -> "OrderedDict[str, torch.Tensor]":
    """Read a plain safetensors file through the hostile reader (header validated first).

    Tied names that :func:`prunekit.io.plain.write_safetensors` listed in the
    metadata come back as the very tensor they are tied to.

    Examples:
        >>> import os, tempfile, torch
        >>> from safetensors.torch import save_file
        >>> p = os.path.join(tempfile.mkdtemp(), "a.safetensors"); save_file({"w": torch.ones(3)}, p)
        >>> read_plain_safetensors(p)["w"].tolist()
        [1.0, 1.0, 1.0]
    """
    path = os.fspath(path)
    if key is not None:
        raise _unsigned(path, "safetensors")
    try:
        tensors, metadata = read_safetensors(path)
        tied = tied_of(tensors, metadata, path)
    except UnreadableFileError as e:
        msg = str(e)
        detail = msg[len(path) + 2:] if msg.startswith(path + ": ") else msg
        raise UnreadableFileError(
            f"{path}: not a readable safetensors file ({detail}); give a file written by "
            "safetensors.torch.save_file or prunekit.sparse.save_compressed"
        ) from None
    out = OrderedDict(tensors)
    for name, stored in tied.items():  # tied tensors: one tensor under each name, as in the saved state dict
        out[name] = out[stored]
    return out


def read_prunekit(path: PathLike, *, trust_pickle: bool = False, key: Any = None) -> "OrderedDict[str, torch.Tensor]":
    """Read a prunekit compressed checkpoint (the table's reader for it).

    Examples:
        >>> import os, tempfile, torch
        >>> from prunekit.io import save_compressed
        >>> p = os.path.join(tempfile.mkdtemp(), "m.safetensors"); save_compressed({"w": torch.zeros(9)}, p)
        >>> read_prunekit(p)["w"].tolist() == [0.0] * 9
        True
    """
    from .compressed import load_compressed

    return load_compressed(path, key=key)


def read_checkpoint(path: PathLike, *, trust_pickle: bool = False,
                    key: Optional[Any] = None) -> Tuple["OrderedDict[str, torch.Tensor]", str]:
    """Read a checkpoint file as a state dict; returns ``(state_dict, kind)``.

    ``kind`` is the format's name in the table of encodings:
    ``"prunekit-compressed"``, ``"safetensors"``, ``"compressed-tensors"`` or
    ``"torch"``. ``.pt``/``.pth`` files are read with
    ``torch.load(weights_only=True)``; a file that needs full unpickling (a
    pickled module, custom classes) raises :class:`UnsafeCheckpointError`
    unless ``trust_pickle=True``, because unpickling runs whatever code the
    file names. ``key`` verifies a signed prunekit checkpoint; with a key, a
    file that carries no signature (an unsigned prunekit checkpoint, or any
    other format) raises :class:`CheckpointSignatureError`, as
    ``load_compressed`` does. A key means "authenticated files only": the
    format is recognised from the file's first bytes and safetensors header
    alone, and anything but a prunekit checkpoint is refused before it is
    read -- a torch file is never unpickled, even with ``trust_pickle=True``.

    Examples:
        >>> import os, tempfile, torch
        >>> from prunekit.io import read_checkpoint
        >>> path = os.path.join(tempfile.mkdtemp(), "m.pt")
        >>> torch.save(torch.nn.Linear(2, 2).state_dict(), path)
        >>> sd, kind = read_checkpoint(path)
        >>> list(sd), kind
        (['weight', 'bias'], 'torch')
    """
    from .formats import ENCODINGS, probe, read

    if key is None:
        return read(path, trust_pickle=trust_pickle)
    pr = probe(path)  # regular file or folder, first bytes, validated safetensors header: nothing decoded
    kind = next((e.name for e in ENCODINGS.values() if e.reader and e.claims is not None and e.claims(pr)), None)
    if kind is None:
        return read(path, key=key)  # a folder no format claims: refused by the table, naming the path
    if kind != "prunekit-compressed":
        raise _unsigned(os.fspath(path), kind)
    return read(path, format=kind, key=key)


def write_torch(obj: Any, path: PathLike) -> None:
    """``torch.save`` of a state dict (or a module's), atomically: the table's writer for ``"torch"``.

    Examples:
        >>> import os, tempfile, torch
        >>> p = os.path.join(tempfile.mkdtemp(), "m.pt"); write_torch(torch.nn.Linear(2, 2), p)
        >>> list(read_torch(p))
        ['weight', 'bias']
    """
    from .writer import write_with

    state_dict = getattr(obj, "state_dict", None)
    if callable(state_dict) and not isinstance(obj, Mapping):
        obj = state_dict()
    write_with(path, lambda f: torch.save(obj, f))
