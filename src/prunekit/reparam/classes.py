"""The pruned subclass: how a module serves its pruned tensors, copies, pickles and saves its state.

Pruning ``name`` of a module makes its class a per-(class, pruned names)
subclass with the same ``__name__``/``__module__`` that serves ``name``
through :func:`~prunekit.reparam.value.masked_property` and, for PyTorch
modules, routes ``module.name = x`` through the write rule, syncs before the
state dict is saved and forgets the cache when one is loaded. Pickle and
``deepcopy`` rebuild the module from its original class (:func:`_rebuild`, a
name pickles keep: ``prunekit.reparam._rebuild``); an RNN's flat weights are
re-pointed whenever the pruned tensors change (:func:`refresh_flat_weights`).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, FrozenSet, List, Tuple, Type

from torch import nn

from .._backend import TORCH, backend_of, backend_of_class
from .queries import base_class, describe, pruned_names
from .value import CACHE, assign, drop_cache, masked_property, sync

__all__ = ["class_for", "observe_pruned", "refresh_flat_weights", "set_pruned_names"]

_CLASSES: Dict[Tuple[type, FrozenSet[str]], type] = {}
_OWN_METHODS = ("forward", "_conv_forward", "_weights_have_changed", "_init_flat_weights")
_observers: List[Callable[[nn.Module], None]] = []


def class_for(base: type, names: FrozenSet[str]) -> type:
    """The pruned subclass of ``base`` serving ``names`` (made once, then reused); ``base`` when none."""
    if not names:
        return base
    key = (base, names)
    cls = _CLASSES.get(key)
    if cls is None:
        namespace: Dict[str, Any] = {
            "_prunekit_base": base,
            "_prunekit_names": names,
            "_prunekit_backend": backend_of_class(base) or TORCH,
            "__module__": base.__module__,
            "__qualname__": base.__qualname__,
            "__doc__": base.__doc__,
            "__reduce_ex__": _reduce_ex,
            "__setstate__": _setstate,
            "_prunekit_own_code": _own_code(base),
        }
        if namespace["_prunekit_backend"] is TORCH:  # the write rule's hooks (PyTorch modules)
            namespace.update({
                "__setattr__": _setattr,
                "__getattr__": _getattr,
                "_save_to_state_dict": _save_to_state_dict,
                "_load_from_state_dict": _load_from_state_dict,
                "__prepare_scriptable__": _prepare_scriptable,
            })
        for name in names:
            namespace[name] = masked_property(name, namespace["_prunekit_backend"])
        cls = type(base.__name__, (base,), namespace)
        _CLASSES[key] = cls
    return cls


def _own_code(base: type) -> FrozenSet[Any]:
    """Code of the methods through which a module reads its own weights and never writes them: reads
    from there get the cached value as it is; any other reader's may be written (the write rule)."""
    codes = set()
    for cls in base.__mro__:
        for attr in _OWN_METHODS:
            fn = cls.__dict__.get(attr)
            code = getattr(fn, "__code__", None)
            if code is not None:
                codes.add(code)
    return frozenset(codes)


def _pruned_cls(obj: Any) -> type:
    """The pruned class in ``type(obj)``'s MRO (a subclass of it may wrap it, e.g. torch's parametrize)."""
    for cls in type(obj).__mro__:
        if "_prunekit_base" in cls.__dict__:
            return cls
    return type(obj)  # pragma: no cover - only pruned classes get these methods


def _above(obj: nn.Module) -> Any:
    """``super()`` as the pruned class in ``type(obj)``'s MRO sees it: the methods of the class it wraps."""
    return super(_pruned_cls(obj), obj)


# ---------------------------------------------------- the pruned class's methods
def _setattr(self: nn.Module, key: str, value: Any) -> None:
    if key in pruned_names(self):
        assign(self, key, value)  # before nn.Module.__setattr__, which refuses a Parameter there
    else:
        _above(self).__setattr__(key, value)


def _getattr(self: nn.Module, key: str) -> Any:
    # only reached for parameters, buffers and submodules (nn.Module keeps them out of __dict__)
    if key.endswith("_orig") and key[:-5] in pruned_names(self):
        sync(self)
    return _above(self).__getattr__(key)


def _save_to_state_dict(self: nn.Module, destination: Any, prefix: str, keep_vars: bool) -> None:
    sync(self)
    _above(self)._save_to_state_dict(destination, prefix, keep_vars)


def _load_from_state_dict(self: nn.Module, *args: Any, **kwargs: Any) -> None:
    drop_cache(self)  # what is loaded replaces any pending write through a pruned name
    _above(self)._load_from_state_dict(*args, **kwargs)


def _prepare_scriptable(self: nn.Module) -> nn.Module:
    raise TypeError(
        f"torch.jit.script cannot compile {describe(self)}: its pruned tensors {sorted(pruned_names(self))} "
        "are properties (name_orig * name_mask), which TorchScript does not support. Use torch.jit.trace "
        "or torch.export instead, or make the pruning permanent first with prunekit.remove(module, name) "
        "for each pruned tensor"
    )


# ------------------------------------------------------------ class changes
def observe_pruned(fn: Callable[[nn.Module], None]) -> None:
    """Call ``fn(module)`` whenever a module gains a pruned tensor or is rebuilt pruned (unpickled, copied).

    For upper layers that must react to pruned modules existing (e.g. how a
    Hugging Face model is saved). ``fn`` must be cheap and must not raise.
    """
    if fn not in _observers:
        _observers.append(fn)


def set_pruned_names(module: nn.Module, names: FrozenSet[str]) -> None:
    """Give ``module`` the class that serves exactly ``names`` (its original class when empty)."""
    module.__class__ = class_for(base_class(module), names)
    if names:
        for fn in _observers:
            fn(module)


def refresh_flat_weights(module: nn.Module) -> None:
    """An RNN keeps its weights in ``_flat_weights``: point it at the current effective values.

    ``nn.RNNBase`` fills that list through ``__setattr__``, which a pruned
    tensor (a property) never goes through; torch.nn.utils.prune's hook did it
    at each forward. Done whenever a mask is installed or dropped, and on load.
    """
    init = getattr(module, "_init_flat_weights", None)
    if callable(init) and "_flat_weights_names" in module.__dict__:
        with (backend_of(module) or TORCH).no_grad():
            init()


# ---------------------------------------------------------- copies and pickles
def _reduce_ex(self: nn.Module, protocol: int):
    # Pickle / deepcopy: rebuild from the original class, then restore the
    # state. The inference cache is derived data and is not copied; an RNN's
    # _flat_weights (which may hold products with a grad_fn) are rebuilt on load.
    sync(self)
    state = dict(self.__dict__)
    state.pop(CACHE, None)
    if isinstance(state.get("_flat_weights"), list):
        names = state.get("_flat_weights_names", [])
        state["_flat_weights"] = [self._parameters.get(n + "_orig", w) if n in pruned_names(self) else w
                                  for n, w in zip(names, state["_flat_weights"])]
        state.pop("_flat_weight_refs", None)
    return (_rebuild, (base_class(self), tuple(sorted(pruned_names(self)))), state)


def _setstate(self: nn.Module, state: Dict[str, Any]) -> None:
    base = base_class(self)
    setstate = getattr(base, "__setstate__", None)
    if setstate is not None:
        setstate(self, state)
    else:  # pragma: no cover - nn.Module defines __setstate__
        self.__dict__.update(state)
    refresh_flat_weights(self)


def _rebuild(base: Type[nn.Module], names: Tuple[str, ...]) -> nn.Module:
    """An empty pruned module of class ``base`` serving ``names`` (pickle fills in its state)."""
    obj = base.__new__(base)
    obj.__class__ = class_for(base, frozenset(names))
    for fn in _observers:
        fn(obj)
    return obj


# Pickles name this function by where it was defined before reparam became a package; it is
# re-exported there, so pickles of either version of prunekit load with the other.
_rebuild.__module__ = "prunekit.reparam"
