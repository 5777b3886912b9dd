"""Whole tensors of a sharded state dict, one at a time, on one rank.

:func:`iter_full` walks a state dict whose tensors may be DTensor shards and
rebuilds each tensor on the destination rank only: every other rank sends its
piece straight into the destination's buffer (point to point, exact sizes, no
padding), so the destination holds one full tensor at a time and the others
never hold more than their shards. Boolean tensors travel as bytes (gloo has
no boolean type).
"""

from __future__ import annotations

from typing import Iterator, Mapping, Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from .layout import is_dtensor, piece_of

__all__ = ["iter_full"]


def _wire(t: Tensor) -> Tensor:
    return t.view(torch.uint8) if t.dtype == torch.bool else t


def _chunks(size: int, world: int):
    chunk = -(-size // world) if size else 0
    for r in range(world):
        start = min(r * chunk, size)
        yield r, start, max(min(chunk, size - start), 0)


def _gather_one(t: Tensor, name: str, dst_global: int) -> Optional[Tensor]:
    piece = piece_of(t, name)
    comm = piece.comm
    local = piece.local.detach()
    group = comm.group
    dst = dst_global if group is None else dist.get_group_rank(group, dst_global)
    if piece.spec.dim is None:  # a replica: the destination has it all
        return local.clone() if comm.rank == dst else None
    dim = piece.spec.dim

    def global_rank(r: int) -> int:
        return r if group is None else dist.get_global_rank(group, r)

    if comm.rank != dst:
        if local.numel():
            dist.send(_wire(local.contiguous()), dst=global_rank(dst), group=group)
        return None
    full = torch.empty(piece.global_shape, dtype=local.dtype, device=local.device)
    for r, start, length in _chunks(piece.global_shape[dim], comm.world):
        if length == 0:
            continue
        view = full.narrow(dim, start, length)
        if r == dst:
            view.copy_(local)
            continue
        buf = view if view.is_contiguous() else torch.empty(view.shape, dtype=view.dtype, device=view.device)
        dist.recv(_wire(buf), src=global_rank(r), group=group)
        if buf is not view:
            view.copy_(buf)
    return full


def iter_full(state: Mapping[str, Tensor], dst: int = 0) -> Iterator[Tuple[str, Optional[Tensor]]]:
    """``(name, tensor)`` for every entry; the whole tensor on (global) rank ``dst``, ``None`` elsewhere.

    Collective: every rank iterates the same state dict to the end, in step.
    Plain (unsharded) tensors are the same on every rank and are yielded as
    they are on ``dst``.
    """
    for name, t in state.items():
        if is_dtensor(t):
            yield name, _gather_one(t, name, dst)
        else:
            rank = dist.get_rank() if dist.is_initialized() else 0
            yield name, (t.detach() if rank == dst else None)
