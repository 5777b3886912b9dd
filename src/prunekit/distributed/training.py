"""Training-aware pruning of sharded layers: a pruner's mask update, decided across ranks.

:meth:`prunekit.training.Pruner.update_masks` hands over here when its layers
are DTensor shards. The steps are the single-process ones -- unit scores under
the pattern, already-pruned units first, the per-layer bounds, the budget of
the scheduled sparsity, local or global allocation, the lowest units kept out
-- with every count and every ranking taken over all ranks:

* each rank scores the units of its own shard. That needs the shard
  boundaries to fall between units: FSDP2 shards along dim 0 (output rows),
  so an ``NxM`` block pattern needs every rank's row count to be a multiple of
  ``N`` (``N:M`` groups and whole output channels always fit); ``channelx1``
  units (input channels) span every rank, and their scores are summed across
  ranks (one value per channel);
* counts (already-pruned units per layer, selected units) are all-reduced;
* the lowest units are chosen with the sharded selection kernel (one
  histogram all-reduce per choice, ties by position) -- for each layer with
  ``local`` scope; across layers with ``global`` scope, first without the
  per-layer caps and, only when a cap binds, exactly with them. With
  channel patterns the unit scores (one per channel) are gathered and the
  single-process allocation runs on them as it is.
"""

from __future__ import annotations

import math
from typing import Any, List, Tuple

import torch
from torch import Tensor

from ..kernels.select_sharded import keep_mask_smallest_sharded
from ..kernels.sharded import ShardSpec, gather_along
from ..reparam import describe
from ..reparam._internal import orig_and_mask
from .layout import Piece, is_dtensor, piece_of, to_local_like, wrap

__all__ = ["check_pattern", "count_pruned_units", "update_masks"]


class _Units:
    """One layer's units under a pattern, as this rank sees them."""

    def __init__(self, pattern: Any, piece: Piece, where: str) -> None:
        from ..training.patterns import ChannelPattern, NInMPattern, NxMPattern

        self.pattern, self.piece = pattern, piece
        spec = piece.spec
        shape = spec.global_shape
        self.n_units = pattern.n_units(shape)
        self.replicated = False  # every rank holds every unit's full score
        if spec.dim is None:
            self.spec = ShardSpec((self.n_units,), None, counted=spec.counted)
            return
        if spec.dim != 0:
            raise ValueError(
                f"{where}: training-aware pruning needs shards along dim 0 (FSDP2's default, output rows); this "
                f"weight is sharded along dim {spec.dim}"
            )
        rows = shape[0]
        per_row = self.n_units // rows if rows else 0
        if isinstance(pattern, ChannelPattern) and pattern.axis == "in":
            self.replicated = True  # an input channel spans every row, hence every rank
            self.spec = ShardSpec((self.n_units,), None, counted=(piece.comm.rank == 0))
            return
        if isinstance(pattern, NxMPattern):
            if spec.offset % pattern.n or spec.length % pattern.n:
                raise ValueError(
                    f"{where}: pattern {pattern.name!r} prunes blocks of {pattern.n} output rows, but this rank's "
                    f"shard holds rows {spec.offset}..{spec.offset + spec.length - 1} of {rows}: the shard "
                    f"boundaries (every {-(-rows // piece.comm.world)} rows over {piece.comm.world} ranks) must "
                    f"fall on multiples of {pattern.n}. Use a rank count for which they do, or a pattern with "
                    f"blocks of 1 row ('1x{pattern.m}', 'N:M')"
                )
            per_block_row = self.n_units // (rows // pattern.n)
            self.spec = ShardSpec((self.n_units,), 0, spec.offset // pattern.n * per_block_row,
                                  spec.length // pattern.n * per_block_row)
        elif isinstance(pattern, (NInMPattern, ChannelPattern)):
            self.spec = ShardSpec((self.n_units,), 0, spec.offset * per_row, spec.length * per_row)
        else:
            raise TypeError(f"{where}: pattern {type(pattern).__name__} has no sharded form")

    def scores(self, local_scores: Tensor) -> Tensor:
        """This rank's unit scores (all units' when replicated)."""
        if not self.replicated:
            return self.pattern.unit_scores(local_scores)
        units = self.pattern.to_units(local_scores.float())
        total = self.piece.comm.all_reduce_sum(units.sum(dim=1, dtype=torch.float64))
        return (total / self.pattern.unit_numel(self.piece.spec.global_shape)).float()

    def pruned(self, local_mask: Tensor) -> Tensor:
        """Units whose entries are all zero (this rank's units; all units when replicated)."""
        if not self.replicated:
            return self.pattern.unit_pruned(local_mask)
        alive = self.pattern.to_units(local_mask != 0).any(dim=1).to(torch.int64)
        return self.piece.comm.all_reduce_sum(alive) == 0

    def expand(self, keep_units: Tensor) -> Tensor:
        return self.pattern.expand(keep_units, tuple(self.piece.local.shape))

    def full(self, values: Tensor) -> Tensor:
        """Every unit's value from this rank's (gathered; for channel patterns only)."""
        return values if self.spec.dim is None else gather_along(values, self.spec, self.piece.comm)


def check_pattern(pattern: Any, name: str, module: Any, weight: Tensor) -> None:
    """ValueError (on every rank) unless every rank's shard of ``weight`` holds whole units of ``pattern``."""
    piece = piece_of(weight, describe(module, "weight") + f" (layer {name!r})")
    problem = None
    try:
        _Units(pattern, piece, f"layer {name!r}")
    except (ValueError, TypeError) as e:
        problem = e
    # decided together: a rank whose own shard fits still raises when another rank's does not
    bad = int(piece.comm.all_reduce_sum(torch.tensor([0 if problem is None else 1], dtype=torch.int64)))
    if problem is not None:
        raise problem
    if bad:
        raise ValueError(
            f"layer {name!r}: pattern {pattern.name!r} does not fit the shard of another rank (the error there "
            "says why); shard boundaries must fall between the pattern's units"
        )


def _piece(pruner: Any, name: str, module: Any) -> Piece:
    orig = orig_and_mask(module, pruner.weight_name)[0]
    return piece_of(orig, describe(module, pruner.weight_name) + f" (layer {name!r})")


def count_pruned_units(pruner: Any, name: str, module: Any, mask: Tensor) -> int:
    """How many units of ``mask`` (a DTensor placed like the layer's weight) are fully pruned."""
    w = module._parameters.get(pruner.weight_name + "_orig", module._parameters.get(pruner.weight_name))
    piece = piece_of(w, describe(module, pruner.weight_name))
    units = _Units(pruner.pattern, piece, f"layer {name!r}")
    pruned = units.pruned(to_local_like(mask, piece, "mask"))
    if units.spec.dim is None:
        return int(pruned.sum())
    return int(piece.comm.all_reduce_sum(pruned.sum().reshape(1).to(torch.int64)))


def _lowest(rankings: List[Tensor], specs: List[ShardSpec], comm: Any, k: int,
            eligible: List[Tensor]) -> List[Tensor]:
    """Boolean: the ``k`` lowest eligible entries over all rankings and ranks (non-negative scores)."""
    bad = sum(int(((r < 0) & e).sum()) for r, e in zip(rankings, eligible))
    if int(comm.all_reduce_sum(torch.tensor([bad], dtype=torch.int64))):
        raise ValueError("sharded pruning ranks non-negative scores (magnitudes); the criterion gave negative ones")
    keeps = keep_mask_smallest_sharded(rankings, specs, comm, k, eligible)
    return [~kp for kp in keeps]


def update_masks(pruner: Any, step: int) -> None:
    """:meth:`Pruner.update_masks` for sharded layers (see the module docstring)."""
    from ..training.allocation import global_counts, local_counts
    from ..training.patterns import ChannelPattern, select_lowest

    sparsity = pruner.scheduler.sparsity(step)
    names = list(pruner.modules)
    scale = sparsity / pruner.target_sparsity_ratio if pruner.target_sparsity_ratio > 0 else 0.0
    pattern = pruner.pattern
    layers: List[Tuple[str, Piece, _Units, Tensor, Tensor, Tensor]] = []
    comm = None
    with torch.no_grad():
        for n in names:
            m = pruner.modules[n]
            piece = _piece(pruner, n, m)
            if comm is None:
                comm = piece.comm
            elif piece.comm.group != comm.group:
                raise ValueError(f"layer {n!r} is sharded over another process group than {names[0]!r}")
            units = _Units(pattern, piece, f"layer {n!r}")
            mask = to_local_like(pruner.masks[n], piece, "mask")
            scores = pruner.layer_scores(n, m)
            scores = to_local_like(scores, piece, "scores") if is_dtensor(scores) else piece.spec.local_slice(scores)
            u = units.scores(scores.to(mask.device))
            already = units.pruned(mask)
            ranking = pattern.ranking(u, already)
            layers.append((n, piece, units, u, already, ranking))
        if comm is None:  # no layers: nothing to update
            return
        # already-pruned units per layer, over all ranks (one all-reduce)
        local_pruned = torch.tensor([int(a.sum()) if un.spec.counted or un.spec.dim is not None else 0
                                     for _, _, un, _, a, _ in layers], dtype=torch.int64)
        pruned_units = comm.all_reduce_sum(local_pruned).tolist()
        shapes = [p.spec.global_shape for _, p, _, _, _, _ in layers]
        numel = [math.prod(s) for s in shapes]
        un = [pattern.unit_numel(s) for s in shapes]
        lo, hi = [], []
        for n, shape, pu in zip(names, shapes, pruned_units):
            a, b = pruner._unit_bounds(n, shape, int(pu), min(scale, 1.0))
            lo.append(a)
            hi.append(b)
        budget = pruner._budget(sparsity, numel, un)
        budget = max(budget, sum(a * u for a, u in zip(lo, un)))
        budget = min(budget, sum(b * u for b, u in zip(hi, un)))

        if isinstance(pattern, ChannelPattern):
            # one score per channel: gather them and allocate exactly as one process does
            full = [units.full(r) for _, _, units, _, _, r in layers]
            if pruner.config.prune_domain == "global":
                counts = global_counts(budget, full, un, lo, hi)
            else:
                counts = local_counts(budget, [pattern.n_units(s) for s in shapes], un, lo, hi)
            picks = []
            for (_, _, units, _, _, _), f, k in zip(layers, full, counts):
                chosen = select_lowest(f, k)
                picks.append(chosen if units.spec.dim is None
                             else chosen[units.spec.offset:units.spec.offset + units.spec.length])
        else:
            finite = [torch.isfinite(r) for *_, r in layers]
            specs = [units.spec for _, _, units, _, _, _ in layers]
            if pruner.config.prune_domain == "global":
                picks = _global_picks(layers, finite, specs, comm, budget, un, lo, hi, pruned_units)
            else:
                counts = local_counts(budget, [pattern.n_units(s) for s in shapes], un, lo, hi)
                picks = []
                for (_, _, units, _, already, ranking), fin, k, pu in zip(layers, finite, counts, pruned_units):
                    extra = _lowest([ranking], [units.spec], comm, int(k) - int(pu), [fin])[0]
                    picks.append(already | extra)
        for (n, piece, units, _, _, _), pick in zip(layers, picks):
            keep = units.expand(~pick).to(piece.local.device).contiguous()
            pruner._set_mask(n, wrap(keep, piece))
    pruner.current_sparsity_ratio = sparsity


def _global_picks(layers, finite, specs, comm, budget: int, un, lo, hi, pruned_units) -> List[Tensor]:
    """Global allocation across layers and ranks: the single-process ``global_counts`` rule."""
    u = un[0]
    if len(set(un)) != 1:
        raise ValueError("global scope over layers with different unit sizes needs a channel pattern")
    already = [a for _, _, _, _, a, _ in layers]
    rankings = [r for *_, r in layers]
    spent = sum(pruned_units) * u
    k = max(int(round((budget - spent) / u)), 0)
    total_finite = int(comm.all_reduce_sum(torch.tensor(
        [sum(int(f.sum()) for f, s in zip(finite, specs) if s.counted or s.dim is not None)], dtype=torch.int64)))
    k = min(k, total_finite)
    # fast path: the k lowest remaining units over all layers, the caps ignored
    extra = _lowest(rankings, specs, comm, k, finite)
    counts = _counts(extra, specs, comm)
    if all(lo[i] <= pruned_units[i] + c <= hi[i] for i, c in enumerate(counts)):
        return [a | e for a, e in zip(already, extra)]
    # a cap binds: each layer first takes its `lo` lowest units, the rest goes to the lowest of the
    # units ranked below `hi` in their layer (exactly the single-process rule)
    base, cand = [], []
    for i, ((_, _, units, _, a, r), f) in enumerate(zip(layers, finite)):
        below_lo = a | _lowest([r], [units.spec], comm, max(lo[i] - pruned_units[i], 0), [f])[0]
        n_finite = int(comm.all_reduce_sum(torch.tensor([int(f.sum()) if units.spec.counted or units.spec.dim is not None
                                                          else 0], dtype=torch.int64)))
        below_hi = a | _lowest([r], [units.spec], comm, min(max(hi[i] - pruned_units[i], 0), n_finite), [f])[0]
        base.append(below_lo)
        cand.append(below_hi & ~below_lo & f)
    spent = sum(max(lo[i], pruned_units[i]) for i in range(len(layers))) * u
    n_cand = int(comm.all_reduce_sum(torch.tensor(
        [sum(int(c.sum()) for c, s in zip(cand, specs) if s.counted or s.dim is not None)], dtype=torch.int64)))
    k = min(max(int(round((budget - spent) / u)), 0), n_cand)
    extra = _lowest(rankings, specs, comm, k, cand)
    return [b | e for b, e in zip(base, extra)]


def _counts(picks: List[Tensor], specs: List[ShardSpec], comm: Any) -> List[int]:
    local = torch.tensor([int(p.sum()) if s.counted or s.dim is not None else 0 for p, s in zip(picks, specs)],
                         dtype=torch.int64)
    return comm.all_reduce_sum(local).tolist()
