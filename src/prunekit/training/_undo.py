"""Undo logs: what a pruner callback changed, put back if the callback fails.

Every callback that changes a model (a mask update, re-masking the weights,
loading a checkpoint) records, before each in-place change, how to restore
the entries it is about to change. On any exception -- ``KeyboardInterrupt``
included -- the log runs newest first and the model, the gradients and the
optimizer state are bit for bit what they were (``-0.0`` and NaN included).

Only the entries that change are saved: zeroing a tensor at pruned entries
saves the non-zero values there, not the whole tensor.
"""

from __future__ import annotations

from typing import Any

from .. import _sharded
from .._backend import TORCH, backend_of
from ..transaction import Transaction

__all__ = ["UndoLog", "zero_where_"]


class UndoLog(Transaction):
    """Restore steps, run newest first by :meth:`rollback` (a :class:`~prunekit.transaction.Transaction`).

    Examples:
        >>> from prunekit.training._undo import UndoLog
        >>> seen = []
        >>> log = UndoLog()
        >>> log.add(lambda: seen.append("first")); log.add(lambda: seen.append("second"))
        >>> log.rollback(); seen
        ['second', 'first']
    """


def zero_where_(t: Any, keep: Any, undo: "UndoLog | None") -> None:
    """``t *= keep`` in place (``keep`` a 0/1 tensor of ``t``'s shape), recording the
    entries it changes in ``undo`` (when given) so that a rollback restores them.

    The product changes only non-zero entries where ``keep`` is 0 (a zero times
    0 keeps its sign), so only those are saved.

    Examples:
        >>> import torch
        >>> from prunekit.training._undo import UndoLog, zero_where_
        >>> t = torch.tensor([1., -2., 0., 3.]); log = UndoLog()
        >>> zero_where_(t, torch.tensor([1., 0., 0., 1.]), log); t
        tensor([1., -0., 0., 3.])
        >>> log.rollback(); t
        tensor([ 1., -2.,  0.,  3.])
    """
    b = backend_of(t) or TORCH
    k = keep if keep.dtype == t.dtype else keep.to(t.dtype)
    if undo is not None and _sharded.handler_for(t) is not None:
        undo = None  # DTensor shards are changed in step across ranks: not recorded (see Pruner.update_masks)
    with b.no_grad():
        if undo is not None:
            undo.entries(t, (k == 0) & (t != 0))
        b.mul_(t, k)
