"""A :class:`~prunekit.kernels.sharded.Communicator` over a ``torch.distributed`` process group."""

from __future__ import annotations

from typing import Any, List, Optional

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["GroupComm"]


class GroupComm:
    """The collectives prunekit's sharded kernels use, over ``group`` (the default group if ``None``).

    ``sent`` counts the payload bytes handed to collectives by this rank, for
    reports; the bytes on the wire depend on the backend's algorithm.

    Example (in a process group of one):
        >>> import os, tempfile, torch, torch.distributed as dist
        >>> store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
        >>> dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        >>> comm = GroupComm()
        >>> comm.all_reduce_sum(torch.tensor([1, 2])).tolist(), comm.world
        ([1, 2], 1)
        >>> dist.destroy_process_group()
    """

    def __init__(self, group: Optional[Any] = None) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.sent = 0

    def _src(self, rank: int) -> int:
        return rank if self.group is None else dist.get_global_rank(self.group, rank)

    def all_reduce_sum(self, t: Tensor) -> Tensor:
        out = t.contiguous().clone()
        self.sent += out.numel() * out.element_size()
        if self.world > 1:
            dist.all_reduce(out, op=dist.ReduceOp.SUM, group=self.group)
        return out

    def all_gather(self, t: Tensor) -> List[Tensor]:
        t = t.contiguous()
        self.sent += t.numel() * t.element_size()
        if self.world == 1:
            return [t.clone()]
        out = [torch.empty_like(t) for _ in range(self.world)]
        dist.all_gather(out, t, group=self.group)
        return out

    def broadcast(self, t: Tensor, src: int = 0) -> Tensor:
        """Rank ``src``'s ``t`` (in place on the others)."""
        if self.world > 1:
            self.sent += t.numel() * t.element_size() if self.rank == src else 0
            dist.broadcast(t, src=self._src(src), group=self.group)
        return t

    def same_generator(self, device: torch.device) -> None:
        """Give every rank rank 0's random-number generator state for ``device`` (CPU or an accelerator).

        Random pruning methods then draw the same numbers on every rank: the
        numbers one process would draw.
        """
        if self.world == 1:
            return
        if device.type == "cpu":
            state = torch.get_rng_state()
            torch.set_rng_state(self.broadcast(state.clone()))
            return
        mod = getattr(torch, device.type)
        state = mod.get_rng_state(device)
        # collectives on accelerators need device tensors
        synced = self.broadcast(state.to(device)).cpu()
        mod.set_rng_state(synced, device)
