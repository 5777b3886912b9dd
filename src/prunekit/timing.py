"""The one wall-clock timer of prunekit's measurements: interleaved medians.

Latencies compared with each other (a dense model against its pruned or
compacted twin) are timed in one interleaved loop -- A, B, A, B, ... -- so a
change in machine load hits every candidate alike, and the median of each is
reported. The demo and ``prunekit sparsify`` time models with it.
(``prunekit.sparse``'s per-layer decision keeps its own budgeted loop: it stops
on a time budget and synchronises devices, which this plain loop does not.)
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, List, Sequence

__all__ = ["interleaved_medians"]


def interleaved_medians(calls: Sequence[Callable[[], Any]], repeats: int, warmup: int = 3) -> List[float]:
    """Median seconds per call of each of ``calls``, all timed in one interleaved loop.

    Each call first runs ``warmup`` times untimed; then ``repeats`` rounds time
    every call once, in order.

    Examples:
        >>> medians = interleaved_medians([lambda: sum(range(100)), lambda: None], repeats=5)
        >>> len(medians), all(m >= 0 for m in medians)
        (2, True)
    """
    if repeats < 1:
        raise ValueError(f"interleaved_medians: repeats must be >= 1, got {repeats!r}")
    for call in calls:
        for _ in range(warmup):
            call()
    times: List[List[float]] = [[] for _ in calls]
    for _ in range(repeats):
        for i, call in enumerate(calls):
            t0 = time.perf_counter()
            call()
            times[i].append(time.perf_counter() - t0)
    return [statistics.median(ts) for ts in times]
