"""From the solved union-find to units and groups (vectorized: a few sorts, no per-channel loops)."""

from __future__ import annotations

import itertools
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import Tensor

from .results import DependencyGraph, Group, _Runs
from .tracer import OUTPUT_REASON, Tracer

__all__ = ["collect", "default_final_layers", "read_values"]


def collect(tracer: Tracer, ignored: Tuple[str, ...]) -> DependencyGraph:
    """Units (components of slot ids) grouped by the slots they span and their blocked reason.

    Units are ordered by their smallest id and groups by their first unit, i.e. by the
    order in which the slots were first seen.
    """
    uf = tracer.uf
    roots = uf.solve()
    keys = list(tracer.slots)
    if not keys:
        return DependencyGraph(tracer.model, [], tracer.slots, tracer.handlers, ignored)
    r, slot_no, index = _members_by_root([tracer.slots[k] for k in keys], roots, uf.n)
    # runs of equal (root, slot): one member tensor each
    run_key = r * len(keys) + slot_no
    run_start = torch.ones_like(run_key, dtype=torch.bool)
    run_start[1:] = run_key[1:] != run_key[:-1]
    starts_at = run_start.nonzero().view(-1)
    run_len_t = torch.diff(torch.cat([starts_at, torch.tensor([run_key.numel()])]))
    run_root = r.index_select(0, starts_at)
    run_slot_t = slot_no.index_select(0, starts_at)
    # runs of equal root: one unit each
    unit_start = torch.ones_like(run_root, dtype=torch.bool)
    unit_start[1:] = run_root[1:] != run_root[:-1]
    first_run = unit_start.nonzero().view(-1)
    unit_of_run = torch.cumsum(unit_start, 0) - 1
    unit_root_t = run_root.index_select(0, first_run)
    n_runs = torch.diff(torch.cat([first_run, torch.tensor([run_root.numel()])]))
    reason_of_root, n_reasons = _reason_numbers(uf)
    sig_of_unit, first_of_sig = _signatures(
        len(keys), run_slot_t, first_run, unit_of_run, n_runs, reason_of_root.index_select(0, unit_root_t), n_reasons
    )
    # groups in the order of their first unit; units of a group in order
    n_sig = int(sig_of_unit.max()) + 1
    sig_order = torch.argsort(first_of_sig)
    rank = torch.empty_like(sig_order)
    rank[sig_order] = torch.arange(n_sig)
    unit_rank = rank.index_select(0, sig_of_unit)
    unit_order = torch.argsort(unit_rank, stable=True)
    per_group = torch.bincount(unit_rank, minlength=n_sig).tolist()
    runs = _runs_in_group_order(index, starts_at, run_len_t, first_run, n_runs, unit_order)
    run_slot = run_slot_t.tolist()
    first_units = first_of_sig.index_select(0, sig_order)
    unit_roots = unit_root_t.index_select(0, first_units).tolist()
    lo_of_first = first_run.index_select(0, first_units).tolist()
    runs_of_first = n_runs.index_select(0, first_units).tolist()
    groups: List[Group] = []
    pos = 0
    for gi, count in enumerate(per_group):
        lo0, k = lo_of_first[gi], runs_of_first[gi]
        # members in slot order, as the slots were first seen
        names = tuple(keys[i] for i in run_slot[lo0 : lo0 + k])
        # units are built on first access (Group.units): most callers need only member_index()
        groups.append(Group._lazy(tuple(sorted(names)), names, runs, pos, count, uf.blocked.get(unit_roots[gi])))
        pos += count * k
    return DependencyGraph(tracer.model, groups, tracer.slots, tracer.handlers, ignored)


def _members_by_root(infos: List[Any], roots: Tensor, n: int) -> Tuple[Tensor, Tensor, Tensor]:
    """Every slot id's ``(root, slot number, index in its slot)``, sorted by (root, slot, index):
    consecutive runs of equal root and slot are one unit's members in one slot."""
    starts = torch.tensor([i.start for i in infos])
    sizes = torch.tensor([i.spec.size for i in infos])
    if [i.start for i in infos] == list(itertools.accumulate([0] + [i.spec.size for i in infos[:-1]])):
        ids = torch.arange(int(sizes.sum()))  # slots own consecutive id ranges, in the order seen
    else:
        ids = torch.cat([torch.arange(i.start, i.start + i.spec.size) for i in infos])
    slot_no = torch.repeat_interleave(torch.arange(len(infos)), sizes)
    index = ids - torch.repeat_interleave(starts, sizes)  # position inside its slot
    r = roots.index_select(0, ids)
    # ``ids`` is in (slot, index) order already, so a stable sort by root alone gives the
    # (root, slot, index) order (2-3x cheaper than sorting keys)
    order = torch.argsort(r.to(torch.int32) if n < 2**31 else r, stable=True)  # int32 sorts faster
    return r.index_select(0, order), slot_no.index_select(0, order), index.index_select(0, order)


def _reason_numbers(uf: Any) -> Tuple[Tensor, int]:
    """Per id: the number of its component's blocked reason (in the order first recorded), -1 if none;
    and how many reasons there are."""
    reasons = list(dict.fromkeys(uf.blocked.values()))
    reason_of_root = torch.full((uf.n,), -1, dtype=torch.long)
    if uf.blocked:
        reason_no = {r: i for i, r in enumerate(reasons)}
        reason_of_root[torch.tensor(list(uf.blocked))] = torch.tensor([reason_no[r] for r in uf.blocked.values()])
    return reason_of_root, len(reasons)


def _signatures(
    n_keys: int, run_slot_t: Tensor, first_run: Tensor, unit_of_run: Tensor, n_runs: Tensor, unit_reason: Tensor,
    n_reasons: int,
) -> Tuple[Tensor, Tensor]:
    """Per unit, the number of its signature (its set of slots and its blocked reason); per
    signature, its first unit.

    Units are grouped by a random 63-bit hash of the slot set, then every group is checked
    exactly (no reliance on the hash being collision-free).
    """
    n_units = int(first_run.numel())
    weights = torch.randint(1, 2**62, (n_keys,), generator=torch.Generator().manual_seed(0))
    h = torch.zeros(n_units, dtype=torch.long).index_add_(0, unit_of_run, weights.index_select(0, run_slot_t))
    _, h_id = torch.unique(h, return_inverse=True)
    _, sig_of_unit = torch.unique(h_id * (n_reasons + 1) + unit_reason + 1, return_inverse=True)
    # exact check: same run count and the same slot sequence as the group's first unit
    first_of_sig = _first_unit(sig_of_unit, n_units)
    ref = first_of_sig.index_select(0, sig_of_unit)  # per unit: the first unit of its group
    exact = bool((n_runs == n_runs.index_select(0, ref)).all())
    if exact:
        # each run's counterpart in its group's first unit: the same position, counted from that unit's first run
        shift = (first_run.index_select(0, ref) - first_run).index_select(0, unit_of_run)
        exact = bool((run_slot_t == run_slot_t.index_select(0, torch.arange(run_slot_t.numel()) + shift)).all())
    if exact:
        return sig_of_unit, first_of_sig
    # a hash collision: signatures as tuples instead
    run_slot = run_slot_t.tolist()
    sig_keys: Dict[Tuple[Any, ...], int] = {}
    ids_list = [
        sig_keys.setdefault((tuple(run_slot[lo:hi]), r), len(sig_keys))
        for lo, hi, r in zip(first_run.tolist(), first_run.tolist()[1:] + [run_slot_t.numel()], unit_reason.tolist())
    ]
    sig_of_unit = torch.tensor(ids_list)
    return sig_of_unit, _first_unit(sig_of_unit, n_units)


def _first_unit(sig_of_unit: Tensor, n_units: int) -> Tensor:
    """Per signature number, the first unit that has it."""
    first = torch.full((int(sig_of_unit.max()) + 1,), n_units, dtype=torch.long)
    first.scatter_reduce_(0, sig_of_unit, torch.arange(n_units), reduce="amin")
    return first


def _runs_in_group_order(
    index: Tensor, starts_at: Tensor, run_len_t: Tensor, first_run: Tensor, n_runs: Tensor, unit_order: Tensor
) -> _Runs:
    """Every run's indices in one flat tensor, in group order (units of a group in order, a unit's runs
    in slot order), so each group's members are one contiguous stretch of runs."""
    runs_sorted = n_runs.index_select(0, unit_order)
    run_perm = torch.repeat_interleave(first_run.index_select(0, unit_order) - (torch.cumsum(runs_sorted, 0) - runs_sorted), runs_sorted)
    run_perm += torch.arange(run_perm.numel())
    lens = run_len_t.index_select(0, run_perm)
    if run_len_t.numel() == index.numel():  # every run is one id: runs and ids coincide
        return _Runs(index.index_select(0, run_perm), torch.arange(run_perm.numel()), lens, ones=True)
    before = torch.cumsum(lens, 0) - lens
    flat = index.index_select(0, torch.arange(index.numel()) - torch.repeat_interleave(before - starts_at.index_select(0, run_perm), lens))
    return _Runs(flat, before, lens, ones=False)


def default_final_layers(tracer: Tracer) -> List[str]:
    """The final classifier: the last-run weight layer whose outputs are model outputs on their own.

    "On their own" means its output channels are coupled to nothing else (no residual
    add), so a transformer block's last projection, which feeds a residual stream, is
    not mistaken for a classifier.
    """
    roots = tracer.uf.solve()
    blocked = tracer.uf.blocked
    order = {n: i for i, n in enumerate(tracer.order)}
    # the last-run candidate wins (the first one seen among equals): check the latest first
    infos = sorted(tracer.slots.values(), key=lambda info: -order.get(info.module_name, -1))
    for info in infos:
        mname = info.module_name
        if info.spec.role != "out" or not tracer.handlers[mname].classifier:
            continue
        if info.spec.size and blocked.get(int(roots[info.start])) != OUTPUT_REASON:
            continue  # cheap early reject: its first channel is not an output channel
        mine = roots[info.start : info.start + info.spec.size]
        uniq = set(mine.tolist())
        if len(uniq) != info.spec.size // max(info.spec.tie, 1):
            continue  # coupled with something else
        if not all(blocked.get(r) == OUTPUT_REASON for r in uniq):
            continue
        # alone: no id of any other slot shares a component with these outputs
        mark = torch.zeros(roots.numel(), dtype=torch.bool)
        mark[mine] = True
        hits = mark[roots]
        hits[info.start : info.start + info.spec.size] = False
        if not bool(hits.any()):
            return [mname]
    return []


def read_values(reads: List[Tuple[Tensor, Optional[Tensor]]], n: int) -> Optional[Tensor]:
    """Per channel id: the constant every read of it saw (NaN when unread, unknown or not the same
    in every read); None when no read saw a constant (the common, unmasked case)."""
    if not any(v is not None for _, v in reads):
        return None
    ids = torch.cat([i.reshape(-1) for i, _ in reads])
    vals = torch.cat([
        v.reshape(-1) if v is not None else torch.full((i.numel(),), float("nan"), dtype=torch.float64) for i, v in reads
    ])
    keep = ids >= 0
    ids, vals = ids[keep], vals[keep]
    nan = torch.isnan(vals)
    bad = torch.zeros(n, dtype=torch.bool).index_put_((ids,), nan, accumulate=True)
    clean = torch.nan_to_num(vals)
    lo = torch.full((n,), float("inf"), dtype=torch.float64).scatter_reduce(0, ids, clean, "amin")
    hi = torch.full((n,), -float("inf"), dtype=torch.float64).scatter_reduce(0, ids, clean, "amax")
    out = torch.full((n,), float("nan"), dtype=torch.float64)
    ok = (lo == hi) & ~bad
    out[ok] = lo[ok]
    return out
