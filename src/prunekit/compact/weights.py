"""The tensors compaction reads: effective values (masks applied) and whether they are masked.

One place for the question, so handlers and the analysis never reach into the
reparameterization themselves.
"""

from __future__ import annotations

from typing import Optional

from torch import Tensor, nn

from .. import reparam

__all__ = ["effective", "is_masked", "mask_of", "maybe", "read_only"]


def is_masked(module: nn.Module, path: str) -> bool:
    """Whether the tensor at dotted ``path`` carries a pruning mask (prunekit's or torch's)."""
    owner, leaf = reparam.owner_of(module, path)
    return reparam.is_masked(owner, leaf)


def mask_of(module: nn.Module, path: str) -> Optional[Tensor]:
    """The mask of the tensor at dotted ``path`` (prunekit's or torch's), or None when it carries none.

    Examples:
        >>> import torch, prunekit
        >>> m = prunekit.custom_from_mask(torch.nn.Linear(2, 1), "weight", torch.tensor([[1, 0]]))
        >>> mask_of(m, "weight").tolist(), mask_of(m, "bias")
        ([[1.0, 0.0]], None)
    """
    owner, leaf = reparam.owner_of(module, path)
    return reparam.get_mask(owner, leaf)


def effective(module: nn.Module, path: str) -> Tensor:
    """The value the forward pass uses for the tensor at ``path`` (detached; masks applied).

    Examples:
        >>> import torch, prunekit
        >>> m = prunekit.custom_from_mask(torch.nn.Linear(2, 2), "weight", torch.tensor([[1.0, 0], [1, 1]]))
        >>> float(effective(m, "weight")[0, 1])
        0.0
    """
    owner, leaf = reparam.owner_of(module, path)
    return reparam.effective(owner, leaf)


def read_only(module: nn.Module, path: str) -> Tensor:
    """:func:`effective` for a reader that never writes into it: may be the value the module's
    forward pass cached (see :func:`prunekit.reparam.effective_for_reading`).

    Examples:
        >>> import torch, prunekit
        >>> m = prunekit.custom_from_mask(torch.nn.Linear(2, 2), "weight", torch.tensor([[1.0, 0], [1, 1]]))
        >>> torch.equal(read_only(m, "weight"), effective(m, "weight"))
        True
    """
    owner, leaf = reparam.owner_of(module, path)
    return reparam.effective_for_reading(owner, leaf)


def maybe(module: nn.Module, path: str) -> Optional[Tensor]:
    """:func:`effective`, or None when the module has no tensor there (e.g. ``bias=False``)."""
    owner, leaf = reparam.owner_of(module, path)
    if getattr(owner, leaf, None) is None and not hasattr(owner, leaf + "_orig"):
        return None
    return reparam.effective(owner, leaf)
