"""Errors of the compaction package."""

from __future__ import annotations

__all__ = ["CompactionError", "TraceError"]


class TraceError(RuntimeError):
    """The model's forward pass failed while prunekit traced it."""


class CompactionError(RuntimeError):
    """Compaction produced a model whose output differs from the masked model's (nothing was changed)."""
