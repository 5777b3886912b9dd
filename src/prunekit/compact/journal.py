"""An undo log for module surgery: what compaction changed, restored exactly on failure.

:func:`prune_groups` and ``compact(inplace=True)`` change many modules one after the
other. Before a module's first change its state is recorded (class, attribute dict,
parameters, buffers, submodules, forward pre-hooks, the length of every pruning
container); before a tensor is changed in place its values are copied. On any
exception -- ``KeyboardInterrupt`` included -- :meth:`Journal.rollback` puts every
module back as it was, in reverse order, with ``SIGINT`` deferred until it is done.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Any, Callable, Dict, Iterator, List, Tuple, TypeVar

import torch
from torch import Tensor, nn

__all__ = ["Journal", "atomic", "finish", "run_then_clean"]

_T = TypeVar("_T")


class _ModuleState:
    __slots__ = ("module", "cls", "attrs", "params", "buffers", "modules", "pre_hooks", "non_persistent", "containers")

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.cls = type(module)
        self.attrs = dict(module.__dict__)
        self.params = dict(module._parameters)
        self.buffers = dict(module._buffers)
        self.modules = dict(module._modules)
        self.pre_hooks = dict(module._forward_pre_hooks)
        self.non_persistent = set(module._non_persistent_buffers_set)
        # pruning containers grow in place: remember how many methods each held
        self.containers = [
            (h, tuple(h._pruning_methods)) for h in self.pre_hooks.values() if hasattr(h, "_pruning_methods")
        ]

    def restore(self) -> None:
        m = self.module
        if type(m) is not self.cls:
            m.__class__ = self.cls
        m.__dict__.clear()
        m.__dict__.update(self.attrs)
        for target, saved in (
            (m._parameters, self.params),
            (m._buffers, self.buffers),
            (m._modules, self.modules),
            (m._forward_pre_hooks, self.pre_hooks),
        ):
            target.clear()
            target.update(saved)
        m._non_persistent_buffers_set.clear()
        m._non_persistent_buffers_set.update(self.non_persistent)
        for hook, methods in self.containers:
            hook._pruning_methods = methods


class Journal:
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
        self._modules: Dict[int, _ModuleState] = {}
        self._order: List[_ModuleState] = []
        self._tensors: List[Tuple[Tensor, Tensor, int]] = []
        self._seen_tensors: Dict[int, Tensor] = {}

    def module(self, module: nn.Module) -> None:
        """Record ``module``'s state (only the first call per module counts)."""
        if id(module) not in self._modules:
            state = _ModuleState(module)
            self._modules[id(module)] = state
            self._order.append(state)

    def modules(self, root: nn.Module) -> None:
        """Record ``root`` and every submodule."""
        for m in root.modules():
            self.module(m)

    def tensor(self, t: Tensor) -> None:
        """Copy ``t``'s values before it is changed in place (first call per tensor counts)."""
        if id(t) not in self._seen_tensors:
            self._seen_tensors[id(t)] = t  # keeps ``t`` alive, so its id stays unique
            with torch.no_grad():
                self._tensors.append((t, t.detach().clone(), t._version))

    def rollback(self) -> None:
        """Restore every recorded module and tensor (``SIGINT`` deferred meanwhile)."""
        with _deferred_interrupt():
            with torch.no_grad():
                for t, saved, version in reversed(self._tensors):
                    if t._version != version:
                        t.detach().copy_(saved)
            for state in reversed(self._order):
                state.restore()
            self.clear()

    def clear(self) -> None:
        self._modules.clear()
        self._order.clear()
        self._tensors.clear()
        self._seen_tensors.clear()


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


@contextlib.contextmanager
def _deferred_interrupt() -> Iterator[None]:
    """Hold ``SIGINT`` until the block is done (main thread only), then deliver it."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: List[Any] = []
    try:
        old = signal.signal(signal.SIGINT, lambda *a: pending.append(a))
    except (ValueError, TypeError):  # not allowed here (e.g. an embedded interpreter)
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)
        if pending:
            if old is signal.SIG_DFL or old is None:
                raise KeyboardInterrupt
            if callable(old):
                old(*pending[0])


def finish(cleanup: Any) -> None:
    """Run an idempotent ``cleanup`` (remove hooks, restore modes) to the end: if an exception --
    ``KeyboardInterrupt`` included -- cuts it short, run it once more, then re-raise."""
    try:
        cleanup()
    except BaseException:
        cleanup()
        raise


def run_then_clean(body: Callable[[], _T], cleanup: Callable[[], None]) -> _T:
    """``body()``, with an idempotent ``cleanup`` run to the end however the body ends.

    Install what ``cleanup`` undoes (hooks, eval mode) inside ``body``. A single interrupt
    anywhere is survived: inside the body or the cleanup (see :func:`finish`), and also on the
    call into :func:`finish` -- the first line of the ``finally``, before the cleanup starts --
    which the outer handler catches and cleans up after.

    Examples:
        >>> import torch
        >>> lin, handles = torch.nn.Linear(2, 2), []
        >>> def body():
        ...     handles.append(lin.register_forward_pre_hook(lambda m, a: None))
        ...     return len(lin._forward_pre_hooks)
        >>> run_then_clean(body, lambda: [h.remove() for h in handles]), len(lin._forward_pre_hooks)
        (1, 0)
    """
    try:
        try:
            return body()
        finally:
            finish(cleanup)
    except BaseException:
        cleanup()
        raise
