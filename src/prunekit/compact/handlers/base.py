"""The handler interface: slots, entries, :class:`ModuleHandler`, :class:`TracerAPI` and the registry.

A handler tells the compaction machinery three things about a module type:

* :meth:`ModuleHandler.slots` -- its prunable dimensions ("slots"): a size and the
  parameter (or buffer) slices that index ``i`` of the slot owns, e.g. a Linear's
  ``"out"`` slot owns row ``i`` of ``weight`` and entry ``i`` of ``bias``;
* :meth:`ModuleHandler.trace` -- how its inputs and outputs relate to its slots
  (called once, after the module ran on the example inputs);
* :meth:`ModuleHandler.attrs` / :meth:`ModuleHandler.convert` -- how to update
  its attributes (``in_features``, ``num_heads``...) once its tensors are sliced,
  and, if needed, which module class replaces it.

Adding a layer type (the handler receives a :class:`TracerAPI`)::

    from prunekit.compact import ModuleHandler, Slot, Entry, register_handler

    @register_handler(MyScale)
    class MyScaleHandler(ModuleHandler):
        def slots(self, m):
            return {"features": Slot(m.scale.numel(), [Entry("scale", 0, role="norm")], role="norm")}
        def trace(self, m, name, tracer, args, kwargs, output):
            ids = tracer.slot(name, "features")
            tracer.bind(args[0], -1, ids)
            tracer.emit(output, -1, ids)
        def attrs(self, m, sizes):
            return {}
"""


from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import (
    Any, Callable, Dict, Generic, List, Optional, Protocol, Sequence, Tuple, Type, TypeVar, Union, runtime_checkable,
)

from torch import Tensor, nn

from ... import reparam

__all__ = [
    "Entry",
    "HandlerRegistry",
    "ModuleHandler",
    "REGISTRY",
    "Slot",
    "TracerAPI",
    "arg",
    "entries",
    "first",
    "has_tensor",
    "register_handler",
]


@dataclass(frozen=True)
class Entry:
    """Index ``i`` of a slot is index ``offset + i`` along ``axis`` of tensor ``path``.

    ``role``: ``"in"`` for a consumer's input columns (reading the channel),
    ``"out"`` for a producer's rows and biases, ``"norm"`` for per-channel affine
    parameters, ``"buffer"`` for running statistics (sliced, never masked).
    """

    path: str
    axis: int
    offset: int = 0
    role: str = "out"


@dataclass
class Slot:
    """A prunable dimension of a module."""

    size: int
    entries: List[Entry] = field(default_factory=list)
    role: str = "out"  # "in" | "out" | "norm" | "heads"
    tie: int = 1  # consecutive blocks of this many indices are removed together (heads, norm groups)


@runtime_checkable
class TracerAPI(Protocol):
    """What a handler's :meth:`ModuleHandler.trace` may ask of the tracer.

    Channel ids are int64 tensors; ``-1`` means "no channel".
    """

    #: False when the user allows inexact pruning (e.g. through a LayerNorm)
    exact: bool
    #: choices passed to build_dependency_graph, e.g. ``{"gqa": "groups"}``
    options: Dict[str, Any]

    @property
    def where(self) -> str:
        """The name of the module being traced (for reasons)."""

    def slot(self, module_name: str, slot_name: str) -> Tensor:
        """The ids of a slot of a module (allocated on first use; one id per index)."""

    def bind(self, x: Any, dim: int, ids: Tensor) -> None:
        """Couple dimension ``dim`` of the input tensor ``x`` with ``ids`` (a consumer reads them)."""

    def emit(self, out: Any, dim: int, ids: Tensor, values: Optional[Tensor] = None) -> None:
        """Label dimension ``dim`` of the output tensor ``out`` with ``ids`` (a producer writes them);
        ``values``: per index, the constant that channel provably holds (NaN: unknown)."""

    def values_in(self, x: Any, dim: int) -> Optional[Tensor]:
        """Per index of dimension ``dim`` of input ``x``: its provable constant (NaN: unknown), or None."""

    def read(self, ids: Tensor, values: Optional[Tensor]) -> None:
        """Record that the reader slot ``ids`` sees these constant ``values`` (for inputs not
        passed through :meth:`bind`, e.g. the context vectors an attention module feeds its own output projection)."""

    def tie(self, ids: Tensor) -> None:
        """Make every row of a 2-D id tensor one unit (removed together)."""

    def union(self, a: Tensor, b: Tensor) -> None:
        """Couple ``a[i]`` with ``b[i]`` for every i."""

    def block(self, ids: Any, reason: str) -> None:
        """Make the units of ``ids`` unprunable, with a reason that names the module and the cause."""

    def shadow(self, t: Any) -> Optional[Tensor]:
        """The channel ids of every element of ``t`` (same shape), or None when it carries none."""


_M = TypeVar("_M", bound=nn.Module)
_H = TypeVar("_H", bound="Type[ModuleHandler]")


class ModuleHandler(abc.ABC, Generic[_M]):
    """How compaction sees one module type. Subclass it and register it with :func:`register_handler`.

    Required: :meth:`slots` and :meth:`trace`. Optional: :meth:`attrs` (new attribute values
    once tensors are sliced) and :meth:`convert` (a replacement module). The module is a
    leaf of the trace: what runs inside it is not traced, so the handler alone says how
    its inputs and outputs relate to its slots. ``ModuleHandler[nn.Linear]`` says which
    module class it handles (for the type checker; a plain subclass takes any module).
    """

    #: True for layers that can be a model's final classifier (Linear, Conv)
    classifier: bool = False

    @abc.abstractmethod
    def slots(self, module: _M) -> Dict[str, Slot]:
        """The module's prunable dimensions, by slot name (called once per module and graph)."""

    @abc.abstractmethod
    def trace(self, module: _M, name: str, tracer: TracerAPI, args: tuple, kwargs: dict, output: Any) -> None:
        """Relate the module's inputs and outputs to its slots, after it ran on the example inputs.

        ``args``/``kwargs`` are what the module was called with, ``output`` what it returned;
        use ``tracer.slot(name, ...)``, ``tracer.bind``, ``tracer.emit``, ``tracer.tie`` and
        ``tracer.block`` (see :class:`TracerAPI`).
        """

    def attrs(self, module: _M, sizes: Dict[str, int]) -> Dict[str, Any]:
        """New attribute values (dotted paths allowed) once slot sizes become ``sizes``."""
        return {}

    def fold_constant(self, module: _M, slot: str) -> Union[str, List[Tuple[str, int, int, str]]]:
        """How a constant arriving at input slot ``slot`` folds into biases: a list of
        ``(weight path, input axis, output axis, bias path)`` (``bias[o] += sum(weight[o, j, ...] * c_j)``),
        or a sentence saying why it cannot (the default)."""
        return f"{type(module).__name__} has no rule to fold a constant input into a bias"

    def convert(self, module: _M, sizes: Dict[str, int]) -> Optional[nn.Module]:
        """Return a replacement module (sharing the same Parameters), or None to keep ``module``."""
        return None


class HandlerRegistry:
    """Maps module types (looked up along the MRO) or predicates to handlers."""

    def __init__(self) -> None:
        self._by_type: Dict[type, ModuleHandler] = {}
        self._predicates: List[Tuple[Callable[[nn.Module], bool], ModuleHandler]] = []

    def register(
        self, key: Union[type, Sequence[type], Callable[[nn.Module], bool]], handler: ModuleHandler
    ) -> ModuleHandler:
        if not isinstance(handler, ModuleHandler):
            raise TypeError(f"handler must be a ModuleHandler instance, got {type(handler).__name__}")
        if isinstance(key, type):
            self._by_type[key] = handler
        elif isinstance(key, (tuple, list)):
            for k in key:
                self.register(k, handler)
        elif callable(key):
            self._predicates.insert(0, (key, handler))
        else:
            raise TypeError(f"register a module type, a tuple of types or a predicate, got {key!r}")
        return handler

    def _by_class(self, module: nn.Module) -> Tuple[Optional[ModuleHandler], Optional[type]]:
        """The handler registered for the nearest class in ``module``'s MRO, and that class."""
        for cls in type(module).__mro__:
            h = self._by_type.get(cls)
            if h is not None:
                return h, cls
        return None, None

    def lookup(self, module: nn.Module) -> Optional[ModuleHandler]:
        """The handler that describes ``module``'s tensors (its slots, how to slice them): the one
        registered for its class or the nearest ancestor class, else the first predicate that matches."""
        h, _ = self._by_class(module)
        if h is not None:
            return h
        for pred, h in self._predicates:
            try:
                if pred(module):
                    return h
            except Exception:  # a predicate must never break tracing
                continue
        return None

    def traces_forward(self, module: nn.Module) -> bool:
        """Whether :meth:`lookup`'s handler also describes ``module``'s forward pass.

        False when the handler was registered for an ancestor class whose ``forward`` the module's class
        replaces, e.g. a ``LayerNorm`` subclass that normalizes channels-first (ConvNeXt's
        ``LayerNorm2d``) or a ``BatchNorm2d`` followed by an activation: the tracer then follows that
        forward op by op and applies the handler where it calls the layer's functional form
        (``F.layer_norm``, ``F.batch_norm``, ``F.conv2d``...) with the module's own tensors.
        """
        cls = self.registered_class(module)
        return cls is None or getattr(type(module), "forward", None) is getattr(cls, "forward", None)

    def registered_class(self, module: nn.Module) -> Optional[type]:
        """The class in ``module``'s MRO that its handler was registered for (None: none, or a predicate's)."""
        return self._by_class(module)[1]


REGISTRY = HandlerRegistry()


def register_handler(
    *types: type,
    predicate: Optional[Callable[[nn.Module], bool]] = None,
    registry: Optional[HandlerRegistry] = None,
) -> Callable[[_H], _H]:
    """Class decorator: register a :class:`ModuleHandler` subclass for module types.

    The class must implement :meth:`ModuleHandler.slots` and :meth:`ModuleHandler.trace`
    (the interface is checked when it is registered: an abstract method left out is a
    TypeError here, not a failure in the middle of a trace). ``trace`` receives a
    :class:`TracerAPI`. Types are looked up along the module's MRO; a ``predicate``
    matches modules by their attributes (e.g. any class with ``query``/``key``/``value``).
    A subclass whose ``forward`` replaces the registered class's is not traced as one
    layer: its forward is followed op by op, and the handler applies where it calls the
    layer's functional form with the module's own tensors (see
    :meth:`HandlerRegistry.traces_forward`).

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> from prunekit.compact import Entry, ModuleHandler, REGISTRY, Slot, register_handler
        >>> class Scale(nn.Module):
        ...     def __init__(self): super().__init__(); self.s = nn.Parameter(torch.ones(4))
        ...     def forward(self, x): return x * self.s
        >>> @register_handler(Scale)
        ... class ScaleHandler(ModuleHandler):
        ...     def slots(self, m):
        ...         return {"f": Slot(4, [Entry("s", 0, role="norm")], role="norm")}
        ...     def trace(self, m, name, tracer, args, kwargs, output):
        ...         ids = tracer.slot(name, "f")
        ...         tracer.bind(args[0], -1, ids)
        ...         tracer.emit(output, -1, ids)
        >>> type(REGISTRY.lookup(Scale())).__name__
        'ScaleHandler'
    """
    reg = registry or REGISTRY
    if not types and predicate is None:
        raise TypeError("register_handler needs at least one module type or a predicate")

    def deco(cls: _H) -> _H:
        if not (isinstance(cls, type) and issubclass(cls, ModuleHandler)):
            raise TypeError(f"@register_handler decorates ModuleHandler subclasses, got {cls!r}")
        missing = sorted(getattr(cls, "__abstractmethods__", ()))
        if missing:
            raise TypeError(f"handler {cls.__name__} must implement {', '.join(missing)} (see prunekit.compact.ModuleHandler)")
        inst = cls()
        if types:
            reg.register(types, inst)
        if predicate is not None:
            reg.register(predicate, inst)
        return cls

    return deco


def arg(args: tuple, kwargs: dict, i: int, name: str) -> Any:
    """Argument ``i`` of a call, passed by position or by keyword ``name``."""
    if len(args) > i:
        return args[i]
    return kwargs.get(name)


def first(output: Any) -> Any:
    """The first element of a tuple/list output (the tensor itself otherwise)."""
    return output[0] if isinstance(output, (tuple, list)) else output


def has_tensor(module: nn.Module, path: str) -> bool:
    """Whether ``module`` has a tensor at dotted ``path`` (pruned or not)."""
    owner, _, leaf = path.rpartition(".")
    mod = module.get_submodule(owner) if owner else module
    return reparam.stored(mod, leaf) is not None  # never computes a masked value


_ENTRIES: Dict[tuple, Tuple[Entry, ...]] = {}


def entries(*spec: tuple) -> List[Entry]:
    """A fresh list of (shared, frozen) ``Entry(*args)`` for each args tuple in ``spec``.

    Entries are immutable, so one set per layout is built once and reused: the hot
    handlers' :meth:`~ModuleHandler.slots` run once per module and graph.
    """
    got = _ENTRIES.get(spec)
    if got is None:
        got = _ENTRIES[spec] = tuple(Entry(*args) for args in spec)
    return list(got)
