"""Installing and dropping a reparameterization, all or nothing.

:func:`install` stores a mask and its pruning method (the caller -- the
methods layer's ``apply`` -- computes both); :func:`unmask` and :func:`remove`
drop the reparameterization, the mask baked into the stored tensor or not.
Every change is recorded in a :class:`~prunekit.transaction.Transaction` first
and played back on failure; :func:`after_restore` re-derives what a module
computes from its structure once a rollback has put it back.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import torch
from torch import Tensor, nn

from .. import _sharded
from .._backend import TORCH, backend_of, is_module
from ..transaction import ModuleState, Transaction
from .classes import refresh_flat_weights, set_pruned_names
from .hooks import find_hook
from .queries import describe, is_masked, orig_and_mask, pruned_names
from .value import drop_cache, masked, sync

__all__ = ["Snapshot", "after_restore", "atomic", "install", "remove", "unmask"]


# ---------------------------------------------------------------- rollback
def after_restore(module: nn.Module, state: ModuleState) -> None:
    """What a rollback re-derives once ``module``'s structure is back: the cached effective values
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


# ------------------------------------------------------------------ install
def install(module: nn.Module, name: str, mask: Tensor, method: Any, hook_key: Optional[int]) -> None:
    """Store ``mask`` for ``name`` and put ``method`` in the hook slot (new, or in place at ``hook_key``).

    The caller computed ``mask`` and composed ``method`` (``BasePruningMethod.apply``) and
    records the module first (a :class:`Snapshot`): this only changes it.
    """
    if name not in pruned_names(module):
        orig = module._parameters[name]
        module.register_parameter(name + "_orig", orig)
        del module._parameters[name]
        module.register_buffer(name + "_mask", mask)
        set_pruned_names(module, pruned_names(module) | {name})
    else:
        module._buffers[name + "_mask"] = mask
    if hook_key is None:
        module.register_forward_pre_hook(method)
    else:
        # replace the value in place: the hook keeps its position among the others
        module._forward_pre_hooks[hook_key] = method
    drop_cache(module, name)
    refresh_flat_weights(module)


# --------------------------------------------------------------------- drop
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
    orig, mask = orig_and_mask(module, name)
    if name in pruned_names(module):
        return _transaction(module, name, bake, lambda: (_drop(module, name), mask)[1])
    # pruned by torch.nn.utils.prune: its own remove, then the value we define
    from torch.nn.utils import prune as torch_prune

    old_data = orig.data  # torch's remove swaps orig's storage for the product's
    with torch.no_grad():
        value = masked(orig.detach(), mask) if bake else orig.detach().clone()
    snapshot = Snapshot(module)
    try:
        torch_prune.remove(module, name)
        with torch.no_grad():
            getattr(module, name).copy_(value)  # the Parameter torch's remove registered
        return mask
    except BaseException:
        orig.data = old_data
        snapshot.restore()
        raise


def _transaction(module: nn.Module, name: str, bake: bool, drop: Any) -> Any:
    """Bake (or not) and ``drop()``, all or nothing: a failure restores the structure and the values.

    Only the entries the bake changes (mask != 1) are kept aside, not the whole tensor.
    """
    sync(module)
    orig, mask = orig_and_mask(module, name)
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
    set_pruned_names(module, pruned_names(module) - {name})
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
