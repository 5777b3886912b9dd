"""The one registry of importance criteria: ``register_scorer`` / ``get_scorer``.

Flat and boring, like timm's model registry: a dict from name to a factory.
Decorate a :class:`~prunekit.importance.Scorer` subclass (its ``__init__``
keyword arguments become ``get_scorer``'s parameters) or a plain function
``fn(weight, *, grad=None, stats=None) -> Tensor`` (say what it needs).

Examples:
    >>> import torch
    >>> from prunekit.importance import register_scorer, get_scorer, unregister_scorer
    >>> @register_scorer("cube", needs=("weight",))
    ... def cube(weight):
    ...     return weight.abs() ** 3
    >>> get_scorer("cube").score(torch.tensor([-2., 1.]))
    tensor([8., 1.])
    >>> unregister_scorer("cube")
"""

from __future__ import annotations

import difflib
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple, Union

from .scorer import NEEDS, WEIGHT, FunctionScorer, Scorer

__all__ = ["register_scorer", "unregister_scorer", "get_scorer", "list_scorers", "SCORERS"]

#: name -> factory returning a Scorer (a Scorer subclass, or a function wrapper)
SCORERS: Dict[str, Callable[..., Scorer]] = {}
_ALIASES: Dict[str, str] = {}


def _check_name(name: Any) -> str:
    if not isinstance(name, str) or not name.strip():
        raise TypeError(f"a scorer name must be a non-empty string, got {name!r}")
    return name


def _check_needs(needs: Iterable[str], name: str) -> frozenset:
    out = frozenset(needs)
    bad = sorted(out - NEEDS)
    if bad:
        raise ValueError(f"scorer {name!r}: needs={bad} is unknown; use some of {sorted(NEEDS)}")
    return out


def register_scorer(
    name: Optional[str] = None,
    *,
    needs: Optional[Iterable[str]] = None,
    aliases: Tuple[str, ...] = (),
    overwrite: bool = False,
) -> Callable[[Any], Any]:
    """Decorator: register a Scorer subclass or a scoring function under ``name``.

    For a class, ``name`` defaults to its ``name`` attribute and ``needs`` is
    the class's own. For a function, ``name`` defaults to the function's name
    and ``needs`` to ``("weight",)``. Registering a taken name raises a
    ``ValueError`` unless ``overwrite=True``.

    Examples:
        >>> import torch
        >>> from prunekit.importance import register_scorer, get_scorer, unregister_scorer
        >>> @register_scorer("grad_sq", needs=("weight", "gradient"))
        ... def grad_sq(weight, grad):
        ...     return (weight * grad) ** 2
        >>> get_scorer("grad_sq").needs_gradient
        True
        >>> unregister_scorer("grad_sq")
    """

    def wrap(obj: Any) -> Any:
        if isinstance(obj, type) and issubclass(obj, Scorer):
            key = _check_name(name or obj.name)
            if needs is not None:
                obj.needs = _check_needs(needs, key)
            else:
                _check_needs(obj.needs, key)
            if not obj.name:
                obj.name = key
            factory: Callable[..., Scorer] = obj
        elif callable(obj):
            key = _check_name(name or getattr(obj, "__name__", None))
            need_set = _check_needs(needs if needs is not None else (WEIGHT,), key)

            def factory(**params: Any) -> Scorer:
                if params:
                    raise TypeError(f"scorer {key!r} is a function and takes no parameters, got {sorted(params)}")
                return FunctionScorer(key, obj, need_set)
        else:
            raise TypeError(f"register_scorer decorates a Scorer subclass or a function, got {obj!r}")
        for k in (key, *aliases):
            if not overwrite and (k in SCORERS or k in _ALIASES):
                raise ValueError(f"a scorer named {k!r} is already registered; pass overwrite=True to replace it")
        SCORERS[key] = factory
        _ALIASES.pop(key, None)
        for a in aliases:
            _ALIASES[a] = key
            SCORERS.pop(a, None)
        return obj

    return wrap


def unregister_scorer(name: str) -> None:
    """Remove ``name`` (and the aliases that point to it) from the registry.

    Examples:
        >>> from prunekit.importance import register_scorer, unregister_scorer, list_scorers
        >>> _ = register_scorer("tmp")(lambda weight: weight.abs())
        >>> unregister_scorer("tmp"); "tmp" in list_scorers()
        False
    """
    if name not in SCORERS:
        raise ValueError(f"no scorer named {name!r} is registered; registered: {list_scorers()}")
    del SCORERS[name]
    for a in [a for a, k in _ALIASES.items() if k == name]:
        del _ALIASES[a]


def list_scorers(include_aliases: bool = True) -> List[str]:
    """Registered names, sorted (aliases included unless told otherwise).

    Examples:
        >>> from prunekit.importance import list_scorers
        >>> {"magnitude", "l2", "snip", "taylor", "wanda", "sparsegpt"} <= set(list_scorers())
        True
    """
    names = set(SCORERS)
    if include_aliases:
        names |= set(_ALIASES)
    return sorted(names)


def resolve_name(name: str) -> str:
    """The registered name behind ``name`` (itself, or what the alias points to)."""
    return _ALIASES.get(name, name)


def get_scorer(spec: Union[str, Scorer, type], **params: Any) -> Scorer:
    """A scorer: by registered name (with its parameters), or a Scorer instance/subclass as is.

    Examples:
        >>> from prunekit.importance import get_scorer
        >>> get_scorer("taylor").name          # an alias of "snip"
        'snip'
        >>> get_scorer("ln", n=1).n
        1
        >>> get_scorer("magnitud")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: importance 'magnitud' is unknown; registered: gradient, l1, ... (did you mean 'magnitude'?)
    """
    if isinstance(spec, Scorer):
        if params:
            raise TypeError(f"parameters {sorted(params)} given with a Scorer instance; configure the instance instead")
        return spec
    if isinstance(spec, type) and issubclass(spec, Scorer):
        return spec(**params)
    if not isinstance(spec, str):
        raise TypeError(f"importance must be a registered name or a Scorer, got {type(spec).__name__} {spec!r}")
    key = resolve_name(spec)
    if key not in SCORERS:
        known = list_scorers()
        close = difflib.get_close_matches(spec, known, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"importance {spec!r} is unknown; registered: {', '.join(known)}{hint}")
    return SCORERS[key](**params)
