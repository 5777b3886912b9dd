"""The one rollback mechanism: record what a call is about to change, put it back if the call fails.

Every failure-atomic operation of prunekit (pruning a tensor, removing a mask,
compaction, a training callback, loading masks) records here, before each change,
what the change overwrites; on any exception -- ``KeyboardInterrupt`` included --
the record is played back newest first and the model is what it was.

* :class:`ModuleState` -- a module's structure: class, attribute dict, parameters,
  buffers, submodules, forward pre-hooks, non-persistent buffer names and the
  methods of every pruning container. Only references are kept (the dicts are
  shallow copies), so no tensor is copied: a restore re-assigns the original
  objects. An ``after_restore`` hook re-derives what is computed from them
  (mask caches, an RNN's flat weights).
* :class:`Transaction` -- an undo log: module states, tensor values (copied only
  for tensors changed in place, and only the entries that change when the caller
  knows them), custom undo steps, and hooks run once on commit or on rollback.
  :meth:`Transaction.rollback` holds ``SIGINT`` until it is done.
* :func:`atomic` -- a :class:`Transaction` rolled back if the ``with`` block raises.
* :func:`run_then_clean` / :func:`finish` -- run an idempotent cleanup to the end.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple, TypeVar

from torch import nn

from ._backend import TORCH, backend_of

__all__ = ["ModuleState", "Transaction", "atomic", "finish", "run_then_clean"]

_T = TypeVar("_T")
AfterRestore = Callable[[nn.Module, "ModuleState"], None]


class ModuleState:
    """A module's structure, recorded by reference, and :meth:`restore` to put it back.

    ``after_restore(module, state)``, when given, runs at the end of every restore.

    Examples:
        >>> import torch
        >>> m = torch.nn.Linear(3, 2)
        >>> w, state = m.weight, ModuleState(m)
        >>> m.weight = torch.nn.Parameter(torch.zeros(2, 3)); m.bias = None
        >>> state.restore()
        >>> m.weight is w, m.bias is not None
        (True, True)
    """

    __slots__ = ("module", "cls", "attrs", "params", "buffers", "modules", "pre_hooks", "non_persistent",
                 "containers", "after_restore")

    def __init__(self, module: nn.Module, after_restore: Optional[AfterRestore] = None) -> None:
        self.module = module
        self.cls = type(module)
        self.attrs = dict(module.__dict__)  # plain attributes (torch.nn.utils.prune keeps `name` there)
        self.params = dict(module._parameters)
        self.buffers = dict(module._buffers)
        self.modules = dict(module._modules)
        self.pre_hooks = dict(module._forward_pre_hooks)
        self.non_persistent = set(module._non_persistent_buffers_set)
        # pruning containers grow (their methods are replaced, or a list appended to): keep the object and its items
        self.containers: List[Tuple[Any, Any, Tuple[Any, ...]]] = [
            (h, h._pruning_methods, tuple(h._pruning_methods))
            for h in self.pre_hooks.values() if hasattr(h, "_pruning_methods")
        ]
        self.after_restore = after_restore

    def restore(self) -> None:
        """Put the recorded structure back (the same objects; the train/eval flag as it is now), then run
        ``after_restore``."""
        m = self.module
        if type(m) is not self.cls:
            m.__class__ = self.cls
        # drop the new keys, then re-assign the old: the attribute dict is never empty meanwhile. The
        # train/eval flag stays as it is: a call that changes modes puts them back in its own cleanup
        # (run_then_clean), which may run before this rollback -- a record taken in eval mode must not win.
        training = m.__dict__.get("training")
        for key in [k for k in m.__dict__ if k not in self.attrs]:
            del m.__dict__[key]
        m.__dict__.update(self.attrs)
        if training is not None:
            m.__dict__["training"] = training
        tables: List[Tuple[Dict[Any, Any], Dict[Any, Any]]] = [
            (m._parameters, self.params),
            (m._buffers, self.buffers),
            (m._modules, self.modules),
            (m._forward_pre_hooks, self.pre_hooks),
        ]
        for target, saved in tables:
            target.clear()
            target.update(saved)
        m._non_persistent_buffers_set.clear()
        m._non_persistent_buffers_set.update(self.non_persistent)
        for hook, methods, items in self.containers:
            if isinstance(methods, list):
                methods[:] = items
            hook._pruning_methods = methods
        if self.after_restore is not None:
            self.after_restore(m, self)


class Transaction:
    """An undo log: what a call changed, put back newest first by :meth:`rollback`.

    * :meth:`module` / :meth:`modules` -- record a module's structure (first call per module counts);
    * :meth:`tensor` -- copy a tensor before it is changed in place (first call per tensor counts;
      restored only if its version moved);
    * :meth:`entries` -- keep only the entries ``where`` of a tensor that is about to change there;
    * :meth:`add` -- any restore step;
    * :meth:`on_commit` / :meth:`on_rollback` -- hooks run once, at :meth:`commit` or after the
      undo steps of :meth:`rollback`.

    Examples:
        >>> import torch
        >>> m, seen = torch.nn.Linear(3, 2), []
        >>> w, before = m.weight, m.weight.detach().clone()
        >>> txn = Transaction()
        >>> txn.module(m); txn.tensor(m.weight); txn.on_rollback(lambda: seen.append("rolled back"))
        >>> with torch.no_grad():
        ...     _ = m.weight.zero_()
        >>> m.weight = torch.nn.Parameter(torch.ones(5, 5))
        >>> txn.rollback()
        >>> m.weight is w, torch.equal(m.weight, before), seen
        (True, True, ['rolled back'])
    """

    def __init__(self, after_restore: Optional[AfterRestore] = None) -> None:
        self._after_restore = after_restore
        self._steps: List[Callable[[], None]] = []
        self._modules: Dict[int, ModuleState] = {}
        self._tensors: Dict[int, Any] = {}  # keeps each recorded tensor alive, so its id stays unique
        self._commit_hooks: List[Callable[[], None]] = []
        self._rollback_hooks: List[Callable[[], None]] = []

    # ------------------------------------------------------------------ record
    def module(self, module: nn.Module) -> None:
        """Record ``module``'s structure (only the first call per module counts)."""
        if id(module) not in self._modules:
            state = ModuleState(module, self._after_restore)
            self._modules[id(module)] = state
            self._steps.append(state.restore)

    def modules(self, root: nn.Module) -> None:
        """Record ``root`` and every submodule."""
        for m in root.modules():
            self.module(m)

    def tensor(self, t: Any) -> None:
        """Copy ``t``'s values before it is changed in place (only the first call per tensor counts).

        A rollback writes them back only if ``t``'s in-place version moved since.
        """
        if id(t) in self._tensors:
            return
        self._tensors[id(t)] = t
        b = backend_of(t) or TORCH
        with b.no_grad():
            saved = t.detach().clone()
        version = getattr(t, "_version", None)

        def restore() -> None:
            if version is None or t._version != version:
                with b.no_grad():
                    t.detach().copy_(saved)

        self._steps.append(restore)

    def entries(self, t: Any, where: Any = None) -> None:
        """Keep ``t``'s entries at the boolean ``where`` (all of ``t`` when ``None``) before they change
        in place; a rollback writes them back. Every call counts (later changes are undone first)."""
        b = backend_of(t) or TORCH
        with b.no_grad():
            saved = t.detach().clone() if where is None else t.detach()[where]

        def restore() -> None:
            with b.no_grad():
                if where is None:
                    t.detach().copy_(saved)
                else:
                    t.detach()[where] = saved

        self._steps.append(restore)

    def add(self, step: Callable[[], None]) -> None:
        """Remember one restore step."""
        self._steps.append(step)

    def on_commit(self, hook: Callable[[], None]) -> None:
        """Run ``hook`` once when the transaction commits (not on rollback)."""
        self._commit_hooks.append(hook)

    def on_rollback(self, hook: Callable[[], None]) -> None:
        """Run ``hook`` once after the restore steps of a rollback (not on commit)."""
        self._rollback_hooks.append(hook)

    # ------------------------------------------------------------------ finish
    def rollback(self) -> None:
        """Run every restore step newest first (each once), then the rollback hooks; ``SIGINT`` is
        held until it is done."""
        with _deferred_interrupt():
            while self._steps:
                self._steps.pop()()
            hooks = self._rollback_hooks
            while hooks:
                hooks.pop(0)()
            self.clear()

    def commit(self) -> None:
        """Keep the changes: run the commit hooks (each once) and forget the record."""
        hooks = self._commit_hooks
        while hooks:
            hooks.pop(0)()
        self.clear()

    def clear(self) -> None:
        """Forget the record (the saved states and copies are freed)."""
        self._steps.clear()
        self._modules.clear()
        self._tensors.clear()
        self._commit_hooks.clear()
        self._rollback_hooks.clear()

    def __len__(self) -> int:
        return len(self._steps)


@contextlib.contextmanager
def atomic(txn: Optional[Transaction] = None) -> Iterator[Transaction]:
    """A :class:`Transaction` (``txn``, or a new one) rolled back if the block raises anything
    (``KeyboardInterrupt`` included).

    On success nothing more runs after the block unless commit hooks were added: no step an
    interrupt could cut between the block and the caller. Commit hooks run once the changes
    are final; an interrupt in one leaves the changes kept.

    Examples:
        >>> import torch
        >>> m = torch.nn.Linear(3, 2)
        >>> try:
        ...     with atomic() as txn:
        ...         txn.module(m)
        ...         m.bias = None
        ...         raise KeyboardInterrupt
        ... except KeyboardInterrupt:
        ...     pass
        >>> m.bias is not None
        True
    """
    txn = Transaction() if txn is None else txn
    try:
        yield txn
    except BaseException:
        txn.rollback()
        raise
    if txn._commit_hooks:
        txn.commit()


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
    ``KeyboardInterrupt`` included -- cuts it short, run it once more, then re-raise.

    Examples:
        >>> calls = []
        >>> finish(lambda: calls.append(1)); calls
        [1]
    """
    try:
        cleanup()
    except BaseException:
        cleanup()
        raise


def run_then_clean(body: Callable[[], _T], cleanup: Callable[[], object]) -> _T:
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
