"""Compacted-model files: a plain state dict plus the JSON description of the new shapes.

The file is a ``torch.save`` archive of ``{"state_dict": ..., "description": ...}``
that ``torch.load(weights_only=True)`` reads (no code is unpickled). It is
written by the atomic writer and read by the hostile reader, and the
description is checked here as data (its structure and types) before
:func:`prunekit.compact.load_compacted` rebuilds a model from it -- that
rebuilding, which changes modules, belongs to :mod:`prunekit.compact`.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from typing import Any, Dict, Mapping, Tuple

import torch

from .errors import UnreadableFileError
from .reader import open_regular
from .writer import write_with

__all__ = ["COMPACT_FORMAT", "check_description", "write_compacted", "read_compacted"]

COMPACT_FORMAT = "prunekit.compact/1"
_ENTRY_KEYS = {"class", "init", "tensors", "attrs"}


def _scalar_or_list(v: Any) -> bool:
    if isinstance(v, (bool, int, float, str)) or v is None:
        return True
    if isinstance(v, (list, tuple)):
        return len(v) <= 64 and all(isinstance(x, (bool, int, float, str)) or x is None for x in v)
    return False


def check_description(description: Any, where: str = "compaction description") -> Dict[str, Any]:
    """Check a compaction description's structure and types; return it, or raise ``ValueError``.

    A description is ``{"format": "prunekit.compact/1", "modules": {name: entry}}``;
    each entry may hold ``class`` (a name), ``init`` (keyword arguments),
    ``tensors`` (tensor path -> shape, non-negative ints) and ``attrs``
    (attribute path -> a number, string, bool or a short list of them).

    Example:
        >>> d = {"format": "prunekit.compact/1", "modules": {"0": {"tensors": {"weight": [8, 8]},
        ...                                                       "attrs": {"out_features": 8}}}}
        >>> check_description(d) is d
        True
    """
    if not isinstance(description, dict) or description.get("format") != COMPACT_FORMAT:
        got = description.get("format") if isinstance(description, dict) else type(description).__name__
        raise UnreadableFileError(f"{where}: not a compaction description (expected format "
                                  f"{COMPACT_FORMAT!r}, got {got!r})")
    modules = description.get("modules")
    if not isinstance(modules, dict):
        raise UnreadableFileError(f"{where}: 'modules' must map module names to entries")
    for name, entry in modules.items():
        at = f"{where}: module {name!r}"
        if not isinstance(name, str) or not isinstance(entry, dict) or not set(entry) <= _ENTRY_KEYS | {"name"}:
            raise UnreadableFileError(f"{at}: an entry holds only {sorted(_ENTRY_KEYS)}")
        if "class" in entry and not isinstance(entry["class"], str):
            raise UnreadableFileError(f"{at}: 'class' must be a class name")
        init = entry.get("init", {})
        if not isinstance(init, dict) or not all(isinstance(k, str) and _scalar_or_list(v) for k, v in init.items()):
            raise UnreadableFileError(f"{at}: 'init' must map argument names to plain values")
        tensors = entry.get("tensors", {})
        if not isinstance(tensors, dict) or not all(
                isinstance(k, str) and isinstance(s, (list, tuple)) and len(s) <= 64
                and all(type(d) is int and 0 <= d < 2 ** 40 for d in s) for k, s in tensors.items()):
            raise UnreadableFileError(f"{at}: 'tensors' must map tensor paths to shapes of non-negative ints")
        attrs = entry.get("attrs", {})
        if not isinstance(attrs, dict) or not all(isinstance(k, str) and _scalar_or_list(v) for k, v in attrs.items()):
            raise UnreadableFileError(f"{at}: 'attrs' must map attribute paths to plain values")
    return description


def write_compacted(state_dict: Mapping[str, torch.Tensor], description: Mapping[str, Any], path: Any) -> None:
    """Write a compacted model's state dict and description atomically (or into a file object).

    Example:
        >>> import os, tempfile, torch
        >>> p = os.path.join(tempfile.mkdtemp(), "small.pt")
        >>> write_compacted({"w": torch.ones(2)}, {"format": "prunekit.compact/1", "modules": {}}, p)
        >>> read_compacted(p)[1]["format"]
        'prunekit.compact/1'
    """
    check_description(dict(description))
    data = {"state_dict": OrderedDict(state_dict), "description": dict(description)}
    write_with(path, lambda f: torch.save(data, f))


def read_compacted(path: Any) -> Tuple["OrderedDict[str, torch.Tensor]", Dict[str, Any]]:
    """Read a file written by :func:`write_compacted` (or ``prunekit compact --out``): ``(state_dict, description)``.

    The file goes through the hostile reader and ``torch.load(weights_only=True)``;
    the description is checked with :func:`check_description`. Anything wrong is an
    :class:`~prunekit.io.UnreadableFileError` (a ``ValueError``) naming the path.

    Example:
        >>> import os, tempfile, torch
        >>> p = os.path.join(tempfile.mkdtemp(), "small.pt")
        >>> write_compacted({"w": torch.ones(2)}, {"format": "prunekit.compact/1", "modules": {}}, p)
        >>> sd, desc = read_compacted(p); list(sd)
        ['w']
    """
    path = os.fspath(path)
    with open_regular(path, what="compacted model file") as f:
        try:
            obj = torch.load(f, map_location="cpu", weights_only=True)
        except Exception as e:  # torch.load raises UnpicklingError, RuntimeError, struct.error, ... on junk
            lines = str(e).strip().splitlines()
            raise UnreadableFileError(f"{path}: not a compacted model file ({lines[0] if lines else type(e).__name__})"
                                      "; give a file written by prunekit.compact.save_compacted") from None
    if not isinstance(obj, dict) or set(obj) != {"state_dict", "description"}:
        raise UnreadableFileError(f"{path}: not a compacted model file (expected a dict with 'state_dict' and "
                                  "'description'); give a file written by prunekit.compact.save_compacted")
    sd = obj["state_dict"]
    if not isinstance(sd, Mapping) or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in sd.items()):
        raise UnreadableFileError(f"{path}: its 'state_dict' is not a mapping of names to tensors")
    return OrderedDict(sd), check_description(obj["description"], f"{path}: description")


def _write_entry(obj: Mapping[str, Any], path: Any) -> None:
    """The table's writer: ``obj`` is ``{"state_dict": ..., "description": ...}``."""
    if not isinstance(obj, Mapping) or set(obj) != {"state_dict", "description"}:
        raise TypeError("format 'prunekit-compacted' writes {'state_dict': ..., 'description': ...}; "
                        "for a compacted model use prunekit.compact.save_compacted(model, path)")
    write_compacted(obj["state_dict"], obj["description"], path)


def _read_entry(path: Any, **_options: Any) -> Dict[str, Any]:
    """The table's reader: ``{"state_dict": ..., "description": ...}``."""
    sd, desc = read_compacted(path)
    return {"state_dict": sd, "description": desc}
