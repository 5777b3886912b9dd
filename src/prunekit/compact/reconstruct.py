"""Structured one-shot pruning from calibration data, with least-squares reconstruction.

:func:`prune_with_calibration` walks the prunable groups (heads, FFN neurons, channels)
in the order the model runs them. For each group it runs the calibration batches
through the model *as pruned so far* (stopping once the group's readers ran), and
gathers, for every reader layer (the ``Linear`` whose input columns the group's units
are), the second moment of its inputs. Then:

* **importance that sees activations**: each unit is scored by a scorer of the one
  importance registry (:mod:`prunekit.importance`, default ``"wanda"``: ``|W| * ||x||``)
  on the reader's columns, with the reader's input statistics;
* the lowest ``amount`` of units are masked in every tensor they span (as
  :func:`~prunekit.compact.prune_groups` does);
* **reconstruction**: every reader's remaining columns and bias are refitted by least
  squares to what the reader computed before the units went (FLAP/ZipLM-style):
  ``[W' b'] = [W b] G[:, K] (G[K, K] + damp)^-1`` with ``G`` the second moment of the
  reader's inputs augmented with a constant 1 and ``K`` the kept columns (and the bias).

The result is a masked model: :func:`~prunekit.compact.compact` then removes the units.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from .._backend import require_torch
from ..importance import ActivationStats, get_scorer
from ..kernels.lstsq import output_error, refit_columns
from . import weights
from .trace.graph import build_dependency_graph, check_graph
from .selection.importance import group_importance
from .trace.inputs import split_inputs
from .surgery.journal import atomic, run_then_clean
from .selection.prune import GroupDecision, keep_count, write_masks
from .trace.results import DependencyGraph, Group

logger = logging.getLogger(__name__)

__all__ = ["CalibrationReport", "ReaderFit", "prune_with_calibration"]


@dataclass
class ReaderFit:
    """One reader layer after its group's units went."""

    module: str
    kept: int  # input columns kept
    total: int
    error_before: float  # relative output error of the masked layer on the calibration inputs
    error_after: float  # the same after the least-squares refit (== error_before without reconstruction)


@dataclass
class CalibrationReport:
    """What :func:`prune_with_calibration` did."""

    decisions: List[GroupDecision] = field(default_factory=list)
    fits: List[ReaderFit] = field(default_factory=list)
    tokens: int = 0

    def __repr__(self) -> str:
        removed = sum(len(d.removed) for d in self.decisions)
        total = sum(d.total for d in self.decisions)
        err = [f.error_after for f in self.fits]
        mean = sum(err) / len(err) if err else 0.0
        return (f"CalibrationReport({removed} of {total} units removed in {len(self.decisions)} groups, "
                f"{len(self.fits)} readers refitted, mean relative output error {mean:.3g}, {self.tokens} tokens)")


class _Stop(Exception):
    """Raised once every reader of the current group has seen its input: the rest need not run."""


@dataclass
class _Reader:
    name: str  # qualified name of the reader Linear
    module: nn.Linear
    slot: Tuple[str, str]  # the graph slot whose "in" entry it is
    offset: int  # slot index i is column offset + i
    stats: ActivationStats = field(init=False, repr=False)  # set by _gather


def _readers(graph: DependencyGraph, group: Group) -> List[_Reader]:
    out = []
    for key in group.member_index():
        mname, _ = key
        for e in graph.slots[key].spec.entries:
            if e.role != "in":
                continue
            prefix, _, leaf = e.path.rpartition(".")
            sub = f"{mname}.{prefix}".strip(".") if prefix else mname
            module = graph.model.get_submodule(sub) if sub else graph.model
            if isinstance(module, nn.Linear) and leaf == "weight" and e.axis == 1:
                out.append(_Reader(sub, module, key, e.offset))
    return out


def _gather(model: nn.Module, batches: Sequence[Any], readers: List[_Reader], token_masks: List[Optional[Tensor]]) -> int:
    """Second moments of every reader's inputs (augmented with a 1) over the calibration batches."""
    seen: Dict[int, bool] = {}
    current: List[Optional[Tensor]] = [None]

    def hook(mod: nn.Module, args: Tuple[Any, ...]) -> None:
        r = by_id[id(mod)]
        x = args[0].detach()
        ones = torch.ones(x.shape[:-1] + (1,), dtype=x.dtype, device=x.device)
        r.stats.add(torch.cat([x, ones], dim=-1), token_mask=current[0])
        seen[id(mod)] = True
        if len(seen) == len(by_id):
            raise _Stop

    by_id = {}
    for r in readers:
        r.stats = ActivationStats(r.module.in_features + 1, hessian=True, dtype=torch.float64)
        by_id[id(r.module)] = r
    handles: List[Any] = []
    was = [(m, m.training) for m in model.modules()]

    def cleanup() -> None:  # idempotent: run again if an interrupt cuts it short
        while handles:
            handles[-1].remove()
            handles.pop()
        for m, t in was:
            m.training = t

    def run() -> None:
        for r in readers:
            handles.append(r.module.register_forward_pre_hook(hook))
        model.eval()
        with torch.no_grad():
            for batch, mask in zip(batches, token_masks):
                seen.clear()
                current[0] = mask
                args, kwargs = split_inputs(batch)
                try:
                    model(*args, **kwargs)
                except _Stop:
                    pass

    run_then_clean(run, cleanup)
    return readers[0].stats.count  # rows (tokens) the statistics saw, padding left out


def _stats_view(s: ActivationStats, n: int) -> ActivationStats:
    """The statistics of the first ``n`` features (the reader's real inputs, without the appended 1)."""
    v = ActivationStats(n)
    v.count = s.count
    v.sq_norm = s.sq_norm[:n].to(torch.float32)
    return v


def _scores(graph: DependencyGraph, group: Group, readers: List[_Reader], scorer: Any) -> Tensor:
    n = group.n_units
    index = group.member_index()
    total = torch.zeros(n)
    for r in readers:
        idx, unit_of = index[r.slot]
        w = weights.effective(r.module, "weight")
        part = scorer.unit_partial(w, 1, stats=_stats_view(r.stats, r.module.in_features))
        total.index_add_(0, unit_of, part[idx + r.offset].float())
    return scorer.unit_finalize(total)


def _refit(r: _Reader, w_before: Tensor, damp: float, reconstruct: bool) -> ReaderFit:
    """Least-squares refit of a reader's kept columns (and bias) to its output before masking."""
    m = r.module
    n = m.in_features
    g = r.stats.xtx / max(r.stats.count, 1)  # (n+1) x (n+1); the last row/column is the constant 1
    has_bias = m.bias is not None
    b = m.bias.detach().to(torch.float64) if has_bias else torch.zeros(m.out_features, dtype=torch.float64)
    a = torch.cat([w_before.to(torch.float64), b[:, None]], dim=1)  # the reader before: y = [W b] [x; 1]
    kept = ~_column_masked(m)
    masked = torch.cat([weights.effective(m, "weight").to(torch.float64), b[:, None]], dim=1)
    before = output_error(a, masked, g)
    cols = kept.nonzero().view(-1)
    if has_bias:
        cols = torch.cat([cols, torch.tensor([n])])
    if not reconstruct or cols.numel() == 0:
        return ReaderFit(r.name, int(kept.sum()), n, before, before)
    new = refit_columns(a, g, cols, damp)
    after = output_error(a, new, g)
    if after >= before:  # never worse than no refit
        return ReaderFit(r.name, int(kept.sum()), n, before, before)
    with torch.no_grad():
        target = _masks_orig(m)
        target.copy_(torch.where(kept[None, :], new[:, :n].to(target.dtype), target))
        if has_bias:
            m.bias.copy_(new[:, n].to(m.bias.dtype))
    return ReaderFit(r.name, int(kept.sum()), n, before, after)


def _masks_orig(m: nn.Linear) -> Tensor:
    """The stored weight (``weight_orig`` when masked): what the refit writes."""
    orig = m._parameters.get("weight_orig")
    return m.weight if orig is None else orig


def _column_masked(m: nn.Linear) -> Tensor:
    """Columns whose mask is all zero (never kept)."""
    mask = m._buffers.get("weight_mask")
    if mask is None:
        return torch.zeros(m.in_features, dtype=torch.bool)
    return ~(mask != 0).any(dim=0)


def _order(graph: DependencyGraph, groups: List[Group], readers: Dict[int, List[_Reader]]) -> List[int]:
    """Group indices by the first run of their readers (groups without a Linear reader last)."""
    order = {name: i for i, name in enumerate(graph.order)}

    def key(i: int) -> Tuple[int, int]:
        names = [r.slot[0] for r in readers[i]]
        return (min((order.get(n, 10**9) for n in names), default=10**9), i)
    return sorted(range(len(groups)), key=key)


def prune_with_calibration(
    model: nn.Module,
    calibration: Iterable[Any],
    amount: float,
    *,
    importance: str = "wanda",
    reconstruct: bool = True,
    example_inputs: Any = None,
    graph: Optional[DependencyGraph] = None,
    ignored_layers: Optional[Sequence[Any]] = None,
    round_to: Optional[int] = None,
    gqa: str = "groups",
    damp: float = 0.01,
) -> CalibrationReport:
    """Mask ``amount`` of every group's units chosen with calibration activations, and refit the readers.

    Args:
        model: the model (Hugging Face models included); changed in place (masks + refitted weights).
        calibration: batches the model accepts (tensors, tuples, or dicts of keyword inputs; a
            dict's 2-D ``attention_mask`` keeps padding out of the statistics).
        amount: fraction in [0, 1) of each group's units to remove (the same in every group of a size,
            so a compacted Hugging Face model keeps one config).
        importance: a scorer of :mod:`prunekit.importance` (``"wanda"`` by default; weight-only scorers
            such as ``"l1"`` work too and ignore the activations).
        reconstruct: refit the readers' kept columns and biases by least squares.
        example_inputs: what to trace the model with (default: the first calibration batch).
        damp: ridge term of the refit, relative to the mean diagonal of the inputs' second moment.

    Failure-atomic: on any exception (``KeyboardInterrupt`` included) the model is left as it was.

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> from prunekit.compact import compact, prune_with_calibration
        >>> torch.manual_seed(0); m = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))
        <torch._C.Generator object at ...>
        >>> cal = [torch.randn(64, 8) for _ in range(4)]
        >>> report = prune_with_calibration(m, cal, 0.5)
        >>> [(f.kept, f.total) for f in report.fits], compact(m, cal[0])[0].out_features
        ([(16, 32)], 16)
    """
    require_torch(model, "prunekit.compact.prune_with_calibration")
    if isinstance(amount, bool) or not isinstance(amount, (int, float)) or not 0.0 <= float(amount) < 1.0:
        raise ValueError(f"amount must be a float in [0, 1) (the fraction of units to remove), got {amount!r}")
    if not isinstance(damp, (int, float)) or damp < 0:
        raise ValueError(f"damp must be a number >= 0, got {damp!r}")
    scorer = get_scorer(importance)
    batches = list(calibration)
    if not batches:
        raise ValueError("calibration is empty: give at least one batch the model accepts")
    example = batches[0] if example_inputs is None else example_inputs
    masks = [b.get("attention_mask") if isinstance(b, dict) else None for b in batches]
    masks = [m if isinstance(m, Tensor) and m.dim() == 2 else None for m in masks]
    if graph is None:
        graph = build_dependency_graph(model, example, ignored_layers=ignored_layers, gqa=gqa)
    else:
        check_graph(graph, model, ignored_layers)
    groups = graph.prunable_groups()
    readers = {i: _readers(graph, g) for i, g in enumerate(groups)}
    if scorer.needs_calibration:
        bare = [g for i, g in enumerate(groups) if not readers[i]]
        if bare:
            raise ValueError(
                f"prune_with_calibration: importance {importance!r} scores units by the inputs of the nn.Linear "
                f"layers that read them, and {len(bare)} group(s) have no such reader (e.g. {bare[0]!r}; readers "
                "such as convolutions or GPT-2's Conv1D are not supported): pass ignored_layers=[...] for them, "
                "or a weight criterion such as importance='l1'"
            )
    report = CalibrationReport()
    with atomic() as journal:
        for m in model.modules():
            journal.module(m)
        for p in model.parameters():
            journal.tensor(p)
        for i in _order(graph, groups, readers):
            g, rs = groups[i], readers[i]
            if rs:
                report.tokens = _gather(model, batches, rs, masks)
            if rs and scorer.needs_calibration:
                scores = _scores(graph, g, rs, scorer)
            else:
                scores = group_importance(graph, g, importance)
            n = g.n_units
            keep = keep_count(n, int(round(amount * n)), g.unit_width, round_to)
            removed = sorted(torch.argsort(scores, stable=True)[: n - keep].tolist())
            decision = GroupDecision(g, removed, n)
            report.decisions.append(decision)
            if not removed:
                continue
            w_before = [weights.effective(r.module, "weight") for r in rs]
            write_masks(graph, [decision])
            for r, w in zip(rs, w_before):
                report.fits.append(_refit(r, w, damp, reconstruct))
        logger.info("prune_with_calibration: %r", report)
        return report  # inside the block: an interrupt before the return rolls everything back
