"""Error types raised by prunekit.

User mistakes raise ``ValueError``, ``TypeError`` or ``IndexError``. Where
``torch.nn.utils.prune`` raises ``AssertionError`` for a user mistake, prunekit
raises :class:`PruningError`, which derives from both ``ValueError`` and
``AssertionError`` so that code written as ``except AssertionError`` keeps
working.
"""

from __future__ import annotations

__all__ = ["PruningError"]


class PruningError(ValueError, AssertionError):
    """A pruning request that cannot be carried out (bad shape, bad mask, ...).

    Example:
        >>> import torch, prunekit
        >>> m = torch.nn.Linear(4, 2)
        >>> try:
        ...     prunekit.l1_unstructured(m, "weight", 0.5, importance_scores=torch.ones(3))
        ... except AssertionError as e:   # torch-era code still catches it
        ...     print(type(e).__name__)
        PruningError
    """
