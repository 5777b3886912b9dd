"""The one mask module: ``name = name_orig * name_mask`` and the surgery around it.

Every package of prunekit (the pruning methods, training, compaction,
checkpoints, state dicts, reports) asks this module, and only it, whether a
tensor is pruned, what its effective value is, to apply a mask and to drop
one. Its public API:

==============================  ===============================================
``masked(t, mask)``             the one definition of mask application (below)
``is_masked(module, name)``     is ``name`` reparameterized (prunekit or torch)?
``get_mask(module, name)``      its mask buffer, or ``None``
``stored(module, name)``        ``name_orig`` if masked, else ``name`` itself
``effective(module, name)``     the value the forward pass uses, detached
``apply_mask(module, name, k)`` prune ``name`` with mask ``k`` (on any earlier)
``unmask(module, name, bake)``  drop the reparameterization, mask baked or not
``iter_masked(model)``          every masked ``(module name, module, name)``
``owner_of(model, path)``       ``(module, "weight")`` for ``"layer1.0.weight"``
``remove(module, name)``        torch's ``remove``: ``unmask`` with ``bake``
``is_pruned(module)``           torch's ``is_pruned``
==============================  ===============================================

Mask application, one definition: ``masked(t, mask)`` is ``t * mask`` in the
dtype of ``t``, except that an entry whose mask is zero is exactly ``+0``
whatever ``t`` holds there (a negative value, ``inf`` and ``NaN`` included); a
mask value other than 0 and 1 scales its entry. ``remove``, the no-grad value
of ``name``, state-dict conversion, compressed checkpoints, training and
compaction all use it. With gradients on, ``name`` is autograd's
``name_orig * name_mask`` (one multiplication per forward, as in torch): the
same values, except that a masked entry reads ``-0.0`` where ``name_orig`` is
negative (equal to ``0``) and ``NaN`` where it is not finite; forcing ``+0``
there would cost about three times the multiplication in every training step.

When a tensor ``name`` of a module is pruned:

* the ``nn.Parameter`` moves, as the same object, to ``name_orig`` (optimizers
  that hold it keep working);
* the mask is registered as the buffer ``name_mask``;
* the module's class becomes a per-(class, pruned names) subclass, with the
  same ``__name__``/``__module__``, that serves ``module.name`` through a
  property computing the masked value;
* the pruning method is registered as a forward pre-hook, as in
  ``torch.nn.utils.prune``, so code that looks for it there finds it.

Serving ``name`` through a property rather than a hook-refreshed attribute is
what fixes several faults of ``torch.nn.utils.prune`` at their root:

* the value is always current, even when a parent reads it without calling
  the module's ``forward`` (``nn.MultiheadAttention`` reads
  ``out_proj.weight`` directly);
* no derived, non-leaf tensor sits in ``module.__dict__``, so ``deepcopy``,
  pickle and ``torch.save`` work in any state;
* under ``no_grad`` (or for a frozen ``name_orig``) the value is cached and
  reused until ``name_orig`` or ``name_mask`` change (identity, storage or
  in-place version), so inference costs what a dense module costs. With
  gradients on, every read builds a fresh product, so gradients reach
  ``name_orig`` (zero where masked).

Writes through a pruned name, one rule with or without gradients: a write
lands in ``name_orig`` at the unpruned entries and the mask still applies (the
tensor stays pruned; ``name_orig`` keeps its values at pruned entries and
stays the same Parameter). That covers ``module.weight.mul_(2)``,
``module.weight.data += d``, ``module.weight.data.copy_(x)``,
``module.weight.data = x`` and ``module.weight = nn.Parameter(x)`` (the last
two need ``name``'s shape), i.e. how PEFT merges adapters, how EMA and
initialisation code write. The value handed to the module's own ``forward``
is the cache, served as it is (dense speed); a value handed to any other
reader may be written, through a ``.data`` alias that shares no version
counter, so the next access to the module (a read of ``name`` or
``name_orig``, a forward, the state dict, a copy, ``remove``, pruning again)
compares it with ``name_orig * name_mask`` and carries a difference into
``name_orig`` -- one comparison, then none while nobody else holds the value.
The cache therefore never disagrees with ``name_orig * name_mask``. To merge
densely on purpose (the update not masked), ``prunekit.remove`` first. When
both a write through ``name`` and a direct change of ``name_orig``/the mask
happen before the next access, the direct change wins and a warning is logged.
``torch.jit.trace``/``torch.compile``/``torch.export`` see the product itself
(never a cached constant); ``torch.jit.script`` is refused with a message
saying to trace, export or ``remove`` first. PyTorch modules only; on
TensorPlay modules assigning to ``name`` raises (write into ``name_orig``).
"""

from __future__ import annotations

import difflib
import functools
import logging
import sys
import weakref
from typing import Any, Callable, Dict, FrozenSet, Iterator, List, Optional, Tuple

import torch
from torch import Tensor, nn

from . import _sharded
from ._backend import TORCH, Backend, backend_of, backend_of_class, is_module, is_tensor
from .transaction import ModuleState, Transaction

__all__ = [
    "apply_mask",
    "base_class",
    "describe",
    "effective",
    "effective_for_reading",
    "find_hook",
    "get_mask",
    "is_masked",
    "is_pruned",
    "iter_masked",
    "iter_pruned",
    "masked",
    "observe_pruned",
    "owner_of",
    "pruned_names",
    "remove",
    "stored",
    "unmask",
]

_CACHE = "_prunekit_cache"
logger = logging.getLogger(__name__)
_CLASSES: Dict[Tuple[type, FrozenSet[str]], type] = {}


# --------------------------------------------------------------------- naming
def describe(module: Any, name: Optional[str] = None) -> str:
    """A short label for error messages: ``Linear(in=64, out=32).weight [32, 64] float32``."""
    label = base_class(module).__name__ if is_module(module) else type(module).__name__
    extra = getattr(module, "extra_repr", lambda: "")()
    if extra and len(extra) < 60:
        label += f"({extra})"
    if name is None:
        return label
    label += f".{name}"
    t = _current_tensor(module, name)
    if is_tensor(t):
        label += f" {list(t.shape)} {Backend.dtype_label(t.dtype)}"
    return label


def _current_tensor(module: nn.Module, name: str) -> Optional[Tensor]:
    params = getattr(module, "_parameters", {})
    if name in params:
        return params[name]
    if name + "_orig" in params:
        return params[name + "_orig"]
    return getattr(module, "_buffers", {}).get(name)


# ----------------------------------------------------------- the pruned class
def base_class(module: nn.Module) -> type:
    """The module's class as it was before pruning.

    Examples:
        >>> import torch, prunekit
        >>> m = prunekit.l1_unstructured(torch.nn.Linear(4, 2), "weight", 0.5)
        >>> base_class(m) is torch.nn.Linear, isinstance(m, torch.nn.Linear)
        (True, True)
    """
    cls = type(module)
    for c in cls.__mro__:  # the pruned class may be wrapped (torch's parametrize subclasses it)
        if "_prunekit_base" in c.__dict__:
            return c.__dict__["_prunekit_base"] if c is cls else cls
    return cls


def pruned_names(module: nn.Module) -> FrozenSet[str]:
    """Names of the tensors of ``module`` that prunekit reparameterizes."""
    for c in type(module).__mro__:
        names = c.__dict__.get("_prunekit_names")
        if names is not None:
            return names
    return frozenset()


def _class_for(base: type, names: FrozenSet[str]) -> type:
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
            namespace[name] = _masked_property(name, namespace["_prunekit_backend"])
        cls = type(base.__name__, (base,), namespace)
        _CLASSES[key] = cls
    return cls


_OWN_METHODS = ("forward", "_conv_forward", "_weights_have_changed", "_init_flat_weights")


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


def _setattr(self: nn.Module, key: str, value: Any) -> None:
    if key in pruned_names(self):
        assign(self, key, value)  # before nn.Module.__setattr__, which refuses a Parameter there
    else:
        super(_pruned_cls(self), self).__setattr__(key, value)


def _getattr(self: nn.Module, key: str) -> Any:
    # only reached for parameters, buffers and submodules (nn.Module keeps them out of __dict__)
    if key.endswith("_orig") and key[:-5] in pruned_names(self):
        sync(self)
    return super(_pruned_cls(self), self).__getattr__(key)


def _save_to_state_dict(self: nn.Module, destination: Any, prefix: str, keep_vars: bool) -> None:
    sync(self)
    super(_pruned_cls(self), self)._save_to_state_dict(destination, prefix, keep_vars)


def _load_from_state_dict(self: nn.Module, *args: Any, **kwargs: Any) -> None:
    drop_cache(self)  # what is loaded replaces any pending write through a pruned name
    super(_pruned_cls(self), self)._load_from_state_dict(*args, **kwargs)


def _prepare_scriptable(self: nn.Module) -> nn.Module:
    raise TypeError(
        f"torch.jit.script cannot compile {describe(self)}: its pruned tensors {sorted(pruned_names(self))} "
        "are properties (name_orig * name_mask), which TorchScript does not support. Use torch.jit.trace "
        "or torch.export instead, or make the pruning permanent first with prunekit.remove(module, name) "
        "for each pruned tensor"
    )


_observers: List[Callable[[nn.Module], None]] = []


def observe_pruned(fn: Callable[[nn.Module], None]) -> None:
    """Call ``fn(module)`` whenever a module gains a pruned tensor or is rebuilt pruned (unpickled, copied).

    For upper layers that must react to pruned modules existing (e.g. how a
    Hugging Face model is saved). ``fn`` must be cheap and must not raise.
    """
    if fn not in _observers:
        _observers.append(fn)


def _set_names(module: nn.Module, names: FrozenSet[str]) -> None:
    module.__class__ = _class_for(base_class(module), names)
    if names:
        for fn in _observers:
            fn(module)


def _reduce_ex(self: nn.Module, protocol: int):
    # Pickle / deepcopy: rebuild from the original class, then restore the
    # state. The inference cache is derived data and is not copied; an RNN's
    # _flat_weights (which may hold products with a grad_fn) are rebuilt on load.
    sync(self)
    state = dict(self.__dict__)
    state.pop(_CACHE, None)
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


def refresh_flat_weights(module: nn.Module) -> None:
    """An RNN keeps its weights in ``_flat_weights``: point it at the current (masked) values.

    ``nn.RNNBase`` fills that list through ``__setattr__``, which a pruned
    tensor (a property) never goes through; torch.nn.utils.prune's hook did it
    at each forward. Done whenever a mask is installed or dropped, and on load.
    """
    init = getattr(module, "_init_flat_weights", None)
    if callable(init) and "_flat_weights_names" in module.__dict__:
        with (backend_of(module) or TORCH).no_grad():
            init()


def _rebuild(base: type, names: Tuple[str, ...]) -> nn.Module:
    obj = base.__new__(base)
    obj.__class__ = _class_for(base, frozenset(names))
    for fn in _observers:
        fn(obj)
    return obj


# ------------------------------------------------------- the masked property
class _CacheEntry:
    """A value of ``name`` computed from (``orig``, ``mask``) at known versions, and whether it was handed out."""

    __slots__ = ("orig", "orig_version", "orig_ptr", "mask", "mask_version", "mask_ptr", "value",
                 "value_version", "value_ptr", "exposed")

    def __init__(self, orig: Tensor, mask: Tensor, value: Tensor, b: Backend) -> None:
        self.orig, self.orig_version, self.orig_ptr = weakref.ref(orig), b.version(orig), orig.data_ptr()
        self.mask, self.mask_version, self.mask_ptr = weakref.ref(mask), b.version(mask), mask.data_ptr()
        self.value, self.value_version, self.value_ptr = value, b.version(value), value.data_ptr()
        self.exposed = False

    def fresh(self, orig: Tensor, mask: Tensor) -> bool:
        """``orig`` and ``mask`` are the ones it was computed from, unchanged since."""
        # a tensor without a version counter (None) can change unseen: never reuse then
        return (
            self.orig() is orig
            and self.mask() is mask
            and self.orig_version is not None
            and self.mask_version is not None
            and orig._version == self.orig_version
            and mask._version == self.mask_version
            and orig.data_ptr() == self.orig_ptr
            and mask.data_ptr() == self.mask_ptr
        )

    def written(self) -> bool:
        """The handed-out value may have been written: in place (its version), by ``.data = x``
        (its storage), or -- exposed to code outside the module's own forward -- through a ``.data``
        alias, which shares no version counter (compare values to know)."""
        v = self.value
        return self.exposed or v._version != self.value_version or v.data_ptr() != self.value_ptr

    def still_held(self) -> bool:
        """Someone besides this entry holds the value, a view or a ``.data`` alias of it."""
        v = self.value
        if sys.getrefcount(v) > 3:  # the entry, the local name, getrefcount's argument
            return True
        try:
            return torch._C._storage_Use_Count(v.untyped_storage()._cdata) > 2
        except Exception:  # noqa: BLE001 - not a plain CPU/CUDA tensor: assume held
            return True


def masked_product(orig: Tensor, mask: Tensor) -> Tensor:
    """``orig * mask`` as autograd sees it (the forward pass with gradients on)."""
    return orig * mask


def masked(t: Tensor, mask: Tensor, *, inplace: bool = False) -> Tensor:
    """Apply ``mask`` to ``t``: the one definition, used everywhere in prunekit.

    ``t * mask`` in ``t``'s dtype, except that every entry whose mask is zero is
    exactly ``+0`` whatever ``t`` holds there (``-x``, ``inf``, ``NaN``); mask
    values other than 0 and 1 scale their entry. Boolean masks keep where True.
    Computed without gradients; ``inplace=True`` writes into ``t`` (same object).

    Examples:
        >>> import torch
        >>> t = torch.tensor([-1.0, float("nan"), 3.0, 4.0])
        >>> masked(t, torch.tensor([0.0, 0.0, 1.0, 0.5])).tolist()
        [0.0, 0.0, 3.0, 2.0]
        >>> masked(t, torch.tensor([False, True, True, False])).tolist()[2:]
        [3.0, 0.0]
        >>> str(masked(torch.tensor([-2.0]), torch.tensor([0.0]))[0].item())  # +0.0, not -0.0
        '0.0'
    """
    b = backend_of(t) or TORCH
    with b.no_grad():
        if mask.dtype == b.bool:
            return t.masked_fill_(~mask, 0) if inplace else t.masked_fill(~mask, 0)
        if mask.dtype != t.dtype:
            mask = mask.to(t.dtype)
        if inplace:
            t.masked_fill_(mask == 0, 0)
            return b.mul_(t, mask)
        return (t * mask).masked_fill_(mask == 0, 0)


# ---------------------------------------------------------- the mask questions
def is_masked(module: nn.Module, name: str) -> bool:
    """Whether ``module.name`` is reparameterized as ``name_orig``/``name_mask`` (by prunekit or torch).

    Examples:
        >>> import torch, prunekit
        >>> m = prunekit.l1_unstructured(torch.nn.Linear(3, 2), "weight", amount=1)
        >>> is_masked(m, "weight"), is_masked(m, "bias")
        (True, False)
    """
    return name + "_orig" in getattr(module, "_parameters", {}) and name + "_mask" in getattr(module, "_buffers", {})


def get_mask(module: nn.Module, name: str) -> Optional[Tensor]:
    """The mask buffer of ``module.name``, or ``None`` when it is not masked.

    Examples:
        >>> import torch, prunekit
        >>> m = prunekit.custom_from_mask(torch.nn.Linear(2, 1), "weight", torch.tensor([[1, 0]]))
        >>> get_mask(m, "weight").tolist(), get_mask(m, "bias")
        ([[1.0, 0.0]], None)
    """
    return module._buffers[name + "_mask"] if is_masked(module, name) else None


def stored(module: nn.Module, name: str) -> Optional[Tensor]:
    """The tensor held for ``name``: ``name_orig`` when masked, else ``module.name`` (``None`` if absent).

    Never computes the masked value.

    Examples:
        >>> import torch, prunekit
        >>> m = prunekit.l1_unstructured(torch.nn.Linear(3, 2), "weight", amount=1)
        >>> stored(m, "weight") is m.weight_orig, stored(m, "bias") is m.bias
        (True, True)
    """
    if is_masked(module, name):
        return module._parameters[name + "_orig"]
    return getattr(module, name, None)


def effective(module: nn.Module, name: str) -> Tensor:
    """The value the forward pass uses for ``module.name``, detached (a fresh tensor when masked).

    Examples:
        >>> import torch, prunekit
        >>> m = prunekit.custom_from_mask(torch.nn.Linear(2, 1, bias=False), "weight", torch.tensor([[0, 1]]))
        >>> torch.equal(effective(m, "weight"), m.weight_orig.detach() * torch.tensor([[0.0, 1.0]]))
        True
    """
    if is_masked(module, name):
        return masked(module._parameters[name + "_orig"].detach(), module._buffers[name + "_mask"])
    return getattr(module, name).detach()


def effective_for_reading(module: nn.Module, name: str) -> Tensor:
    """:func:`effective`, for a reader that never writes into the result: the value the module's
    own forward pass computed and cached, when ``name_orig`` and the mask are unchanged since and
    the value was never handed out; otherwise :func:`effective`'s fresh product.

    Examples:
        >>> import torch, prunekit
        >>> m = prunekit.custom_from_mask(torch.nn.Linear(2, 2), "weight", torch.tensor([[1.0, 0], [1, 1]]))
        >>> with torch.no_grad():
        ...     _ = m(torch.randn(1, 2))  # caches the masked weight
        >>> torch.equal(effective_for_reading(m, "weight"), effective(m, "weight"))
        True
    """
    cache = module.__dict__.get(_CACHE)
    entry = cache.get(name) if cache else None
    if entry is not None and is_masked(module, name):
        orig, mask = module._parameters[name + "_orig"], module._buffers[name + "_mask"]
        if (type(orig) in _sharded.PLAIN_TYPES and type(mask) in _sharded.PLAIN_TYPES
                and not entry.written() and entry.fresh(orig, mask)):
            return entry.value
    return effective(module, name)


_MASK_INSTALLERS: List[Callable[..., Any]] = []  # the hook registry behind apply_mask: at most one entry


def register_mask_installer(installer: Callable[..., Any]) -> None:
    """Register how :func:`apply_mask` installs a mask: ``installer(module, name, mask, mask_dtype=...)``.

    Installing needs a pruning method as the forward pre-hook (``CustomFromMask``),
    which lives in the methods layer above this module. The layers import only
    downward, so :mod:`prunekit.methods` registers its installer here, once, in its
    section "Registration with the reparam layer"; a later registration replaces it.

    Examples:
        >>> import prunekit
        >>> mask_installer() is not None  # `import prunekit` registered the methods layer's
        True
    """
    if not callable(installer):
        raise TypeError(f"register_mask_installer: the installer must be callable, got {installer!r}")
    _MASK_INSTALLERS[:] = [installer]


def mask_installer() -> Optional[Callable[..., Any]]:
    """The installer :func:`apply_mask` uses (see :func:`register_mask_installer`), or ``None``."""
    return _MASK_INSTALLERS[0] if _MASK_INSTALLERS else None


def apply_mask(module: nn.Module, name: str, mask: Tensor, *, mask_dtype: Optional[Any] = None) -> None:
    """Prune ``module.name`` with ``mask`` (zeros prune), on top of any mask it already has.

    What ``custom_from_mask`` does: the reparameterization is installed (or the
    existing mask multiplied by ``mask``: a mask only loses ones), nothing is
    changed if anything fails. ``mask_dtype`` as for every pruning function.

    Examples:
        >>> import torch
        >>> m = torch.nn.Linear(3, 1, bias=False)
        >>> apply_mask(m, "weight", torch.tensor([[1, 0, 1]]))
        >>> apply_mask(m, "weight", torch.tensor([[0, 1, 1]]))
        >>> get_mask(m, "weight").tolist()
        [[0.0, 0.0, 1.0]]
    """
    installer = mask_installer()
    if installer is None:  # pragma: no cover - prunekit/__init__ imports the methods layer
        raise RuntimeError("prunekit.methods is not imported; `import prunekit` first")
    installer(module, name, mask, mask_dtype=mask_dtype)


def unmask(module: nn.Module, name: str, *, bake: bool = True) -> Tensor:
    """Drop the reparameterization of ``module.name`` (prunekit's or torch's); return the mask.

    ``name`` becomes a plain Parameter again -- the same object as
    ``name_orig`` -- holding ``masked(name_orig, name_mask)`` (``bake=True``,
    what :func:`remove` does) or ``name_orig``'s values unchanged
    (``bake=False``: undo a mask).

    Raises:
        ValueError: ``module.name`` is not masked.

    Examples:
        >>> import torch, prunekit
        >>> m = prunekit.custom_from_mask(torch.nn.Linear(2, 1), "weight", torch.tensor([[0, 1]]))
        >>> w = m.weight_orig.detach().clone()
        >>> unmask(m, "weight", bake=False).tolist(), torch.equal(m.weight, w), is_masked(m, "weight")
        ([[0.0, 1.0]], True, False)
    """
    if not is_masked(module, name):
        raise ValueError(f"{describe(module, name)} is not masked: it has no {name}_orig/{name}_mask pair to drop")
    mask = module._buffers[name + "_mask"]
    if name in pruned_names(module):
        return _transaction(module, name, bake, lambda: (_drop(module, name), mask)[1])
    # pruned by torch.nn.utils.prune: its own remove, then the value we define
    from torch.nn.utils import prune as torch_prune

    orig = module._parameters[name + "_orig"]
    old_data = orig.data  # torch's remove swaps orig's storage for the product's
    with torch.no_grad():
        value = masked(orig.detach(), mask) if bake else orig.detach().clone()
    snapshot = Snapshot(module)
    try:
        torch_prune.remove(module, name)
        with torch.no_grad():
            module._parameters[name].copy_(value)
        return mask
    except BaseException:
        orig.data = old_data
        snapshot.restore()
        raise


def iter_masked(model: nn.Module) -> Iterator[Tuple[str, nn.Module, str]]:
    """``(module name, module, tensor name)`` for every ``name_orig``/``name_mask`` pair, whoever pruned it.

    Examples:
        >>> import torch, prunekit
        >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
        >>> _ = prunekit.identity(net[1], "bias")
        >>> [(q, n) for q, _, n in iter_masked(net)]
        [('1', 'bias')]
    """
    for qual, sub in model.named_modules():
        for bname in list(sub._buffers):
            if bname.endswith("_mask") and is_masked(sub, bname[: -len("_mask")]):
                yield qual, sub, bname[: -len("_mask")]


def owner_of(model: nn.Module, path: str) -> Tuple[nn.Module, str]:
    """The submodule that owns the tensor at ``path`` and the tensor's name in it.

    Examples:
        >>> import torch
        >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2))
        >>> owner_of(net, "0.weight")[0] is net[0], owner_of(net, "0.weight")[1]
        (True, 'weight')
    """
    prefix, _, leaf = path.rpartition(".")
    return (model.get_submodule(prefix) if prefix else model), leaf


def _masked_value(module: nn.Module, name: str, orig: Tensor, mask: Tensor, b: Backend = TORCH,
                  own: bool = True) -> Tensor:
    """The value of ``name`` for a reader; ``own`` when the reader is the module's own forward.

    Never called while tracing or compiling: the property returns the product itself then."""
    cache = module.__dict__.get(_CACHE)
    if cache is None:
        cache = module.__dict__[_CACHE] = {}
    if cache:
        _sync_name(module, name, cache, orig, mask, b)
    if b.is_grad_enabled() and (orig.requires_grad or mask.requires_grad):
        value = masked_product(orig, mask)
        if not own:  # handed out with gradients: a write into it is seen at the next access too
            entry = cache[(name, "grad")] = _CacheEntry(orig, mask, value, b)
            entry.exposed = True
        return value
    entry = cache.get(name)
    if entry is None or not entry.fresh(orig, mask):
        if b.is_inference_mode_enabled():
            # cache a normal tensor, usable outside inference mode too
            with b.inference_mode(False):
                value = masked(orig, mask)
        else:
            value = masked(orig, mask)
        entry = cache[name] = _CacheEntry(orig, mask, value, b)
    if not own:
        entry.exposed = True
    return entry.value


def _is_compiling() -> bool:
    compiler = getattr(torch, "compiler", None)
    return bool(compiler is not None and compiler.is_compiling())


def _sync_name(module: nn.Module, name: str, cache: Dict[Any, Any], orig: Tensor, mask: Tensor, b: Backend) -> None:
    """Carry writes made through handed-out values of ``name`` into ``name_orig`` (the write rule)."""
    for key in (name, (name, "grad")):
        entry = cache.get(key)
        if entry is None or not entry.written():
            continue
        if not entry.fresh(orig, mask):
            # name_orig or the mask changed too since the value was handed out: whose write wins is
            # undefined, so the direct change to name_orig/mask is kept and this one dropped
            v = entry.value
            if v._version != entry.value_version or v.data_ptr() != entry.value_ptr:
                logger.warning("%s: a write through %r and a change of %s_orig/%s_mask met before the next "
                               "use; the write through %r is dropped", type(module).__name__, name, name, name, name)
            del cache[key]
        elif _write_through(module, name, entry.value, orig, mask, b) or (key != name and not entry.still_held()):
            del cache[key]  # name_orig changed: recomputed at the next read (or nothing left to watch)
        else:  # the same values: keep serving it, watched while someone else holds it
            entry.exposed = entry.still_held()
            entry.value_version, entry.value_ptr = entry.value._version, entry.value.data_ptr()


def _differs(value: Tensor, reference: Tensor, mask: Tensor, b: Backend) -> Tensor:
    """Unpruned entries where ``value`` differs from ``reference`` bit for bit (NaN payloads, -0.0)."""
    keep = mask if mask.dtype == b.bool else mask != 0
    if value.shape != reference.shape or value.dtype != reference.dtype:
        return keep.clone()
    if value.is_floating_point() and value.element_size() in (2, 4, 8):
        as_int = {2: b.int16, 4: b.int32, 8: b.int64}[value.element_size()]
        diff = value.contiguous().view(as_int) != reference.contiguous().view(as_int)
    else:
        diff = value != reference
    return diff & keep


def _write_through(module: nn.Module, name: str, value: Tensor, orig: Tensor, mask: Tensor, b: Backend) -> bool:
    """``name_orig`` takes ``value`` at every unpruned entry where the two differ (divided by a mask
    value other than 1); pruned entries of ``name_orig`` keep what they held."""
    with b.no_grad():
        if value.shape != orig.shape:
            logger.warning("%s: %r was given a tensor of shape %s through .data; %s_orig has shape %s: "
                           "the write is dropped", type(module).__name__, name, tuple(value.shape), name, tuple(orig.shape))
            return True
        value = value.to(orig.dtype) if value.dtype != orig.dtype else value
        diff = _differs(value, masked(orig, mask), mask, b)
        if not bool(diff.any()):
            return False
        new = value[diff]
        if mask.dtype != b.bool:
            m = mask[diff].to(new.dtype)
            new = b.ns.where(m == 1, new, new / m) if new.is_floating_point() else new
        orig.detach()[diff] = new
        return True


def sync(module: nn.Module) -> None:
    """Carry every pending write through a pruned name of ``module`` into its ``name_orig``.

    Reading ``name``, ``name_orig`` or the state dict, pruning, ``remove``,
    copying and pickling call it; call it yourself before reading
    ``name_orig`` through ``parameters()`` right after writing through ``name``.

    Examples:
        >>> import torch, prunekit
        >>> m = prunekit.custom_from_mask(torch.nn.Linear(2, 1, bias=False), "weight", torch.tensor([[1, 0]]))
        >>> with torch.no_grad():
        ...     _ = m.weight.data.copy_(torch.tensor([[5.0, 7.0]]))
        >>> sync(m); m.weight_orig[0, 0].item(), effective(m, "weight").tolist()
        (5.0, [[5.0, 0.0]])
    """
    cache = module.__dict__.get(_CACHE)
    if not cache:
        return
    b = backend_of(module) or TORCH
    for name in pruned_names(module):
        _sync_name(module, name, cache, module._parameters[name + "_orig"], module._buffers[name + "_mask"], b)


def _masked_property(name: str, b: Backend = TORCH) -> property:
    orig_key, mask_key = name + "_orig", name + "_mask"

    plain = _sharded.PLAIN_TYPES

    def fget(self: nn.Module) -> Tensor:
        orig, mask = self._parameters.get(orig_key), self._buffers[mask_key]
        if orig is None:  # name_orig is parametrized (torch.nn.utils.parametrize): its computed value
            return masked_product(getattr(self, orig_key), mask)
        if type(mask) not in plain or type(orig) not in plain:
            sharded = _sharded.handler_for(orig, mask)
            if sharded is not None:  # DTensor shards: prunekit.distributed computes it
                return sharded.value(self, name, orig, mask)
        if b is TORCH and (torch.jit.is_tracing() or _is_compiling()):
            # in a traced or compiled graph: the product itself, never a cached constant -- and no frame
            # inspection (sys._getframe is a graph break under torch.compile(fullgraph=True))
            return masked_product(orig, mask)
        own = sys._getframe(1).f_code in type(self).__dict__["_prunekit_own_code"]
        return _masked_value(self, name, orig, mask, b, own)

    def fset(self: nn.Module, value: Any) -> None:
        if b is not TORCH:
            raise AttributeError(
                f"{describe(self, name)} is pruned: it is computed as {orig_key} * {mask_key}. "
                f"Write into module.{orig_key} (e.g. `with {b.name}.no_grad(): module.{orig_key}.copy_(value)`) "
                f"or call prunekit.remove(module, {name!r}) first"
            )
        assign(self, name, value)

    return property(fget, fset, doc=f"``{orig_key} * {mask_key}`` (pruned by prunekit)")


def assign(module: nn.Module, name: str, value: Any) -> None:
    """``module.name = value`` for a pruned ``name``: the write rule (values into ``name_orig``'s
    unpruned entries, the mask still applies; ``name_orig`` stays the same Parameter)."""
    b = backend_of(module) or TORCH
    orig, mask = module._parameters[name + "_orig"], module._buffers[name + "_mask"]
    if not is_tensor(value) or tuple(value.shape) != tuple(orig.shape):
        got = f"shape {tuple(value.shape)}" if is_tensor(value) else type(value).__name__
        raise TypeError(
            f"{describe(module, name)} is pruned (computed as {name}_orig * {name}_mask); assigning sets the "
            f"unpruned entries of {name}_orig and needs a tensor of shape {tuple(orig.shape)}, got {got}. "
            f"To replace the tensor itself, call prunekit.remove(module, {name!r}) first"
        )
    sync(module)
    _write_through(module, name, value.detach(), orig, mask, b)


def current_value(module: nn.Module, name: str) -> Tensor:
    """The pruned tensor's value, computed without touching the cache (no grad)."""
    return masked(module._parameters[name + "_orig"], module._buffers[name + "_mask"])


def drop_cache(module: nn.Module, name: Optional[str] = None) -> None:
    """Forget cached products (all, or of one tensor). Freed memory; they are rebuilt on demand."""
    cache = module.__dict__.get(_CACHE)
    if cache:
        if name is None:
            cache.clear()
        else:
            cache.pop(name, None)


# ------------------------------------------------------------------- hooks
def _is_method(hook: Any) -> bool:
    return getattr(hook, "_prunekit_method", False)


def find_hook(module: nn.Module, name: str) -> Tuple[Optional[int], Any]:
    """The key in ``module._forward_pre_hooks`` and the pruning method for ``name`` (or ``(None, None)``)."""
    for key, hook in module._forward_pre_hooks.items():
        if _is_method(hook) and hook._tensor_name == name:
            return key, hook
    return None, None


def _torch_pruned(module: nn.Module, name: str) -> bool:
    if not isinstance(module, nn.Module):
        return False  # only torch modules can carry torch.nn.utils.prune hooks
    from torch.nn.utils import prune as torch_prune

    return any(
        isinstance(h, torch_prune.BasePruningMethod) and getattr(h, "_tensor_name", None) == name
        for h in module._forward_pre_hooks.values()
    )


def check_prunable(module: Any, name: Any) -> Tuple[Tensor, bool]:
    """Validate ``(module, name)``; return the tensor (``name_orig`` once pruned) and whether it is pruned."""
    if not is_module(module):
        raise TypeError(
            f"expected an nn.Module (torch.nn or tensorplay.nn) to prune, got {type(module).__name__}; "
            "pass the layer that owns the tensor, e.g. prunekit.l1_unstructured(model.fc, 'weight', 0.3)"
        )
    if not isinstance(name, str):
        raise TypeError(f"{describe(module)}: the tensor name must be a str such as 'weight', got {name!r}")
    if name in pruned_names(module):
        sync(module)
        return module._parameters[name + "_orig"], True
    for suffix, role in (("_orig", "the stored tensor"), ("_mask", "the mask")):
        base = name[: -len(suffix)]
        if name.endswith(suffix) and is_masked(module, base):
            raise ValueError(
                f"{describe(module)}.{name} is {role} of the pruned tensor {base!r}, not a tensor to prune; "
                f"prune {base!r} itself (e.g. prunekit.l1_unstructured(module, {base!r}, amount)): a new method "
                f"acts on what is still unpruned. To change {name} directly, write into it under torch.no_grad()"
            )
    if isinstance(module, nn.Module) and torch.nn.utils.parametrize.is_parametrized(module, name):
        raise ValueError(
            f"{describe(module)}.{name} is parametrized (torch.nn.utils.parametrize: {name} is computed from "
            f"module.parametrizations.{name}.original); prune the stored tensor with "
            f"prunekit.l1_unstructured(module.parametrizations.{name}, 'original', amount), or call "
            f"torch.nn.utils.parametrize.remove_parametrizations(module, {name!r}) first"
        )
    if _torch_pruned(module, name):
        raise ValueError(
            f"{describe(module)}.{name} is pruned by torch.nn.utils.prune; call "
            f"torch.nn.utils.prune.remove(module, {name!r}) before pruning it with prunekit"
        )
    param = module._parameters.get(name)
    if param is None:
        if name in module._buffers:
            raise TypeError(
                f"{describe(module, name)} is a buffer, not a parameter; pruning reparameterizes "
                f"parameters (as torch.nn.utils.prune does). Prune a parameter of the module, or register "
                f"it with module.register_parameter({name!r}, nn.Parameter(tensor, requires_grad=False))"
            )
        params = [n for n, p in module._parameters.items() if p is not None] + sorted(pruned_names(module))
        hint = difflib.get_close_matches(name, params, n=1)
        raise ValueError(
            f"{describe(module)} has no parameter {name!r}"
            + (f"; did you mean {hint[0]!r}?" if hint else "")
            + f" Its parameters are: {params or 'none'}"
        )
    for suffix in ("_orig", "_mask"):
        if hasattr(module, name + suffix):
            raise ValueError(
                f"{describe(module, name)}: cannot reparameterize, the module already has an attribute "
                f"{name + suffix!r}; rename it first"
            )
    return param, False


# ---------------------------------------------------------- commit / rollback
def after_restore(module: nn.Module, state: ModuleState) -> None:
    """What a rollback re-derives once ``module``'s structure is back: the cached masked products
    are dropped, a sharded (FSDP2) module is re-pointed at its parameters, an RNN's flat weights
    are refreshed. Passed to every :class:`~prunekit.transaction.ModuleState` that records a module."""
    drop_cache(module)
    sharded = _sharded.handler_for(*state.params.values())
    if sharded is not None:
        sharded.restored(module)
    refresh_flat_weights(module)


class Snapshot(ModuleState):
    """Everything apply/remove may change on a module, to restore after a failure
    (:class:`~prunekit.transaction.ModuleState` with :func:`after_restore`)."""

    __slots__ = ()

    def __init__(self, module: nn.Module) -> None:
        super().__init__(module, after_restore)


def atomic(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Decorate ``fn(module, ...)``: if it fails (``KeyboardInterrupt`` included), ``module``'s
    structure (class, attributes, parameters, buffers, submodules, hooks) is restored as it was.

    The wrapper's last step is the call itself, so no failure can land between a
    completed change and the return. For functions that change tensor values the
    function itself keeps what it overwrites.
    """

    @functools.wraps(fn)
    def wrapper(module: Any, *args: Any, **kwargs: Any) -> Any:
        txn = Transaction(after_restore)
        if is_module(module):
            txn.module(module)
        try:
            return fn(module, *args, **kwargs)
        except BaseException:
            txn.rollback()
            raise

    return wrapper


def install(module: nn.Module, name: str, mask: Tensor, method: Any, hook_key: Optional[int]) -> None:
    """Store ``mask`` for ``name`` and put ``method`` in the hook slot (new, or in place at ``hook_key``)."""
    if name not in pruned_names(module):
        orig = module._parameters[name]
        module.register_parameter(name + "_orig", orig)
        del module._parameters[name]
        module.register_buffer(name + "_mask", mask)
        _set_names(module, pruned_names(module) | {name})
    else:
        module._buffers[name + "_mask"] = mask
    if hook_key is None:
        module.register_forward_pre_hook(method)
    else:
        # replace the value in place: the hook keeps its position among the others
        module._forward_pre_hooks[hook_key] = method
    drop_cache(module, name)
    refresh_flat_weights(module)


def remove(module: nn.Module, name: str) -> nn.Module:
    """Make the pruning of ``name`` permanent and drop the reparameterization.

    ``name`` becomes an ordinary parameter again: the same ``nn.Parameter``
    object as ``name_orig``, with the mask multiplied in. ``name_orig``,
    ``name_mask`` and the hook are removed.

    Raises:
        ValueError: ``name`` of ``module`` is not pruned.

    Examples:
        >>> import torch, prunekit
        >>> m = prunekit.random_unstructured(torch.nn.Linear(5, 7), name="weight", amount=0.2)
        >>> m = prunekit.remove(m, name="weight")
        >>> sorted(n for n, _ in m.named_parameters()), int((m.weight == 0).sum())
        (['bias', 'weight'], 7)
    """
    key, method = find_hook(module, name) if is_module(module) else (None, None)
    if method is None or name not in pruned_names(module):
        raise ValueError(
            f"Parameter '{name}' of module {describe(module) if is_module(module) else module!r} "
            "has to be pruned before pruning can be removed"
        )
    # pruned entries become +0.0 (a plain product would leave -0.0 for negative
    # weights: equal to 0, but a sign bit per zero that compressed checkpoints must keep)
    return _transaction(module, name, True, lambda: _drop(module, name, key))


def _transaction(module: nn.Module, name: str, bake: bool, drop: Any) -> Any:
    """Bake (or not) and ``drop()``, all or nothing: a failure restores the structure and the values.

    Only the entries the bake changes (mask != 1) are kept aside, not the whole tensor.
    """
    sync(module)
    orig, mask = module._parameters[name + "_orig"], module._buffers[name + "_mask"]
    b = backend_of(orig) or TORCH
    txn = Transaction(after_restore)
    txn.module(module)
    try:
        if bake:
            with b.no_grad():
                if type(orig) in _sharded.PLAIN_TYPES and type(mask) in _sharded.PLAIN_TYPES:
                    txn.entries(orig, (mask != 1) if mask.dtype != b.bool else ~mask)
                else:  # a DTensor shard: no boolean indexing there, keep a copy of the shard
                    txn.entries(orig)
            masked(orig, mask, inplace=True)
        return drop()
    except BaseException:
        txn.rollback()
        raise


def _drop(module: nn.Module, name: str, key: Optional[int] = None) -> nn.Module:
    """Undo the reparameterization of ``name``: ``name_orig`` becomes ``name`` again, values untouched."""
    if key is None:
        key = find_hook(module, name)[0]
    orig = module._parameters[name + "_orig"]
    if key is not None:
        del module._forward_pre_hooks[key]
    _set_names(module, pruned_names(module) - {name})
    del module._parameters[name + "_orig"]
    del module._buffers[name + "_mask"]
    module._non_persistent_buffers_set.discard(name + "_mask")
    drop_cache(module, name)
    module.register_parameter(name, orig)
    sharded = _sharded.handler_for(orig)
    if sharded is not None:
        sharded.uninstalled(module, name)
    refresh_flat_weights(module)
    return module


def iter_pruned(module: nn.Module) -> Iterator[Tuple[str, nn.Module, str]]:
    """``(qualified module name, module, tensor name)`` for every tensor prunekit prunes in ``module``."""
    for qual, sub in module.named_modules():
        for key, hook in sub._forward_pre_hooks.items():
            if _is_method(hook):
                yield qual, sub, hook._tensor_name


def is_pruned(module: nn.Module) -> bool:
    """Whether ``module`` or any submodule carries a pruning hook (prunekit's or torch's).

    Examples:
        >>> import torch, prunekit
        >>> m = torch.nn.Linear(5, 7)
        >>> prunekit.is_pruned(m)
        False
        >>> _ = prunekit.random_unstructured(m, name="weight", amount=0.2)
        >>> prunekit.is_pruned(m)
        True
    """
    from torch.nn.utils import prune as torch_prune

    for sub in module.modules():
        for hook in sub._forward_pre_hooks.values():
            if _is_method(hook) or isinstance(hook, torch_prune.BasePruningMethod):
                return True
    return False


def with_context(err: BaseException, module: nn.Module, name: Optional[str]) -> BaseException:
    """The same exception type with the module and tensor named in front of the message."""
    where = describe(module, name)
    msg = str(err)
    if msg.startswith(where.split(" ")[0]):
        return err
    try:
        new = type(err)(f"{where}: {msg}")
    except Exception:  # exotic exception type: keep it as it is
        return err
    new.__cause__ = err.__cause__
    return new
