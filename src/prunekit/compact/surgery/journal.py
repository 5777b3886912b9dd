"""An undo log for module surgery: what compaction changed, restored exactly on failure.

:func:`prune_groups` and ``compact(inplace=True)`` change many modules one after the
other. Before a module's first change its state is recorded (class, attribute dict,
parameters, buffers, submodules, forward pre-hooks, the methods of every pruning
container); before a tensor is changed in place its values are copied. On any
exception -- ``KeyboardInterrupt`` included -- :meth:`Journal.rollback` puts every
module back as it was, newest first, with ``SIGINT`` deferred until it is done.

The mechanism is :mod:`prunekit.transaction`'s (one for all of prunekit): a
:class:`Journal` is a :class:`~prunekit.transaction.Transaction` whose module
records re-derive mask caches and RNN flat weights after a restore
(:func:`prunekit.reparam._internal.after_restore`).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

from ...reparam._internal import after_restore
from ...transaction import Transaction, finish, run_then_clean

__all__ = ["Journal", "atomic", "finish", "run_then_clean"]


class Journal(Transaction):
    """Records module states before they change; :meth:`rollback` restores them all.

    Examples:
        >>> import torch
        >>> m = torch.nn.Linear(3, 2)
        >>> w = m.weight
        >>> j = Journal()
        >>> j.module(m); j.tensor(m.weight)
        >>> with torch.no_grad():
        ...     _ = m.weight.zero_()
        >>> m.weight = torch.nn.Parameter(torch.ones(5, 5))
        >>> j.rollback()
        >>> m.weight is w, bool(m.weight.abs().sum() > 0)
        (True, True)
    """

    def __init__(self) -> None:
        super().__init__(after_restore)


@contextlib.contextmanager
def atomic() -> Iterator[Journal]:
    """A :class:`Journal` rolled back if the block raises anything (``KeyboardInterrupt`` included).

    Examples:
        >>> import torch
        >>> m = torch.nn.Linear(3, 2)
        >>> try:
        ...     with atomic() as j:
        ...         j.module(m)
        ...         m.bias = None
        ...         raise KeyboardInterrupt
        ... except KeyboardInterrupt:
        ...     pass
        >>> m.bias is not None
        True
    """
    journal = Journal()
    try:
        yield journal
    except BaseException:
        journal.rollback()
        raise
    # committed: nothing more runs here (no step an interrupt could cut between the block and the caller);
    # the saved states are freed with the journal
