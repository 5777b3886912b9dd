"""Error types raised by prunekit.

User mistakes raise ``ValueError``, ``TypeError`` or ``IndexError``. Where
``torch.nn.utils.prune`` raises ``AssertionError`` for a user mistake, prunekit
raises :class:`PruningError`, which derives from both ``ValueError`` and
``AssertionError`` so that code written as ``except AssertionError`` keeps
working.
"""

from __future__ import annotations

__all__ = ["PruningError", "first_line"]


def first_line(e: BaseException, *, with_type: bool = False) -> str:
    """The first line of an exception's message, for one-line error reports (its type name if empty).

    ``with_type=True`` puts the type first: ``KeyError: 101`` says more than ``101``.

    Examples:
        >>> first_line(ValueError("bad value\\nmore detail"))
        'bad value'
        >>> first_line(KeyError(101), with_type=True)
        'KeyError: 101'
        >>> first_line(RuntimeError())
        'RuntimeError'
    """
    lines = str(e).strip().splitlines()
    if not lines:
        return type(e).__name__
    return f"{type(e).__name__}: {lines[0]}" if with_type else lines[0]


class PruningError(ValueError, AssertionError):
    """A pruning request that cannot be carried out (bad shape, bad mask, ...).

    Examples:
        >>> import torch, prunekit
        >>> m = torch.nn.Linear(4, 2)
        >>> try:
        ...     prunekit.l1_unstructured(m, "weight", 0.5, importance_scores=torch.ones(3))
        ... except AssertionError as e:   # torch-era code still catches it
        ...     print(type(e).__name__)
        PruningError
    """
