"""Compressed checkpoints for pruned models (moved to :mod:`prunekit.io`; these names stay).

The format, its hostile reader and its writer live in
:mod:`prunekit.io.compressed`; :func:`save_compressed` also writes the other
formats of the table of encodings (``format="compressed-tensors"``, ...).

Examples:
    >>> import os, tempfile, torch
    >>> from prunekit.sparse.checkpoint import save_compressed, load_compressed
    >>> path = os.path.join(tempfile.mkdtemp(), "m.safetensors")
    >>> save_compressed({"w": torch.zeros(16)}, path)
    >>> load_compressed(path)["w"].count_nonzero().item()
    0
"""

from __future__ import annotations

from ..io.api import save_compressed
from ..io.compressed import (
    FORMAT_NAME,
    CheckpointSignatureError,
    CorruptCheckpointError,
    load_compressed,
)

__all__ = ["save_compressed", "load_compressed", "CorruptCheckpointError", "CheckpointSignatureError", "FORMAT_NAME"]
