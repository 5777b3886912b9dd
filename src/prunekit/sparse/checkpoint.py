"""Deprecated module: compressed checkpoints live in :mod:`prunekit.io`.

``from prunekit.sparse.checkpoint import save_compressed`` (and the other
names below) still works and emits a :class:`DeprecationWarning` naming the
new path: :func:`prunekit.io.save_compressed`,
:func:`prunekit.io.load_compressed`, :class:`prunekit.io.CorruptCheckpointError`,
:class:`prunekit.io.CheckpointSignatureError` and
:data:`prunekit.io.compressed.FORMAT_NAME`. (``prunekit.sparse`` itself keeps
re-exporting ``save_compressed``, ``load_compressed`` and
``CorruptCheckpointError`` without a warning.)

Examples:
    >>> import warnings, prunekit.io
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     from prunekit.sparse.checkpoint import save_compressed
    >>> print(caught[0].category.__name__, caught[0].message)
    DeprecationWarning prunekit.sparse.checkpoint is deprecated; import save_compressed from prunekit.io instead
    >>> save_compressed is prunekit.io.save_compressed
    True
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any, List

_HOMES = {  # name -> where it is imported from now
    "save_compressed": "prunekit.io",
    "load_compressed": "prunekit.io",
    "CorruptCheckpointError": "prunekit.io",
    "CheckpointSignatureError": "prunekit.io",
    "FORMAT_NAME": "prunekit.io.compressed",
}

__all__ = list(_HOMES)


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(f"{__name__} is deprecated; import {name} from {home} instead", DeprecationWarning, stacklevel=2)
    return getattr(importlib.import_module(home), name)


def __dir__() -> List[str]:
    return sorted(set(globals()) | set(_HOMES))
