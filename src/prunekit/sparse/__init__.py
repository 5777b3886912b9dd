"""Sparse payoff of pruning: compressed checkpoints and sparse-kernel inference."""

from .checkpoint import CorruptCheckpointError, load_compressed, save_compressed

__all__ = ["save_compressed", "load_compressed", "CorruptCheckpointError"]
