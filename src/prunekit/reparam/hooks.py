"""The pruning method as a forward pre-hook, as ``torch.nn.utils.prune`` keeps it, and who pruned what.

prunekit registers each pruned tensor's method in ``module._forward_pre_hooks``
(marked ``_prunekit_method``) so that code looking for it there finds it;
torch's own hooks (``torch.nn.utils.prune.BasePruningMethod``) are recognized
too. :func:`check_prunable` refuses what cannot be pruned with an error that
says what to write instead.
"""

from __future__ import annotations

import difflib
from typing import Any, Dict, Iterator, NoReturn, Optional, Tuple

import torch
from torch import Tensor, nn

from .._backend import is_module
from .queries import describe, is_masked, orig_and_mask, pruned_names
from .value import sync

__all__ = ["check_prunable", "find_hook", "is_method", "is_pruned", "iter_pruned"]


def is_method(hook: Any) -> bool:
    """Whether ``hook`` (a forward pre-hook) is a prunekit pruning method."""
    return getattr(hook, "_prunekit_method", False)


def find_hook(module: nn.Module, name: str) -> Tuple[Optional[int], Any]:
    """The key in ``module._forward_pre_hooks`` and the pruning method for ``name`` (or ``(None, None)``).

    Examples:
        >>> import torch, prunekit
        >>> m = prunekit.l1_unstructured(torch.nn.Linear(3, 2), "weight", amount=1)
        >>> type(find_hook(m, "weight")[1]).__name__, find_hook(m, "bias")
        ('L1Unstructured', (None, None))
    """
    hooks: Dict[int, Any] = module._forward_pre_hooks  # a pruning method is a callable object
    for key, hook in hooks.items():
        if is_method(hook) and hook._tensor_name == name:
            return key, hook
    return None, None


def iter_pruned(module: nn.Module) -> Iterator[Tuple[str, nn.Module, str]]:
    """``(qualified module name, module, tensor name)`` for every tensor prunekit prunes in ``module``.

    Examples:
        >>> import torch, prunekit
        >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
        >>> _ = prunekit.l1_unstructured(net[1], "weight", amount=1)
        >>> [(q, n) for q, _, n in iter_pruned(net)]
        [('1', 'weight')]
    """
    for qual, sub in module.named_modules():
        for key, hook in sub._forward_pre_hooks.items():
            if is_method(hook):
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
            if is_method(hook) or isinstance(hook, torch_prune.BasePruningMethod):
                return True
    return False


def _torch_pruned(module: nn.Module, name: str) -> bool:
    if not isinstance(module, nn.Module):
        return False  # only torch modules can carry torch.nn.utils.prune hooks
    from torch.nn.utils import prune as torch_prune

    return any(
        isinstance(h, torch_prune.BasePruningMethod) and getattr(h, "_tensor_name", None) == name
        for h in module._forward_pre_hooks.values()
    )


def check_prunable(module: Any, name: Any) -> Tuple[Tensor, bool]:
    """Validate ``(module, name)``; return the tensor (``name_orig`` once pruned) and whether it is pruned.

    Examples:
        >>> import torch
        >>> m = torch.nn.Linear(2, 2)
        >>> check_prunable(m, "weight")[0] is m.weight, check_prunable(m, "weight")[1]
        (True, False)
    """
    if not is_module(module):
        raise TypeError(
            f"expected an nn.Module (torch.nn or tensorplay.nn) to prune, got {type(module).__name__}; "
            "pass the layer that owns the tensor, e.g. prunekit.l1_unstructured(model.fc, 'weight', 0.3)"
        )
    if not isinstance(name, str):
        raise TypeError(f"{describe(module)}: the tensor name must be a str such as 'weight', got {name!r}")
    if name in pruned_names(module):
        sync(module)
        return orig_and_mask(module, name)[0], True
    _refuse_reparameterized(module, name)
    param = module._parameters.get(name)
    if param is None:
        _refuse_missing(module, name)
    for suffix in ("_orig", "_mask"):
        if hasattr(module, name + suffix):
            raise ValueError(
                f"{describe(module, name)}: cannot reparameterize, the module already has an attribute "
                f"{name + suffix!r}; rename it first"
            )
    return param, False


def _refuse_reparameterized(module: nn.Module, name: str) -> None:
    """Raise when ``name`` is part of a reparameterization (prunekit's, parametrize's or torch's pruning)."""
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


def _refuse_missing(module: nn.Module, name: str) -> NoReturn:
    """Raise for a ``name`` that is not a parameter of ``module``: a buffer, or a name it does not have."""
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
