"""Pruning sharded models: FSDP2 (``fully_shard``) and other ``DTensor`` parameters, and DDP.

The whole pruning API works on ``DTensor`` parameters on a 1-D device mesh
(``Shard(dim)`` or ``Replicate()``) and gives exactly the masks the same call
gives the unsharded model in one process -- without gathering any weights:

* magnitude selection (``l1_unstructured``, ``global_unstructured``) sums one
  histogram over the ranks and gathers a few candidate keys
  (:mod:`prunekit.kernels.select_sharded`);
* channel norms are computed per shard and reduced (one value per channel);
* random methods draw the numbers one process would draw (rank 0's generator).

Masks live beside their shard: ``name_mask`` is a ``DTensor`` placed like the
parameter, so a rank holds only its part. Under FSDP2 the forward pass,
backward pass and optimizer steps work unchanged (:mod:`prunekit.distributed.fsdp`);
the shard's pruned entries of ``name_orig`` are kept at zero (so the weight
FSDP2 gathers is already masked). After writing into pruned shards by hand,
call :func:`remask`.

Under DDP parameters are plain tensors, identical on every rank: every rank
makes the same decision on its own, and nothing needs to be exchanged (seed
every rank alike for the random methods).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, Optional

import torch
from torch import nn

from .. import _sharded
from .checkpoint import load, save
from .compressed import save_compressed
from .errors import CorruptDistributedCheckpointError, DistributedCheckpointError, UnsafeDistributedCheckpointError
from .layout import is_dtensor

if TYPE_CHECKING:
    from .handler import ShardedHandler

__all__ = ["CorruptDistributedCheckpointError", "DistributedCheckpointError", "GroupComm", "UnsafeDistributedCheckpointError",
           "is_dtensor", "load", "remask", "save", "save_compressed", "shard_masks"]


def __getattr__(name: str) -> Any:
    if name == "GroupComm":
        from .comm import GroupComm

        return GroupComm
    if name == "remask":
        from .fsdp import remask

        return remask
    raise AttributeError(f"module 'prunekit.distributed' has no attribute {name!r}")


class _LazyHandler:
    """Registered at import; loads the real handler (and torch.distributed.tensor) on first use."""

    _real: ClassVar[Optional[ShardedHandler]] = None

    def claims_type(self, cls: type) -> bool:
        from .layout import is_dtensor_type

        return is_dtensor_type(cls)

    def __getattr__(self, attr: str) -> Any:
        if _LazyHandler._real is None:
            from .handler import ShardedHandler

            _LazyHandler._real = ShardedHandler()
        return getattr(_LazyHandler._real, attr)


_sharded.register(_LazyHandler())


def shard_masks(model: nn.Module) -> int:
    """Replace full-size masks of sharded parameters by shards placed like the parameters.

    For a model pruned *before* ``fully_shard``: each rank then keeps only its
    part of every mask, and the pruned parameters are wired to FSDP2 as if they
    had been pruned after it. Returns how many masks were converted.

    Example (nothing sharded: nothing to do):
        >>> import torch, prunekit
        >>> m = prunekit.l1_unstructured(torch.nn.Linear(4, 2), "weight", 0.5)
        >>> prunekit.distributed.shard_masks(m)
        0
    """
    from ..reparam import describe, iter_pruned
    from ..reparam._internal import orig_and_mask

    todo = []
    for _, module, name in iter_pruned(model):
        orig, mask = orig_and_mask(module, name)
        if is_dtensor(orig) and not is_dtensor(mask):
            todo.append((module, name, orig, mask))
    if not todo:
        return 0
    from . import fsdp
    from .layout import piece_of, wrap

    new = []
    for module, name, shard, full in todo:
        piece = piece_of(shard, describe(module, name))
        local = piece.spec.local_slice(full).to(piece.local.device).clone(memory_format=torch.contiguous_format)
        new.append(wrap(local, piece))
    for (module, name, _, _), m in zip(todo, new):
        module._buffers[name + "_mask"] = m
        fsdp.wire(module, name)
    return len(todo)
