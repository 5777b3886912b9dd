"""Deprecated module: ``PruningContainer`` and ``combine_masks`` live in :mod:`prunekit.base`.

``from prunekit.container import PruningContainer`` still works and emits a
:class:`DeprecationWarning` naming the new path: write
``from prunekit import PruningContainer`` (torch's spelling is
``torch.nn.utils.prune.PruningContainer``) and
``from prunekit.base import combine_masks``.

Examples:
    >>> import warnings, prunekit
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     from prunekit.container import PruningContainer
    >>> print(caught[0].category.__name__, caught[0].message)
    DeprecationWarning prunekit.container is deprecated; import PruningContainer from prunekit instead
    >>> PruningContainer is prunekit.PruningContainer
    True
"""

from __future__ import annotations

import warnings
from typing import Any, List

from . import base

_HOMES = {"PruningContainer": "prunekit", "combine_masks": "prunekit.base"}  # name -> where it is imported from now

__all__ = list(_HOMES)


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(f"{__name__} is deprecated; import {name} from {home} instead", DeprecationWarning, stacklevel=2)
    return getattr(base, name)


def __dir__() -> List[str]:
    return sorted(set(globals()) | set(_HOMES))
