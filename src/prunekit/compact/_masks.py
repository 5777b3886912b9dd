"""Reading and writing masks through the pruning API (prunekit, or torch.nn.utils.prune)."""

from __future__ import annotations

from typing import Any, Dict, Iterator, Tuple

import torch
import torch.nn.utils.prune as torch_prune
from torch import Tensor, nn


def api() -> Any:
    """prunekit's pruning API when it is importable, else ``torch.nn.utils.prune`` (same names)."""
    try:
        import prunekit

        if hasattr(prunekit, "custom_from_mask") and hasattr(prunekit, "remove"):
            return prunekit
    except ImportError:  # pragma: no cover - prunekit is this package
        pass
    return torch_prune


def owner_of(module: nn.Module, path: str) -> Tuple[nn.Module, str]:
    prefix, _, leaf = path.rpartition(".")
    return (module.get_submodule(prefix) if prefix else module), leaf


def is_masked(owner: nn.Module, name: str) -> bool:
    return hasattr(owner, name + "_orig") and hasattr(owner, name + "_mask")


def effective(owner: nn.Module, name: str) -> Tensor:
    """The value the forward pass uses: ``orig * mask`` for a pruned tensor."""
    if is_masked(owner, name):
        mask = getattr(owner, name + "_mask")
        orig = getattr(owner, name + "_orig")
        return orig.detach() * (mask != 0).to(orig.dtype)
    return getattr(owner, name).detach()


def raw(owner: nn.Module, name: str) -> Tensor:
    """The stored tensor (``name_orig`` when pruned)."""
    return getattr(owner, name + "_orig") if is_masked(owner, name) else getattr(owner, name)


def apply_mask(owner: nn.Module, name: str, mask: Tensor) -> None:
    api().custom_from_mask(owner, name, mask)


def _torch_hook(owner: nn.Module, name: str) -> bool:
    for hook in owner._forward_pre_hooks.values():
        if isinstance(hook, torch_prune.BasePruningMethod):
            if getattr(hook, "_tensor_name", None) == name:
                return True
            if isinstance(hook, torch_prune.PruningContainer) and getattr(hook, "_tensor_name", None) == name:
                return True
    return False


def bake(owner: nn.Module, name: str) -> Tensor:
    """Remove the reparameterization of ``name`` (mask baked in); return the mask."""
    mask = getattr(owner, name + "_mask").detach().clone()
    if _torch_hook(owner, name):
        torch_prune.remove(owner, name)
    else:
        api().remove(owner, name)
    return mask


def iter_masks(model: nn.Module) -> Iterator[Tuple[str, nn.Module, str]]:
    for mname, m in model.named_modules():
        for bname, _ in list(m.named_buffers(recurse=False)):
            if bname.endswith("_mask") and hasattr(m, bname[: -len("_mask")] + "_orig"):
                yield mname, m, bname[: -len("_mask")]
