"""How many units each layer prunes so that a group of layers reaches a budget.

Pure integer/tensor math. Counts are in *units* of each layer's pattern
(elements for ``1x1`` and ``N:M``, blocks for ``NxM``, channels for channel
patterns); ``unit_numel`` converts them to weights.

* :func:`local_counts` -- every layer at (about) the same ratio. The ratio is
  found by water-filling: layers held by their per-layer minimum/maximum take
  what they can and the others share the rest, so the group still reaches its
  budget exactly (to one unit when unit sizes differ between layers).
* :func:`global_counts` -- one ranking across all layers: the budget goes to
  the lowest-scored units wherever they are, subject to each layer's
  ``[lo, hi]`` unit range.
"""

from __future__ import annotations

import math
from typing import List, Sequence

from torch import Tensor

from .._backend import TORCH, backend_of
from ..kernels.select import select_lowest

__all__ = ["local_counts", "global_counts", "check_feasible"]


def check_feasible(budget: int, numel: Sequence[int], lo: Sequence[int], hi: Sequence[int],
                   unit_numel: Sequence[int], names: Sequence[str]) -> None:
    """Raise ValueError when no counts within ``[lo, hi]`` can prune ``budget`` weights.

    Examples:
        >>> from prunekit.training.allocation import check_feasible
        >>> check_feasible(90, [100], [0], [80], [1], ["fc"])
        Traceback (most recent call last):
        ...
        ValueError: cannot prune 90 of 100 weights: the per-layer maxima allow at most 80 (fc: 80/100). Raise max_sparsity_ratio_per_layer or lower target_sparsity.
    """
    most = sum(h * u for h, u in zip(hi, unit_numel))
    least = sum(l * u for l, u in zip(lo, unit_numel))
    total = sum(numel)
    if budget > most:
        detail = ", ".join(f"{n}: {h * u}/{t}" for n, h, u, t in zip(names, hi, unit_numel, numel))
        raise ValueError(
            f"cannot prune {budget} of {total} weights: the per-layer maxima allow at most {most} ({detail}). "
            "Raise max_sparsity_ratio_per_layer or lower target_sparsity."
        )
    if budget < least:
        detail = ", ".join(f"{n}: {l * u}/{t}" for n, l, u, t in zip(names, lo, unit_numel, numel))
        raise ValueError(
            f"cannot prune only {budget} of {total} weights: the per-layer minima already prune {least} "
            f"({detail}). Lower min_sparsity_ratio_per_layer or raise target_sparsity."
        )


def local_counts(budget: int, n_units: Sequence[int], unit_numel: Sequence[int],
                 lo: Sequence[int], hi: Sequence[int]) -> List[int]:
    """Per-layer unit counts at a shared ratio, honouring ``lo``/``hi``, summing to ``budget`` weights.

    Examples:
        >>> from prunekit.training.allocation import local_counts
        >>> local_counts(150, [100, 100], [1, 1], [0, 0], [100, 100])
        [75, 75]
        >>> local_counts(150, [100, 100], [1, 1], [0, 0], [50, 100])   # first layer capped at 50 %
        [50, 100]
    """
    n = len(n_units)
    if n == 0:
        return []

    def filled(r: float) -> List[float]:
        return [min(max(r * nu, l), h) for nu, l, h in zip(n_units, lo, hi)]

    def weights(counts: Sequence[float]) -> float:
        return sum(c * u for c, u in zip(counts, unit_numel))

    a, b = 0.0, 1.0
    for _ in range(64):
        mid = (a + b) / 2
        if weights(filled(mid)) < budget:
            a = mid
        else:
            b = mid
    real = filled(b)
    uniform = len(set(unit_numel)) == 1
    if not uniform:
        # Different unit sizes: round each layer and fix the total greedily, one unit at a time.
        counts = [min(max(int(round(x)), l), h) for x, l, h in zip(real, lo, hi)]
        order = sorted(range(n), key=lambda i: unit_numel[i])
        changed = True
        while changed:
            changed = False
            diff = budget - weights(counts)
            for i in order:
                u = unit_numel[i]
                if diff >= u / 2 and counts[i] < hi[i] and abs(diff - u) < abs(diff):
                    counts[i] += 1
                    changed = True
                    break
                if diff <= -u / 2 and counts[i] > lo[i] and abs(diff + u) < abs(diff):
                    counts[i] -= 1
                    changed = True
                    break
        return counts
    u = unit_numel[0]
    target_units = budget // u if budget % u == 0 else int(round(budget / u))
    counts = [min(max(int(math.floor(x + 1e-9)), l), h) for x, l, h in zip(real, lo, hi)]
    rest = target_units - sum(counts)
    frac = sorted(range(n), key=lambda i: (real[i] - math.floor(real[i] + 1e-9)), reverse=True)
    while rest > 0:
        progressed = False
        for i in frac:
            if rest == 0:
                break
            if counts[i] < hi[i]:
                counts[i] += 1
                rest -= 1
                progressed = True
        if not progressed:
            break
    while rest < 0:
        progressed = False
        for i in reversed(frac):
            if rest == 0:
                break
            if counts[i] > lo[i]:
                counts[i] -= 1
                rest += 1
                progressed = True
        if not progressed:
            break
    return counts


def global_counts(budget: int, unit_scores: Sequence[Tensor], unit_numel: Sequence[int],
                  lo: Sequence[int], hi: Sequence[int]) -> List[int]:
    """Per-layer unit counts from one ranking of all layers' unit scores.

    ``unit_scores[i]`` is layer ``i``'s 1-D unit scores where already-pruned
    units score ``-inf`` and units that may not be pruned score ``+inf``. Each
    layer first takes its ``lo[i]`` lowest units; the rest of the budget goes
    to the lowest remaining units of layers that have not reached ``hi[i]``.

    Examples:
        >>> import torch
        >>> from prunekit.training.allocation import global_counts
        >>> s = [torch.tensor([1., 2., 3., 4.]), torch.tensor([5., 6., 0.5, 0.7])]
        >>> global_counts(4, s, [1, 1], [0, 0], [4, 4])
        [2, 2]
        >>> global_counts(4, s, [1, 1], [0, 0], [4, 1])   # second layer capped at one unit
        [3, 1]
    """
    n = len(unit_scores)
    if n == 0:
        return []
    b = backend_of(unit_scores[0]) or TORCH
    sorted_scores = [b.ns.sort(s.float().reshape(-1))[0] for s in unit_scores]
    counts = [int(l) for l in lo]
    spent = sum(c * u for c, u in zip(counts, unit_numel))
    # candidates: each layer's units ranked lo..hi-1 (those beyond hi may not be taken)
    cand_scores, cand_layer = [], []
    for i, s in enumerate(sorted_scores):
        c = s[counts[i]:hi[i]]
        c = c[c != float("inf")]
        cand_scores.append(c)
        cand_layer.append(b.ns.full((c.numel(),), i, dtype=b.int64, device=c.device))
    if not cand_scores:
        return counts
    scores = b.ns.cat(cand_scores)
    layers = b.ns.cat(cand_layer)
    remaining = budget - spent
    if remaining <= 0 or scores.numel() == 0:
        return counts
    uniform = len(set(unit_numel)) == 1
    if uniform:
        u = unit_numel[0]
        k = min(int(round(remaining / u)), scores.numel())
        # the k lowest candidates, ties by position (layer order, then unit order)
        add = b.ns.bincount(layers[select_lowest(scores, k)], minlength=n)
        return [c + int(a) for c, a in zip(counts, add.tolist())]
    order = b.ns.argsort(scores, stable=True)
    for j in order.tolist():
        i = int(layers[j])
        u = unit_numel[i]
        if remaining - u >= -(u // 2) and remaining > 0:
            counts[i] += 1
            remaining -= u
        if remaining <= 0:
            break
    return counts
