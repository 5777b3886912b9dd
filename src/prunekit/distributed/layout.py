"""DTensors as prunekit sees them: this rank's piece, where it sits, and the group to talk to.

``DTensor`` parameters on a 1-D device mesh (what FSDP2's ``fully_shard`` and
``distribute_tensor`` make) with a ``Shard(dim)`` placement are pieces of the
row-major global tensor split as ``torch.chunk`` splits it; ``Replicate()``
ones are whole copies, counted once (by the mesh's rank 0).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, Tuple

import torch
from torch import Tensor

if TYPE_CHECKING:  # imported where a DTensor is made, never to recognise one
    from torch.distributed.tensor import DTensor
    from typing_extensions import TypeGuard

from ..kernels.sharded import ShardSpec
from .comm import GroupComm

__all__ = ["Piece", "as_dtensor", "is_dtensor", "is_dtensor_type", "piece_of", "replica_piece", "to_local_like", "wrap"]

_COMMS: Dict[Any, GroupComm] = {}


def is_dtensor_type(cls: type) -> bool:
    """Whether ``cls`` is ``torch.distributed.tensor.DTensor`` (or a subclass), without importing it."""
    return any(c.__name__ == "DTensor" and c.__module__.startswith("torch.distributed") for c in cls.__mro__)


def is_dtensor(t: Any) -> TypeGuard[DTensor]:
    """Whether ``t`` is a ``DTensor``.

    Examples:
        >>> import torch
        >>> is_dtensor(torch.zeros(2))
        False
    """
    return is_dtensor_type(type(t))


def as_dtensor(t: Any, where: str) -> DTensor:
    """``t``, which must be a ``DTensor``; a ``TypeError`` naming ``where`` otherwise.

    Examples:
        >>> import torch
        >>> as_dtensor(torch.zeros(2), "fc.weight")
        Traceback (most recent call last):
        ...
        TypeError: fc.weight: expected a DTensor, got a Tensor
    """
    if not is_dtensor(t):
        raise TypeError(f"{where}: expected a DTensor, got a {type(t).__name__}")
    return t


def _comm(group: Any) -> GroupComm:
    comm = _COMMS.get(group)
    if comm is None:
        comm = _COMMS[group] = GroupComm(group)
    return comm


@dataclass
class Piece:
    """This rank's part of one tensor: ``local`` values, ``spec`` (where they sit), ``comm`` (the group).

    ``mesh``/``placements`` are the DTensor's (``None`` for a plain replicated tensor).
    """

    local: Tensor
    spec: ShardSpec
    comm: GroupComm
    mesh: Any = None
    placements: Tuple[Any, ...] = ()

    @property
    def global_shape(self) -> Tuple[int, ...]:
        return tuple(self.spec.global_shape)


def piece_of(t: Tensor, where: str) -> Piece:
    """The :class:`Piece` of a DTensor; ``ValueError`` for layouts prunekit cannot prune exactly."""
    from torch.distributed.tensor import Shard

    t = as_dtensor(t, where)
    mesh = t.device_mesh
    if mesh.ndim != 1:
        raise ValueError(
            f"{where}: prunekit.distributed prunes DTensors on a 1-D device mesh; this one is on a "
            f"{mesh.ndim}-D mesh {tuple(mesh.shape)} (placements {t.placements}). Shard over one mesh dimension "
            "(e.g. fully_shard(model, mesh=init_device_mesh('cpu', (world,))))"
        )
    placement = t.placements[0]
    local = t.to_local()
    gshape = tuple(t.shape)
    rank = mesh.get_local_rank()
    comm = _comm(mesh.get_group(0))
    if placement.is_replicate():
        spec = ShardSpec(gshape, None, counted=(rank == 0))
    elif isinstance(placement, Shard) and type(placement).__name__ == "Shard":  # not a _StridedShard
        dim = placement.dim % len(gshape)
        size, world = gshape[dim], mesh.size()
        chunk = -(-size // world) if size else 0
        start = min(rank * chunk, size)
        length = local.shape[dim]
        if length != max(min(chunk, size - start), 0):
            raise ValueError(
                f"{where}: this rank holds {length} of {size} slices along dim {dim}, not the torch.chunk "
                f"split DTensor's Shard({dim}) makes ({max(min(chunk, size - start), 0)}); prunekit cannot place it"
            )
        spec = ShardSpec(gshape, dim, start, length)
    else:
        raise ValueError(
            f"{where}: placement {placement} is not supported by prunekit.distributed; it prunes Shard(dim) "
            "and Replicate() DTensors. Redistribute first (dtensor.redistribute(mesh, [Shard(0)]))"
        )
    return Piece(local, spec, comm, mesh, tuple(t.placements))


def replica_piece(t: Tensor, comm: GroupComm) -> Piece:
    """A plain tensor that every rank of ``comm`` holds whole (counted once, by rank 0)."""
    return Piece(t, ShardSpec(tuple(t.shape), None, counted=(comm.rank == 0)), comm)


def _contiguous_stride(shape: Tuple[int, ...]) -> Tuple[int, ...]:
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(stride))


def wrap(local: Tensor, piece: Piece) -> Tensor:
    """``local`` (shaped like ``piece.local``) as a DTensor placed like ``piece``'s (plain if it is plain)."""
    if piece.mesh is None:
        return local
    from torch.distributed.tensor import DTensor

    shape = piece.global_shape
    return DTensor.from_local(local, piece.mesh, piece.placements, run_check=False,
                              shape=torch.Size(shape), stride=_contiguous_stride(shape))


def to_local_like(x: Tensor, piece: Piece, what: str) -> Tensor:
    """This rank's part of ``x`` -- a DTensor (redistributed to ``piece``'s placement if needed) or a
    plain tensor of the global shape (sliced) -- shaped like ``piece.local``."""
    if is_dtensor(x):
        if piece.mesh is None:
            raise TypeError(f"{what} is a DTensor but the tensor it goes with is not; pass a plain tensor")
        if x.device_mesh != piece.mesh:
            raise ValueError(f"{what} lives on device mesh {x.device_mesh}, the parameter on {piece.mesh}")
        if tuple(x.placements) != tuple(piece.placements):
            x = x.redistribute(piece.mesh, piece.placements)
        return x.to_local()
    if tuple(x.shape) != piece.global_shape:
        raise ValueError(f"{what} has shape {list(x.shape)}, expected {list(piece.global_shape)}")
    return piece.spec.local_slice(x)


def global_numel(piece: Piece) -> int:
    return math.prod(piece.global_shape)
