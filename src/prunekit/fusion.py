"""Fusing pruned layers (``torch.ao.quantization.fuse_modules``): the fused layer stays pruned.

torch's fuser refuses a pruned module: ``fuse_known_modules`` looks its fuser
method up by the module's exact class (``type_before_parametrizations(m)``,
i.e. ``type(m)``), and the fuser functions and fused classes check the class
again (``nni.LinearReLU`` asserts ``type(linear) == nn.Linear``). A module
pruned by prunekit has a generated subclass of its class (it serves
``weight`` as ``weight_orig * weight_mask``), so
``torch.ao.quantization.fuse_modules`` raises ``NotImplementedError: Cannot
fuse modules``. No registration can fix that from outside torch (the lookup
key is the class itself), so prunekit passes torch its own ``fuser_func``:

* :func:`fuse_known_modules` -- a drop-in for torch's, to pass as
  ``fuser_func=`` to ``torch.ao.quantization.fuse_modules`` /
  ``fuse_modules_qat``;
* :func:`fuse_modules` / :func:`fuse_modules_qat` -- torch's functions with
  that ``fuser_func``, and all or nothing with ``inplace=True``.

How a pruned layer is fused: torch fuses a dense stand-in of each pruned
module (a copy holding ``masked(weight_orig, weight_mask)``, sharing every
other tensor and hook), so the result equals fusing the dense-equivalent
model (the one ``prunekit.remove`` gives). Then the first module of the
group -- the conv or linear whose weight the fused module keeps -- is pruned
again with its own mask and pruning method: where the fused module holds the
stand-in itself (``LinearReLU``, ``ConvReLU2d``, the QAT ``ConvBn2d``), the
original pruned module goes back in its place (the same object and
Parameters); where fusion made new tensors (conv + batchnorm in eval mode
scales each output channel), the new weight, exactly zero at every pruned
entry, becomes ``weight_orig`` under the same mask. A pruned tensor that the
fusion shifts (a pruned conv bias folded with a batchnorm: zeros no longer
zeros) and the pruned tensors of the modules fused away (the batchnorm's)
are fused as their effective values and are no longer pruned (logged).

Examples:
    >>> import torch, prunekit
    >>> from torch import nn
    >>> m = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU()).eval()
    >>> _ = prunekit.l1_unstructured(m[0], "weight", 0.5)
    >>> fused = prunekit.fuse_modules(m, [["0", "1", "2"]])
    >>> type(fused[0]).__name__, prunekit.is_pruned(fused[0][0]), int((fused[0][0].weight == 0).sum())
    ('ConvReLU2d', True, 54)
"""

from __future__ import annotations

import copy
import logging
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from . import reparam
from .reparam._internal import install, orig_and_mask

__all__ = ["fuse_known_modules", "fuse_modules", "fuse_modules_qat"]

logger = logging.getLogger(__name__)


def _methods(module: nn.Module) -> Dict[str, Any]:
    """The pruning method (forward pre-hook) of each pruned tensor of ``module``."""
    return {name: reparam.find_hook(module, name)[1] for name in reparam.pruned_names(module)}


def _stand_in(module: nn.Module) -> nn.Module:
    """A dense copy of a pruned ``module``: its class before pruning, each pruned tensor as its effective
    value (a new Parameter); every other tensor and every other hook is shared, not copied."""
    reparam.sync(module)
    names = reparam.pruned_names(module)
    own = {id(t) for n in names for t in orig_and_mask(module, n)}
    methods = {id(h) for h in _methods(module).values()}
    shared: List[Any] = [t for t in list(module._parameters.values()) + list(module._buffers.values())
                         if t is not None and id(t) not in own]
    for attr in ("_forward_pre_hooks", "_forward_hooks", "_backward_hooks", "_backward_pre_hooks"):
        shared += [h for h in getattr(module, attr, {}).values() if id(h) not in methods]
    memo: Dict[int, Any] = {id(x): x for x in shared}
    dense = copy.deepcopy(module, memo)
    for name in sorted(names):
        reparam.remove(dense, name)
    return dense


def _find(root: nn.Module, target: nn.Module) -> Optional[Tuple[Optional[nn.Module], str]]:
    """``(parent, key)`` where ``target`` sits in ``root`` (``(None, "")`` when it is ``root``)."""
    if root is target:
        return None, ""
    for parent in root.modules():
        for key, child in parent._modules.items():
            if child is target:
                return parent, key
    return None


def _counterpart(fused: nn.Module, base: type, shapes: Dict[str, Tuple[int, ...]]) -> Optional[nn.Module]:
    """The module of ``fused`` that took over the pruned module's tensors (same class, same shapes)."""
    for m in fused.modules():
        if type(m) is base and all(_shape(m._parameters.get(n)) == s for n, s in shapes.items()):
            return m
    return None


def _shape(t: Optional[Tensor]) -> Optional[Tuple[int, ...]]:
    return tuple(t.shape) if isinstance(t, Tensor) else None


def _prune_again(fused: nn.Module, head: nn.Module, stand: nn.Module) -> nn.Module:
    """Put ``head``'s pruning on the fused module; returns the fused module (``head`` when it is the stand-in)."""
    where = _find(fused, stand)
    if where is not None:  # the fuser kept the module itself: the original pruned module takes its place
        parent, key = where
        method_ids = {id(h) for h in _methods(head).values()}
        for k in [k for k, h in head._forward_pre_hooks.items() if id(h) not in method_ids]:
            del head._forward_pre_hooks[k]  # torch moved these onto the fused module (from the stand-in)
            head._forward_pre_hooks_with_kwargs.pop(k, None)
        if parent is None:
            return head
        parent._modules[key] = head
        return fused
    base = reparam.base_class(head)
    masks = {n: orig_and_mask(head, n)[1] for n in reparam.pruned_names(head)}
    target = _counterpart(fused, base, {n: tuple(m.shape) for n, m in masks.items()})
    if target is None:
        raise ValueError(
            f"fuse_known_modules: the fused module {type(fused).__name__} has no {base.__name__} holding the "
            f"pruned tensors {sorted(masks)} of {reparam.describe(head)}, so it cannot stay pruned; fuse the "
            "dense-equivalent model instead (prunekit.remove(module, name) for each pruned tensor first)"
        )
    methods = _methods(head)
    for name in sorted(masks):
        mask, value = masks[name], target.get_parameter(name)
        zeros = (~mask) if mask.dtype == torch.bool else (mask == 0)
        if bool((value.detach()[zeros] != 0).any()):
            logger.warning("fuse_known_modules: %s.%s is no longer pruned after fusion (the fusion shifts its "
                           "pruned entries, e.g. a bias folded with a batchnorm); it holds its fused value",
                           reparam.describe(head), name)
            continue
        install(target, name, mask.clone(), methods[name], None)
    return fused


def fuse_known_modules(mod_list: Sequence[nn.Module], is_qat: bool,
                       additional_fuser_method_mapping: Optional[Dict[Any, Any]] = None) -> List[nn.Module]:
    """``torch.ao.quantization.fuse_known_modules`` that accepts pruned modules; the result stays pruned.

    Pass it as ``fuser_func=`` to ``torch.ao.quantization.fuse_modules`` or
    ``fuse_modules_qat``. Modules that are not pruned are fused by torch
    exactly as without it. See the module docstring for what stays pruned.

    Examples:
        >>> import torch, prunekit
        >>> from torch import nn
        >>> m = nn.Sequential(nn.Linear(4, 4), nn.ReLU()).eval()
        >>> lin = prunekit.l1_unstructured(m[0], "weight", 0.5)
        >>> fused = torch.ao.quantization.fuse_modules(m, [["0", "1"]], fuser_func=prunekit.fuse_known_modules)
        >>> type(fused[0]).__name__, prunekit.is_pruned(fused[0][0]), int((fused[0][0].weight == 0).sum())
        ('LinearReLU', True, 8)
    """
    from torch.ao.quantization.fuse_modules import fuse_known_modules as torch_fuse_known_modules

    mods = list(mod_list)
    stand_ins = [_stand_in(m) if reparam.pruned_names(m) else m for m in mods]
    fused = torch_fuse_known_modules(stand_ins, is_qat, additional_fuser_method_mapping)
    if reparam.pruned_names(mods[0]):
        fused[0] = _prune_again(fused[0], mods[0], stand_ins[0])
    for m, s in zip(mods[1:], stand_ins[1:]):
        if s is not m:
            logger.info("fuse_known_modules: %s is fused away; its pruned tensors are fused as their values",
                        reparam.describe(m))
    return fused


def _fuse(model: nn.Module, modules_to_fuse: Sequence[Any], is_qat: bool, inplace: bool,
          fuse_custom_config_dict: Optional[Dict[str, Any]]) -> nn.Module:
    from torch.ao.quantization import fuse_modules as torch_fuse_modules, fuse_modules_qat as torch_fuse_modules_qat

    run = torch_fuse_modules_qat if is_qat else torch_fuse_modules
    if not inplace:  # torch works on a deep copy: the model is never touched
        return run(model, modules_to_fuse, inplace=False, fuser_func=fuse_known_modules,
                   fuse_custom_config_dict=fuse_custom_config_dict)
    groups = [modules_to_fuse] if all(isinstance(x, str) for x in modules_to_fuse) else list(modules_to_fuse)
    # everything torch and fuse_known_modules change in place: the parents' children, the hooks moved
    saved_children: Dict[int, Tuple[nn.Module, Dict[str, Any]]] = {}
    saved_hooks: List[Tuple[Dict[Any, Any], Dict[Any, Any]]] = []
    for group in groups:
        for path in group:
            if not isinstance(path, str):
                raise TypeError(f"fuse_modules: modules_to_fuse holds {path!r}; give module names such as 'conv1'")
            parent_path, _, _ = path.rpartition(".")
            parent = model.get_submodule(parent_path) if parent_path else model
            saved_children.setdefault(id(parent), (parent, dict(parent._modules)))
            mod = model.get_submodule(path)
            for attr in ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks",
                         "_forward_hooks_with_kwargs"):
                d = getattr(mod, attr)
                saved_hooks.append((d, dict(d)))
    try:
        return run(model, modules_to_fuse, inplace=True, fuser_func=fuse_known_modules,
                   fuse_custom_config_dict=fuse_custom_config_dict)
    except BaseException:
        for parent, children in saved_children.values():
            parent._modules.clear()
            parent._modules.update(children)
        for d, items in saved_hooks:
            d.clear()
            d.update(items)
        raise


def fuse_modules(model: nn.Module, modules_to_fuse: Sequence[Any], inplace: bool = False,
                 fuse_custom_config_dict: Optional[Dict[str, Any]] = None) -> nn.Module:
    """``torch.ao.quantization.fuse_modules`` for a model with pruned layers: fused layers stay pruned.

    Same arguments as torch's (without ``fuser_func``: it is
    :func:`fuse_known_modules`); outputs equal those of fusing the
    dense-equivalent model. With ``inplace=True`` it is all or nothing: on any
    exception (``KeyboardInterrupt`` included) the model is left as it was.

    Examples:
        >>> import torch, prunekit
        >>> from torch import nn
        >>> m = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)).eval()
        >>> _ = prunekit.l1_unstructured(m[0], "weight", 0.5)
        >>> fused = prunekit.fuse_modules(m, ["0", "1"])
        >>> type(fused[0]).__name__, type(fused[1]).__name__, torch.equal(fused[0].weight_mask, m[0].weight_mask)
        ('Conv2d', 'Identity', True)
    """
    return _fuse(model, modules_to_fuse, False, inplace, fuse_custom_config_dict)


def fuse_modules_qat(model: nn.Module, modules_to_fuse: Sequence[Any], inplace: bool = False,
                     fuse_custom_config_dict: Optional[Dict[str, Any]] = None) -> nn.Module:
    """``torch.ao.quantization.fuse_modules_qat`` for a model with pruned layers (see :func:`fuse_modules`).

    Examples:
        >>> import torch, prunekit
        >>> from torch import nn
        >>> m = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU()).train()
        >>> conv = prunekit.l1_unstructured(m[0], "weight", 0.5)
        >>> fused = prunekit.fuse_modules_qat(m, [["0", "1", "2"]], inplace=True)
        >>> type(fused[0]).__name__, fused[0][0] is conv, prunekit.is_pruned(fused[0][0])
        ('ConvBnReLU2d', True, True)
    """
    return _fuse(model, modules_to_fuse, True, inplace, fuse_custom_config_dict)
