"""Ctrl-C (or any hook) at every file-system step of a call: the harness of the writer tests.

:class:`Steps` wraps the ``os`` functions a writer or a reader calls; while it is active,
every call of one of them is a numbered step. ``Steps(at=n, when="after")`` raises
``KeyboardInterrupt`` once, right after step ``n`` has done its work (``when="before"``:
instead of doing it); ``Steps(hook=f)`` calls ``f(n, name)`` after every step instead. The
wrapped calls made by the hook itself, and after the interrupt, are not counted.

:func:`every_step` runs a call once per step until a run reaches its end without the
interrupt firing, and hands each run's outcome to a check.
"""

from __future__ import annotations

import os
from typing import Any, Callable, List, Optional, Tuple

WATCHED = ("open", "close", "fdopen", "fsync", "fstat", "stat", "lstat", "mkdir", "rmdir", "rename",
           "replace", "unlink", "remove", "listdir", "scandir", "chmod", "ftruncate")


class Steps:
    """Number the watched ``os`` calls made inside ``with``; interrupt at one, or hook every one."""

    def __init__(self, at: Optional[int] = None, when: str = "after",
                 hook: Optional[Callable[[int, str], None]] = None,
                 extra: Tuple[Tuple[Any, str], ...] = ()) -> None:
        self.at, self.when, self.hook = at, when, hook
        self.count = 0
        self.fired = False
        self.names: List[str] = []
        self._targets = [(os, n) for n in WATCHED] + [t for t in extra if hasattr(t[0], t[1])]
        self._saved: List[Tuple[Any, str, Any]] = []
        self._busy = False

    def _wrap(self, owner: Any, name: str, real: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            if self._busy or self.fired:
                return real(*args, **kwargs)
            n = self.count
            self.count += 1
            self.names.append(name)
            if n == self.at and self.when == "before":
                self.fired = True
                raise KeyboardInterrupt(f"before step {n} ({name})")
            out = real(*args, **kwargs)
            if n == self.at:
                self.fired = True
                raise KeyboardInterrupt(f"after step {n} ({name})")
            if self.hook is not None:
                self._busy = True
                try:
                    self.hook(n, name)
                finally:
                    self._busy = False
            return out

        return call

    def __enter__(self) -> "Steps":
        for owner, name in self._targets:
            real = getattr(owner, name)
            self._saved.append((owner, name, real))
            setattr(owner, name, self._wrap(owner, name, real))
        return self

    def __exit__(self, *exc: Any) -> None:
        for owner, name, real in reversed(self._saved):
            setattr(owner, name, real)
        self._saved.clear()


def every_step(call: Callable[[], Any], check: Callable[[Optional[BaseException], Steps], None], *,
               setup: Callable[[], None] = lambda: None, extra: Tuple[Tuple[Any, str], ...] = (),
               whens: Tuple[str, ...] = ("before", "after"), limit: int = 2000) -> int:
    """Run ``call`` with a ``KeyboardInterrupt`` before (and after) each of its steps in turn.

    ``setup()`` runs before every attempt, ``check(error, steps)`` after it (``error`` is the
    ``KeyboardInterrupt`` that escaped, or None). Returns the number of interrupted runs.
    """
    runs = 0
    for when in whens:
        for at in range(limit):
            setup()
            steps = Steps(at=at, when=when, extra=extra)
            error: Optional[BaseException] = None
            with steps:
                try:
                    call()
                except KeyboardInterrupt as e:
                    error = e
            assert steps.fired or error is None, f"a KeyboardInterrupt nobody injected: {error!r}"
            check(error, steps)
            if not steps.fired:
                break
            runs += 1
        else:  # pragma: no cover - the call never ended
            raise AssertionError(f"{call} made more than {limit} steps")
    return runs
