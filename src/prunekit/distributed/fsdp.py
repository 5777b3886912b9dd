"""Pruned parameters under FSDP2 (``torch.distributed.fsdp.fully_shard``).

FSDP2 keeps each parameter as a ``DTensor`` shard and, around a module's
forward and backward, all-gathers it into a plain full tensor that it sets on
the module under the parameter's name. A pruned parameter lives as
``name_orig`` (the same shard object), with its mask beside it as a ``DTensor``
shard ``name_mask`` placed like the parameter -- nothing full-size is kept.
To make that work unchanged:

* FSDP2 is told the parameter's new name (``name_orig``), so it all-gathers
  and sets the right attribute;
* the shard's pruned entries are kept at zero -- set so when the mask is
  stored, again after every step of an optimizer that holds the parameter
  (a global optimizer post-step hook: one multiply per pruned shard and step,
  so stale momentum from before pruning never leaks) and after
  ``load_state_dict``. The weight FSDP2 all-gathers therefore *is*
  ``orig * mask``, and the forward reads it as it is: no full-size mask, no
  extra all-gather, no work per forward. (``DTensor`` in-place ops do not bump
  the local tensor's version counter, so changes cannot be detected lazily;
  after writing into a pruned shard by hand call
  :func:`prunekit.distributed.remask`);
* after FSDP2 reduce-scatters a gradient, the shard's gradient is set to zero
  at pruned entries (a post-accumulate-grad hook), so optimizers see what they
  see in one process: no gradient, hence no update, at pruned entries.

Outside forward and backward, ``module.name`` is ``name_orig * name_mask``
computed shard by shard (a ``DTensor``). The reverse -- ``prunekit.remove`` --
restores FSDP2's original name and removes the hooks.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any, Dict, Optional, Tuple

import torch
from torch import nn

from ..reparam._internal import orig_and_mask
from .layout import is_dtensor

__all__ = ["find_fsdp_param", "mask_shard", "remask", "unwire", "wire", "wired"]

logger = logging.getLogger(__name__)

# module -> {tensor name: post-accumulate-grad hook handle}
_GRAD_HOOKS: "weakref.WeakKeyDictionary[nn.Module, Dict[str, Any]]" = weakref.WeakKeyDictionary()
# module -> its load_state_dict post-hook handle
_LOAD_HOOKS: "weakref.WeakKeyDictionary[nn.Module, Any]" = weakref.WeakKeyDictionary()


def _states():
    from torch.distributed._composable_state import _module_state_mapping

    for ref in list(_module_state_mapping.values()):
        state = ref()
        if state is not None:
            yield state


def _param_groups(state: Any):
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:  # older FSDP2: one group per state
        group = getattr(state, "_fsdp_param_group", None)
        groups = [group] if group is not None else []
    return groups


def find_fsdp_param(param: Any) -> Optional[Tuple[Any, Any]]:
    """``(FSDP state, FSDPParam)`` managing ``param`` (a sharded parameter), or ``None``."""
    for state in _states():
        for group in _param_groups(state):
            for fp in group.fsdp_params:
                if fp.sharded_param is param:
                    return state, fp
    return None


def is_unsharded_copy(t: Any) -> bool:
    """Whether ``t`` is the all-gathered (unsharded) parameter FSDP2 sets on a module around its forward."""
    for state in _states():
        for group in _param_groups(state):
            for fp in group.fsdp_params:
                if getattr(fp, "_unsharded_param", None) is t:
                    return True
    return False


_Key = Tuple[int, str]
# every wired (module, tensor name)
_ENTRIES: Dict[_Key, Tuple["weakref.ref[nn.Module]", str]] = {}
_STEP_HOOK: list = []


def _zero_pruned(t: torch.Tensor, mask: torch.Tensor) -> None:
    """``t`` set to zero where ``mask`` is zero, in place, without a float copy of a boolean mask."""
    if mask.dtype == torch.bool:
        t.masked_fill_(mask.logical_not(), 0)
    elif mask.dtype == t.dtype:
        t.mul_(mask)
    else:
        t.masked_fill_(mask == 0, 0)


def mask_shard(module: nn.Module, name: str) -> None:
    """Set the pruned entries of this rank's shard of ``module.name_orig`` to zero."""
    orig = module._parameters.get(name + "_orig")
    mask = module._buffers.get(name + "_mask")
    if orig is None or mask is None or not is_dtensor(orig) or not is_dtensor(mask):
        return
    with torch.no_grad():
        _zero_pruned(orig._local_tensor, mask._local_tensor)


def _mask_entries(keep: Any = None) -> None:
    for key, (mref, name) in list(_ENTRIES.items()):
        m = mref()
        if m is None:
            del _ENTRIES[key]
            continue
        if keep is None or id(m._parameters.get(name + "_orig")) in keep:
            mask_shard(m, name)


def _after_optimizer_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    if _ENTRIES:
        _mask_entries({id(p) for group in optimizer.param_groups for p in group["params"]})


def _after_load(module: nn.Module, incompatible: Any) -> None:
    for name in list(_GRAD_HOOKS.get(module, {})):
        mask_shard(module, name)


def remask(model: nn.Module) -> int:
    """Zero the pruned entries of every wired shard in ``model`` (after writing into shards by hand).

    Returns how many shards were masked.
    """
    count = 0
    for module in model.modules():
        for name in list(_GRAD_HOOKS.get(module, {})):
            mask_shard(module, name)
            count += 1
    return count


def _grad_hook(mref: "weakref.ref[nn.Module]", name: str):
    def hook(param: Any) -> None:
        m = mref()
        grad = param.grad
        if m is None or grad is None:
            return
        mask = m._buffers.get(name + "_mask")
        if mask is None or not is_dtensor(mask) or not is_dtensor(grad):
            return
        with torch.no_grad():
            _zero_pruned(grad._local_tensor, mask._local_tensor)

    return hook


def wired(module: nn.Module, name: str) -> bool:
    """Whether ``module.name`` is a pruned parameter wired to FSDP2 by :func:`wire`."""
    return name in _GRAD_HOOKS.get(module, {})


def wire(module: nn.Module, name: str) -> None:
    """Tell FSDP2 that ``module.name`` now lives as ``name_orig`` with a sharded mask (idempotent).

    A DTensor parameter that FSDP2 does not manage (``distribute_tensor``,
    tensor parallelism) needs nothing: DTensor ops compute ``orig * mask``.
    """
    orig = orig_and_mask(module, name)[0]
    found = find_fsdp_param(orig)
    if found is None:
        return
    _, fp = found
    info = fp._module_info
    if info.shared_modules:
        raise ValueError(
            f"{type(module).__name__}.{name} is shared with {len(info.shared_modules)} other module(s) "
            "(tied weights) under FSDP2; prunekit cannot give one tensor two masks. Untie it, or prune "
            "it before fully_shard"
        )
    if info.module is not module:
        raise ValueError(f"FSDP2 manages {type(module).__name__}.{name} through another module; prune it there")
    info.param_name = name + "_orig"
    hooks = _GRAD_HOOKS.setdefault(module, {})
    if name not in hooks:
        hooks[name] = orig.register_post_accumulate_grad_hook(_grad_hook(weakref.ref(module), name))
    if module not in _LOAD_HOOKS:
        _LOAD_HOOKS[module] = module.register_load_state_dict_post_hook(_after_load)
    _ENTRIES[(id(module), name)] = (weakref.ref(module), name)
    if not _STEP_HOOK:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        _STEP_HOOK.append(register_optimizer_step_post_hook(_after_optimizer_step))
    mask_shard(module, name)


def unwire(module: nn.Module, name: str) -> None:
    """Undo :func:`wire` once ``module.name`` is a plain parameter again."""
    hooks = _GRAD_HOOKS.get(module, {})
    handle = hooks.pop(name, None)
    if handle is not None:
        handle.remove()
    if not hooks and module in _LOAD_HOOKS:
        _LOAD_HOOKS.pop(module).remove()
    param = module._parameters.get(name)
    found = find_fsdp_param(param) if param is not None else None
    if found is not None:
        found[1]._module_info.param_name = name
    _ENTRIES.pop((id(module), name), None)


def resync(module: nn.Module) -> None:
    """After a rollback restored ``module``'s parameters: point FSDP2 at their current names and drop
    the hooks of tensors that are no longer pruned."""
    for name in list(_GRAD_HOOKS.get(module, {})):
        if name + "_orig" not in module._parameters:
            unwire(module, name)
    for key, param in module._parameters.items():
        if param is not None and is_dtensor(param):
            found = find_fsdp_param(param)
            if found is not None:
                found[1]._module_info.param_name = key
