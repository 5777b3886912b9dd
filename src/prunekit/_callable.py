"""A package that is also its verb: ``prunekit.oneshot(...)``, ``prunekit.shrink(...)``.

Python binds a subpackage to its parent's attribute once it is imported, so ``prunekit.shrink``
is the package whether the function of that name was meant or not; making the package
callable makes both readings the same call.
"""

from __future__ import annotations

import sys
import types
from typing import Any, Callable

__all__ = ["make_callable"]


def make_callable(module_name: str, verb: Callable[..., Any]) -> None:
    """Make the module ``module_name`` callable as ``verb`` (with ``verb``'s docstring).

    Examples:
        >>> import types, sys
        >>> sys.modules["_demo_pkg"] = types.ModuleType("_demo_pkg")
        >>> make_callable("_demo_pkg", lambda x: x + 1)
        >>> sys.modules["_demo_pkg"](1)
        2
    """

    class _CallableModule(types.ModuleType):
        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            return verb(*args, **kwargs)

    _CallableModule.__call__.__doc__ = verb.__doc__
    _CallableModule.__name__ = f"CallableModule[{module_name}]"
    sys.modules[module_name].__class__ = _CallableModule
