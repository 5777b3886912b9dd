"""The value of a pruned tensor: how it is computed, served, cached and written through.

The words (docs/architecture.md, "The value of a pruned tensor: names"):

* **stored** -- ``name_orig`` as held (the Parameter optimizers update):
  :func:`~prunekit.reparam.queries.stored`;
* **mask** -- ``name_mask``;
* **effective** -- what the module computes with, stored times mask. The
  functions returning it are named after it: :func:`effective` (a fresh,
  detached tensor), :func:`effective_for_reading` (the forward pass's cached one
  when still current, for a reader that never writes into it),
  :func:`effective_with_grad` (autograd's product, what a forward with gradients
  uses) and :func:`_effective_served` (what ``module.name`` returns: the
  property's cache-aware value);
* **masked** -- the operation: :func:`masked` applies a mask to any tensor, the
  one definition every package uses (``+0`` wherever the mask is zero).

``module.name`` is a property (:func:`masked_property`) whose no-grad value is
cached until ``name_orig`` or the mask change; a write through a handed-out
value lands in ``name_orig``'s unpruned entries (:func:`sync`, :func:`assign`:
the write rule of :mod:`prunekit.reparam`).
"""

from __future__ import annotations

import logging
import sys
import weakref
from typing import Any, Dict, Optional

import torch
from torch import Tensor, nn

from .. import _sharded
from .._backend import TORCH, Backend, backend_of, is_tensor
from .queries import describe, is_masked, orig_and_mask, pruned_names

__all__ = ["assign", "drop_cache", "effective", "effective_for_reading", "effective_with_grad", "masked",
           "masked_property", "sync"]

CACHE = "_prunekit_cache"  #: the attribute of a pruned module holding its cached effective values
logger = logging.getLogger(__name__)


# ---------------------------------------------------------------- computing it
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


def effective_with_grad(orig: Tensor, mask: Tensor) -> Tensor:
    """The effective value as autograd computes it: ``orig * mask`` (the forward pass with gradients on).

    The same values as :func:`masked`, except that a masked entry reads ``-0.0``
    where ``orig`` is negative and ``NaN`` where it is not finite.

    Examples:
        >>> import torch
        >>> w = torch.tensor([2.0, 3.0], requires_grad=True)
        >>> effective_with_grad(w, torch.tensor([1.0, 0.0])).sum().backward(); w.grad.tolist()
        [1.0, 0.0]
    """
    return orig * mask


def effective(module: nn.Module, name: str) -> Tensor:
    """The effective value of ``module.name`` (what the forward pass uses), detached: a fresh tensor when masked.

    Examples:
        >>> import torch, prunekit
        >>> m = prunekit.custom_from_mask(torch.nn.Linear(2, 1, bias=False), "weight", torch.tensor([[0, 1]]))
        >>> torch.equal(effective(m, "weight"), m.weight_orig.detach() * torch.tensor([[0.0, 1.0]]))
        True
    """
    if is_masked(module, name):
        orig, mask = orig_and_mask(module, name)
        return masked(orig.detach(), mask)
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
    cache = module.__dict__.get(CACHE)
    entry = cache.get(name) if cache else None
    if entry is not None and is_masked(module, name):
        orig, mask = orig_and_mask(module, name)
        if (type(orig) in _sharded.PLAIN_TYPES and type(mask) in _sharded.PLAIN_TYPES
                and not entry.written() and entry.fresh(orig, mask)):
            return entry.value
    return effective(module, name)


# ------------------------------------------------------------ serving it: the cache
class _CacheEntry:
    """An effective value computed from (``orig``, ``mask``) at known versions, and whether it was handed out."""

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


def _effective_served(module: nn.Module, name: str, orig: Tensor, mask: Tensor, b: Backend = TORCH,
                      own: bool = True) -> Tensor:
    """The effective value ``module.name`` returns; ``own`` when the reader is the module's own forward.

    Never called while tracing or compiling: the property returns the product itself then."""
    cache = module.__dict__.get(CACHE)
    if cache is None:
        cache = module.__dict__[CACHE] = {}
    if cache:
        _sync_name(module, name, cache, orig, mask, b)
    if b.is_grad_enabled() and (orig.requires_grad or mask.requires_grad):
        value = effective_with_grad(orig, mask)
        if not own:  # handed out with gradients: a write into it is seen at the next access too
            held = cache[(name, "grad")] = _CacheEntry(orig, mask, value, b)
            held.exposed = True
        return value
    entry: Optional[_CacheEntry] = cache.get(name)
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


def masked_property(name: str, b: Backend = TORCH) -> property:
    """The property a pruned class serves ``name`` through: the effective value on read, the write rule on
    assignment (PyTorch modules; a TensorPlay module refuses the assignment)."""
    orig_key, mask_key = name + "_orig", name + "_mask"

    plain = _sharded.PLAIN_TYPES

    def fget(self: nn.Module) -> Tensor:
        orig, mask = self._parameters.get(orig_key), self._buffers[mask_key]
        if mask is None:
            raise ValueError(f"{describe(self, name)} is pruned but its {mask_key} buffer is None: set "
                             f"module.{mask_key} to a mask tensor or call prunekit.remove(module, {name!r})")
        if orig is None:  # name_orig is parametrized (torch.nn.utils.parametrize): its computed value
            return effective_with_grad(getattr(self, orig_key), mask)
        if type(mask) not in plain or type(orig) not in plain:
            sharded = _sharded.handler_for(orig, mask)
            if sharded is not None:  # DTensor shards: prunekit.distributed computes it
                return sharded.value(self, name, orig, mask)
        if b is TORCH and (torch.jit.is_tracing() or _is_compiling()):
            # in a traced or compiled graph: the product itself, never a cached constant -- and no frame
            # inspection (sys._getframe is a graph break under torch.compile(fullgraph=True))
            return effective_with_grad(orig, mask)
        own = sys._getframe(1).f_code in type(self).__dict__["_prunekit_own_code"]
        return _effective_served(self, name, orig, mask, b, own)

    def fset(self: nn.Module, value: Any) -> None:
        if b is not TORCH:
            raise AttributeError(
                f"{describe(self, name)} is pruned: it is computed as {orig_key} * {mask_key}. "
                f"Write into module.{orig_key} (e.g. `with {b.name}.no_grad(): module.{orig_key}.copy_(value)`) "
                f"or call prunekit.remove(module, {name!r}) first"
            )
        assign(self, name, value)

    return property(fget, fset, doc=f"``{orig_key} * {mask_key}`` (pruned by prunekit)")


def drop_cache(module: nn.Module, name: Optional[str] = None) -> None:
    """Forget cached effective values (all, or of one tensor). Frees memory; they are rebuilt on demand."""
    cache = module.__dict__.get(CACHE)
    if cache:
        if name is None:
            cache.clear()
        else:
            cache.pop(name, None)


# ------------------------------------------------------------ writing through it
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
    cache = module.__dict__.get(CACHE)
    if not cache:
        return
    b = backend_of(module) or TORCH
    for name in pruned_names(module):
        _sync_name(module, name, cache, *orig_and_mask(module, name), b)


def assign(module: nn.Module, name: str, value: Any) -> None:
    """``module.name = value`` for a pruned ``name``: the write rule (values into ``name_orig``'s
    unpruned entries, the mask still applies; ``name_orig`` stays the same Parameter).

    Examples:
        >>> import torch, prunekit
        >>> m = prunekit.custom_from_mask(torch.nn.Linear(2, 1, bias=False), "weight", torch.tensor([[1, 0]]))
        >>> assign(m, "weight", torch.tensor([[3.0, 4.0]])); m.weight_orig[0, 0].item(), m.weight.tolist()
        (3.0, [[3.0, 0.0]])
    """
    b = backend_of(module) or TORCH
    orig, mask = orig_and_mask(module, name)
    if not is_tensor(value) or tuple(value.shape) != tuple(orig.shape):
        got = f"shape {tuple(value.shape)}" if is_tensor(value) else type(value).__name__
        raise TypeError(
            f"{describe(module, name)} is pruned (computed as {name}_orig * {name}_mask); assigning sets the "
            f"unpruned entries of {name}_orig and needs a tensor of shape {tuple(orig.shape)}, got {got}. "
            f"To replace the tensor itself, call prunekit.remove(module, {name!r}) first"
        )
    sync(module)
    _write_through(module, name, value.detach(), orig, mask, b)
