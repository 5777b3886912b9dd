"""Tensors spread over ranks: where each piece sits, and the small exchanges the kernels need.

A rank holds a *piece* of each tensor: a slice along one dimension of the
row-major global tensor (a shard, as ``DTensor``'s ``Shard(dim)`` places it),
or the whole tensor (a replica). :class:`ShardSpec` says which. Ranks talk
through a :class:`Communicator` with two collectives, ``all_reduce_sum`` and
``all_gather``; :mod:`prunekit.distributed` provides one over
``torch.distributed``, and tests can provide one over threads.

Everything here is collective: every rank calls the same functions, with
pieces of the same tensors, in the same order. What travels is counts and
per-channel values, never the tensors themselves.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional, Protocol, Sequence, Tuple

from torch import Tensor

from .._backend import TORCH, backend_of

__all__ = ["Communicator", "ShardSpec", "gather_along", "prefix_index"]


class Communicator(Protocol):
    """What the sharded kernels need from a process group (every call is collective)."""

    rank: int
    world: int

    def all_reduce_sum(self, t: Tensor) -> Tensor:
        """The element-wise sum of ``t`` over all ranks (every rank gets it)."""

    def all_gather(self, t: Tensor) -> List[Tensor]:
        """Every rank's ``t`` (same shape and dtype on every rank), in rank order."""


@dataclass(frozen=True)
class ShardSpec:
    """Where one rank's local piece sits in the global (row-major) tensor.

    ``dim=None``: the piece is the whole tensor (a replica); ``counted`` says
    whether this rank's copy takes part in counting (exactly one rank per
    replica counts it). Otherwise the piece is the slice
    ``offset:offset + length`` of dimension ``dim``.

    Examples:
        >>> import torch
        >>> spec = ShardSpec((4, 3), dim=0, offset=2, length=2)   # rows 2 and 3 of a 4x3 tensor
        >>> spec.local_shape, spec.global_positions(torch.tensor([0, 4])).tolist()
        ((2, 3), [6, 10])
        >>> spec.local_slice(torch.arange(12).view(4, 3)).tolist()
        [[6, 7, 8], [9, 10, 11]]
    """

    global_shape: Tuple[int, ...]
    dim: Optional[int] = None
    offset: int = 0
    length: int = 0
    counted: bool = True

    @property
    def global_numel(self) -> int:
        return math.prod(self.global_shape)

    @property
    def local_shape(self) -> Tuple[int, ...]:
        if self.dim is None:
            return tuple(self.global_shape)
        shape = list(self.global_shape)
        shape[self.dim] = self.length
        return tuple(shape)

    def global_positions(self, pos: Tensor) -> Tensor:
        """Row-major positions in the global tensor of local flat positions ``pos`` (int64)."""
        if self.dim is None or pos.numel() == 0:
            return pos
        d = self.dim
        inner = math.prod(self.global_shape[d + 1:])
        local_block = self.length * inner
        outer, rem = pos // local_block, pos % local_block
        return outer * (self.global_shape[d] * inner) + rem + self.offset * inner

    def local_slice(self, full: Tensor) -> Tensor:
        """This rank's piece of a tensor of the global shape (a view)."""
        if tuple(full.shape) != tuple(self.global_shape):
            raise ValueError(f"expected a tensor of shape {list(self.global_shape)}, got {list(full.shape)}")
        if self.dim is None:
            return full
        return full.narrow(self.dim, self.offset, self.length)

    def check(self, local_shape: Sequence[int], where: str) -> None:
        """ValueError unless a local piece of ``local_shape`` is what this spec describes."""
        g = tuple(self.global_shape)
        ok = (self.dim is None or (0 <= self.dim < len(g) and 0 <= self.offset
                                   and self.offset + self.length <= g[self.dim]))
        if not ok or tuple(local_shape) != self.local_shape:
            raise ValueError(f"{where}: a local piece of shape {list(local_shape)} does not fit {self}")


def prefix_index(flags: Tensor, spec: ShardSpec, comm: Communicator) -> Tuple[Tensor, int]:
    """Index, among the ``True`` entries of the global tensor in row-major order, of each local one.

    ``flags`` is this rank's piece of a boolean tensor. Returns the indices of
    the local ``True`` entries (in local flat order) and how many ``True``
    entries the global tensor has. Exchanges one count per row of the
    dimensions before the shard dimension (one count for ``dim=0``).

    Example (one rank holding the whole tensor):
        >>> import torch
        >>> class Alone:
        ...     rank, world = 0, 1
        ...     def all_reduce_sum(self, t): return t
        ...     def all_gather(self, t): return [t]
        >>> idx, total = prefix_index(torch.tensor([True, False, True]), ShardSpec((3,)), Alone())
        >>> idx.tolist(), total
        ([0, 1], 2)
    """
    b = backend_of(flags) or TORCH
    xp = b.ns
    f = flags.contiguous().reshape(-1).to(b.bool)
    if spec.dim is None:
        idx = f.to(b.int64).cumsum(0) - 1
        return idx[f], int(f.sum())
    outer = math.prod(spec.global_shape[:spec.dim])
    rows = f.view(outer, -1)
    counts = rows.sum(1, dtype=b.int64)
    meta = xp.cat([xp.tensor([spec.offset], dtype=b.int64, device=f.device), counts])
    parts = xp.stack(comm.all_gather(meta))
    offsets, per_rank = parts[:, 0], parts[:, 1:]
    per_row = per_rank.sum(0)
    base = per_row.cumsum(0) - per_row + per_rank[offsets < spec.offset].sum(0)
    within = rows.to(b.int64).cumsum(1) - 1 + base.view(-1, 1)
    return within[rows], int(per_row.sum())


def gather_along(values: Tensor, spec: ShardSpec, comm: Communicator) -> Tensor:
    """The global vector of per-slice ``values`` along the shard dimension (one value per local slice).

    Example (one rank holding the whole tensor):
        >>> import torch
        >>> class Alone:
        ...     rank, world = 0, 1
        ...     def all_reduce_sum(self, t): return t
        ...     def all_gather(self, t): return [t]
        >>> gather_along(torch.tensor([1.5, 2.5]), ShardSpec((2, 4), dim=0, offset=0, length=2), Alone()).tolist()
        [1.5, 2.5]
    """
    if spec.dim is None:
        return values
    b = backend_of(values) or TORCH
    xp = b.ns
    meta = comm.all_gather(xp.tensor([spec.offset, values.numel()], dtype=b.int64, device=values.device))
    most = max(int(m[1]) for m in meta)
    padded = xp.zeros(most, dtype=values.dtype, device=values.device)
    padded[:values.numel()] = values.reshape(-1)
    out = xp.zeros(spec.global_shape[spec.dim], dtype=values.dtype, device=values.device)
    for m, part in zip(meta, comm.all_gather(padded)):
        off, n = int(m[0]), int(m[1])
        out[off:off + n] = part[:n]
    return out
