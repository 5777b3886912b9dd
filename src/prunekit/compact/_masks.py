"""Reading and writing masks through prunekit's pruning API (models pruned by torch.nn.utils.prune are read too)."""

from __future__ import annotations

from typing import Iterator, Tuple

import torch.nn.utils.prune as torch_prune
from torch import Tensor, nn


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
    import prunekit  # late: prunekit imports this package

    prunekit.custom_from_mask(owner, name, mask)


def _torch_hook(owner: nn.Module, name: str) -> bool:
    """Whether ``name`` is pruned by ``torch.nn.utils.prune`` (its hooks; PruningContainer included)."""
    return any(
        isinstance(hook, torch_prune.BasePruningMethod) and getattr(hook, "_tensor_name", None) == name
        for hook in owner._forward_pre_hooks.values()
    )


def bake(owner: nn.Module, name: str) -> Tensor:
    """Remove the reparameterization of ``name`` (mask baked in); return the mask."""
    mask = getattr(owner, name + "_mask").detach().clone()
    if _torch_hook(owner, name):
        torch_prune.remove(owner, name)
    else:
        import prunekit

        prunekit.remove(owner, name)
    return mask


def iter_masks(model: nn.Module) -> Iterator[Tuple[str, nn.Module, str]]:
    """``(module name, module, tensor name)`` for every ``name_orig``/``name_mask`` pair, whoever pruned it."""
    for mname, m in model.named_modules():
        for bname, _ in list(m.named_buffers(recurse=False)):
            if bname.endswith("_mask") and hasattr(m, bname[: -len("_mask")] + "_orig"):
                yield mname, m, bname[: -len("_mask")]
