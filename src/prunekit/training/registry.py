"""The pruner registry: ``@register_pruners("name")`` and lookup by name.

Kept flat and boring: a dict from name to class.
"""

from __future__ import annotations

import difflib
from typing import Callable, Dict, Type, TypeVar

__all__ = ["PRUNERS", "register_pruners", "get_pruner_class", "did_you_mean"]

#: name -> Pruner subclass
PRUNERS: Dict[str, type] = {}

T = TypeVar("T", bound=type)


def did_you_mean(word: str, choices) -> str:
    """``" Did you mean 'x'?"`` for the closest of ``choices``, or ``""``.

    Examples:
        >>> from prunekit.training.registry import did_you_mean
        >>> did_you_mean("magnitde", ["magnitude", "snip"])
        " Did you mean 'magnitude'?"
    """
    close = difflib.get_close_matches(str(word), [str(c) for c in choices], n=1, cutoff=0.6)
    return f" Did you mean {close[0]!r}?" if close else ""


def register_pruners(name: str) -> Callable[[T], T]:
    """Class decorator: make a ``Pruner`` subclass selectable as ``prune_type: name``.

    Registering a name twice replaces the earlier class (a warning is logged).

    Examples:
        >>> from prunekit.training import Pruner, register_pruners
        >>> @register_pruners("keep_first_rows")
        ... class KeepFirstRows(Pruner):
        ...     criterion_name = "magnitude"
        >>> from prunekit.training.registry import PRUNERS
        >>> PRUNERS["keep_first_rows"].__name__
        'KeepFirstRows'
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"register_pruners(name={name!r}): the name must be a non-empty string, e.g. 'magnitude'")

    def deco(cls: T) -> T:
        if not isinstance(cls, type):
            raise TypeError(f"@register_pruners({name!r}) decorates a class, not {cls!r}")
        if name in PRUNERS and PRUNERS[name] is not cls:
            import logging

            logging.getLogger(__name__).warning("pruner %r re-registered: %s replaces %s", name, cls, PRUNERS[name])
        PRUNERS[name] = cls
        cls.registered_name = name  # type: ignore[attr-defined]
        return cls

    return deco


def get_pruner_class(name: str) -> Type:
    """The class registered as ``name``; ValueError with the known names otherwise.

    Examples:
        >>> from prunekit.training.registry import get_pruner_class
        >>> get_pruner_class("snip").__name__
        'SnipPruner'
    """
    if name not in PRUNERS:
        raise ValueError(
            f"prune_type={name!r} is not a registered pruner; use one of {sorted(PRUNERS)}."
            + did_you_mean(name, PRUNERS)
            + " Register your own with @prunekit.training.register_pruners('name')."
        )
    return PRUNERS[name]
