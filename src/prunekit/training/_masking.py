"""The bridge to prunekit's reparameterization: masks live in ``name_mask`` buffers.

A trainer applies ``custom_from_mask`` once per tensor and afterwards only
updates the mask buffer in place, so ``is_pruned``, ``remove`` and the state
dict of the model always see the current masks.
"""

from __future__ import annotations

from typing import Optional

from torch import Tensor, nn

from .._backend import TORCH, backend_of
from ..reparam import masked_product

__all__ = ["is_reparametrized", "ensure_mask", "get_orig", "get_mask", "raw_weight", "effective_weight"]


def _custom_from_mask():
    from prunekit import custom_from_mask  # the core pruning API (imported late: prunekit imports us)

    return custom_from_mask


def is_reparametrized(module: nn.Module, name: str = "weight") -> bool:
    """True when ``module`` already carries ``name_orig`` and ``name_mask``."""
    return hasattr(module, name + "_orig") and hasattr(module, name + "_mask")


def get_orig(module: nn.Module, name: str = "weight") -> nn.Parameter:
    return getattr(module, name + "_orig")


def get_mask(module: nn.Module, name: str = "weight") -> Tensor:
    return getattr(module, name + "_mask")


def raw_weight(module: nn.Module, name: str = "weight") -> Optional[Tensor]:
    """The dense tensor before masking (``name_orig`` if pruned, else ``name``; None if absent).

    Never evaluates a pruned module's ``name`` property (that would compute ``orig * mask``).
    """
    if is_reparametrized(module, name):
        return get_orig(module, name)
    return getattr(module, name, None)


def ensure_mask(module: nn.Module, name: str = "weight", init: Optional[Tensor] = None) -> Tensor:
    """The module's mask buffer, creating it (all ones, or ``init``) through ``custom_from_mask``."""
    if is_reparametrized(module, name):
        return get_mask(module, name)
    w = getattr(module, name)
    b = backend_of(w) or TORCH
    mask = b.ns.ones_like(w) if init is None else init.to(device=w.device, dtype=w.dtype)
    _custom_from_mask()(module, name, mask=mask)
    return get_mask(module, name)


def effective_weight(module: nn.Module, name: str = "weight") -> Tensor:
    """``name_orig * name_mask`` detached (the weight the forward pass uses)."""
    return masked_product(get_orig(module, name).detach(), get_mask(module, name))
