"""Run a function as W ranks on W threads, with a Communicator over shared memory.

For the sharded kernels' tests: the same collective calls as over
torch.distributed, without processes. A rank that raises aborts the barrier,
so the others fail instead of waiting forever.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, List, Optional, Tuple

import torch

from prunekit.kernels.sharded import ShardSpec

TIMEOUT_S = 60


class _Hub:
    def __init__(self, world: int) -> None:
        self.world = world
        self.barrier = threading.Barrier(world, timeout=TIMEOUT_S)
        self.slots: List[Any] = [None] * world

    def exchange(self, rank: int, t: torch.Tensor) -> List[torch.Tensor]:
        self.slots[rank] = t.detach().clone()
        self.barrier.wait()
        out = [s.clone() for s in self.slots]
        self.barrier.wait()
        return out


class ThreadComm:
    """A Communicator for one rank of a thread group; counts the bytes it hands to collectives."""

    def __init__(self, hub: _Hub, rank: int) -> None:
        self.hub, self.rank, self.world = hub, rank, hub.world
        self.calls = 0

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        parts = self.hub.exchange(self.rank, t)
        out = parts[0]
        for p in parts[1:]:
            out = out + p
        return out

    def all_gather(self, t: torch.Tensor) -> List[torch.Tensor]:
        self.calls += 1
        return self.hub.exchange(self.rank, t)


def run_ranks(world: int, fn: Callable[[ThreadComm], Any]) -> List[Any]:
    """``[fn(comm) for each rank]``, run concurrently; the first exception is re-raised."""
    hub = _Hub(world)
    results: List[Any] = [None] * world
    errors: List[BaseException] = []

    def worker(rank: int) -> None:
        try:
            results[rank] = fn(ThreadComm(hub, rank))
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller
            errors.append(e)
            hub.barrier.abort()

    threads = [threading.Thread(target=worker, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT_S)
    if errors:
        first = [e for e in errors if not isinstance(e, threading.BrokenBarrierError)] or errors
        raise first[0]
    return results


def shard(t: torch.Tensor, world: int, rank: int, dim: Optional[int]) -> Tuple[torch.Tensor, ShardSpec]:
    """Rank ``rank``'s piece of ``t`` as DTensor's ``Shard(dim)`` places it (torch.chunk), or a replica."""
    if dim is None:
        return t, ShardSpec(tuple(t.shape), None, counted=(rank == 0))
    size = t.shape[dim]
    chunk = -(-size // world) if size else 0
    start = min(rank * chunk, size)
    length = max(min(chunk, size - start), 0)
    return t.narrow(dim, start, length), ShardSpec(tuple(t.shape), dim, start, length)


def unshard(pieces: List[torch.Tensor], dim: Optional[int]) -> torch.Tensor:
    """The global tensor from every rank's piece (replicas must agree)."""
    if dim is None:
        for p in pieces[1:]:
            assert torch.equal(p, pieces[0]), "replicas differ between ranks"
        return pieces[0]
    return torch.cat(pieces, dim)
