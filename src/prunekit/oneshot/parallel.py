"""One-shot pruning over several processes: calibration data-parallel, solving weight-parallel.

:class:`Parallel` is what the block walk asks of its processes; the one-process
form (``Parallel()``) does everything in place and every method is a no-op
pass-through, so one code path serves both.

With a ``torch.distributed`` process group of ``W`` ranks (:class:`GroupParallel`):

* **data**: every rank is handed the same calibration batches and runs the
  model only on its share, batches ``r, r + W, r + 2W, ...``; batch ``b`` is
  processed in round ``b // W``;
* **statistics**: each group of layers that share an input has an owner rank;
  in every round each rank sends the owner the rows its batch gave that input
  (padding left out) and the owner adds them *in batch order* -- exactly the
  additions one process makes, in the same order, so ``X^T X`` and the norms
  are bit-identical to one process's; then the owner broadcasts the sums;
* **solving**: each layer is solved once, on the rank that the plan gives it
  (largest first, to the least loaded rank), and its result (weights, mask,
  error) is broadcast to every rank, which writes it into its replica.

Bit-identity with one process holds where every rank computes with the same
number of threads as the one process did (a matrix product may sum in another
order with another thread count). Block tuning (``tune_epochs``) would sum
gradients across ranks in another order than one process: it is refused.

Examples:
    >>> p = Parallel()
    >>> p.share([10, 11, 12]), p.rounds(3), p.plan([5.0, 1.0])
    ([10, 11, 12], 3, [0, 0])
"""

from __future__ import annotations

import math
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

__all__ = ["Parallel", "GroupParallel", "parallel_for"]

Rows = Optional[Tuple[Tensor, ...]]


class Parallel:
    """One process: rank 0 of 1."""

    rank = 0
    world = 1

    def share(self, items: Sequence[Any]) -> List[Any]:
        """This rank's share of ``items`` (all of them in one process)."""
        return list(items[self.rank::self.world])

    def rounds(self, n: int) -> int:
        """How many rounds ``n`` batches take (one batch per rank per round)."""
        return math.ceil(n / self.world)

    def owner(self, index: int) -> int:
        """The rank that gathers the statistics of input group ``index``."""
        return index % self.world

    def plan(self, costs: Sequence[float]) -> List[int]:
        """The rank that solves each job: largest cost first, each to the least loaded rank (ties: lower rank)."""
        load = [0.0] * self.world
        out = [0] * len(costs)
        for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
            r = min(range(self.world), key=lambda r: (load[r], r))
            out[i] = r
            load[r] += costs[i]
        return out

    def deliver(self, owner: int, rows: Rows, add: Callable[..., None]) -> None:
        """This round's rows of one input group (``None``: no batch this round) added on ``owner`` in batch order."""
        if rows is not None:
            add(*rows)

    def share_tensor(self, t: Tensor, src: int) -> Tensor:
        """Rank ``src``'s ``t`` on every rank (in place)."""
        return t

    def sum_int(self, n: int) -> int:
        """``n`` summed over the ranks."""
        return n

    def share_int(self, n: int, src: int) -> int:
        """Rank ``src``'s ``n`` on every rank."""
        return n


class GroupParallel(Parallel):
    """The ranks of a ``torch.distributed`` process group (``None``: the default group)."""

    def __init__(self, group: Any = None) -> None:
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise ValueError("group=...: torch.distributed is not initialised; call "
                             "torch.distributed.init_process_group (torchrun sets up its environment) first")
        self._dist = dist
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.device = torch.device("cpu")
        if dist.get_backend(group) == "nccl":  # collectives on accelerator tensors
            self.device = torch.device("cuda", torch.cuda.current_device())

    def _global(self, rank: int) -> int:
        return rank if self.group is None else self._dist.get_global_rank(self.group, rank)

    def _counts(self, n: int) -> List[int]:
        t = torch.tensor([n], dtype=torch.int64, device=self.device)
        out = [torch.zeros_like(t) for _ in range(self.world)]
        self._dist.all_gather(out, t, group=self.group)
        return [int(x) for x in out]

    def deliver(self, owner: int, rows: Rows, add: Callable[..., None]) -> None:
        counts = self._counts(-1 if rows is None else int(rows[0].shape[0]))
        if all(c < 0 for c in counts):
            return
        like = self._like(rows, counts)
        most = max(max(counts), 0)
        got: List[List[Tensor]] = [[] for _ in range(self.world)]
        for j, (features, dtype) in enumerate(like):
            width = features * torch.empty((), dtype=dtype).element_size()
            mine = torch.zeros(most, width, dtype=torch.uint8, device=self.device)
            if rows is not None and rows[j].shape[0]:
                mine[:rows[j].shape[0]] = _as_bytes(rows[j]).to(self.device)
            bufs = [torch.empty_like(mine) for _ in range(self.world)] if self.rank == owner else None
            self._dist.gather(mine, bufs, dst=self._global(owner), group=self.group)
            if bufs is not None:
                for r in range(self.world):
                    if counts[r] >= 0:
                        got[r].append(_from_bytes(bufs[r][:counts[r]], features, dtype, rows))
        if self.rank == owner:
            for r in range(self.world):
                if counts[r] >= 0:
                    add(*got[r])

    def _like(self, rows: Rows, counts: List[int]) -> List[Tuple[int, torch.dtype]]:
        """(features, dtype) of each part, from the lowest rank that has rows this round."""
        first = min(r for r, c in enumerate(counts) if c >= 0)
        spec = torch.zeros(8, dtype=torch.int64, device=self.device)
        if self.rank == first and rows is not None:
            spec[0] = len(rows)
            for j, t in enumerate(rows[:3]):
                spec[1 + 2 * j] = t.shape[1]
                spec[2 + 2 * j] = _DTYPES.index(t.dtype)
        self._dist.broadcast(spec, src=self._global(first), group=self.group)
        return [(int(spec[1 + 2 * j]), _DTYPES[int(spec[2 + 2 * j])]) for j in range(int(spec[0]))]

    def share_tensor(self, t: Tensor, src: int) -> Tensor:
        if t.dtype == torch.bool:
            u = t.to(torch.uint8).to(self.device)
            self._dist.broadcast(u, src=self._global(src), group=self.group)
            t.copy_(u.to(t.device).bool())
            return t
        buf = t if t.device == self.device else t.to(self.device)
        self._dist.broadcast(buf, src=self._global(src), group=self.group)
        if buf is not t:
            t.copy_(buf)
        return t

    def sum_int(self, n: int) -> int:
        t = torch.tensor([n], dtype=torch.int64, device=self.device)
        self._dist.all_reduce(t, group=self.group)
        return int(t)

    def share_int(self, n: int, src: int) -> int:
        t = torch.tensor([n], dtype=torch.int64, device=self.device)
        self._dist.broadcast(t, src=self._global(src), group=self.group)
        return int(t)


_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


def _as_bytes(t: Tensor) -> Tensor:
    return t.detach().contiguous().view(torch.uint8).reshape(t.shape[0], -1)


def _from_bytes(b: Tensor, features: int, dtype: torch.dtype, rows: Rows) -> Tensor:
    device = rows[0].device if rows is not None else torch.device("cpu")
    return b.contiguous().view(dtype).reshape(-1, features).to(device)


def parallel_for(group: Any) -> Parallel:
    """:class:`Parallel` for ``group``: ``None`` -> one process; ``True`` -> the default process group;
    a process group -> its ranks.

    Examples:
        >>> parallel_for(None).world
        1
    """
    if group is None or group is False:
        return Parallel()
    return GroupParallel(None if group is True else group)
