"""Exact k-smallest selection over tensors whose entries are spread over ranks.

The same selection as :func:`~prunekit.kernels.select.keep_mask_smallest_multi`
-- the ``k`` eligible entries of smallest magnitude, ties broken by position
(flat order, tensor after tensor) -- when every rank holds only a piece of
each tensor (a shard of a row-major tensor along one dimension, or a full
replica). No rank ever sees another rank's values; ranks exchange counts:

1. every rank buckets its entries by the top 16 IEEE bits of ``|x|`` (the
   single-process kernel's buckets), and one all-reduce sums the 2^15-bucket
   histograms (with the per-tensor NaN and eligible counts appended, so every
   rank sees the same totals and raises the same errors). The bucket holding
   the k-th smallest magnitude follows; entries below it are selected, above
   it kept, on every rank at once;
2. the entries of that one bucket are refined on the remaining bits of their
   *key* -- the low magnitude bits, then the tensor index and the entry's
   position in the global tensor -- 8 bits per round, one 256-bin all-reduce
   per round, until few candidates are left (usually one round);
3. those few candidates (key only: 16 bytes each) are gathered, and every
   rank picks the same boundary key ``K*``. An entry is selected exactly when
   its key is ``<= K*``.

Keys are unique, so exactly ``k`` entries are selected, and since the key
order is magnitude first and then (tensor, global position), the selection is
the single-process one entry for entry. Per rank, the communication is one
histogram (128 KiB, or 256 KiB beyond 2^31 entries) plus a few KiB, whatever
the tensors' sizes.

Ranks exchange tensors through a :class:`Communicator` (``all_reduce_sum``
and ``all_gather``); :mod:`prunekit.distributed` provides one over
``torch.distributed``. Every rank must call with the same tensors (same
global shapes, dtypes and order) and the same ``k``: the calls are
collective.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence, Tuple, Union

from torch import Tensor

from .._backend import TORCH, Backend, backend_of
from .sharded import Communicator, ShardSpec
from .select import _BUCKETS, NaNScoresError, _buckets, _common_dtype, _flat, _float_dtypes

__all__ = ["keep_mask_smallest_sharded", "CHUNK", "GATHER_LIMIT"]

#: candidates are gathered once at most this many are left across all ranks
GATHER_LIMIT = 256
#: entries bucketed at a time (the workspace: 2 bytes each, plus a boolean)
CHUNK = 1 << 18
_DIGIT_BITS = 8


def _magnitude_bits(values: Tensor, b: Backend) -> Tensor:
    """The IEEE bits of ``|values|`` as int64 (sign cleared; order equals the order of ``|x|``)."""
    size = values.element_size()
    if size == 8:
        return values.view(b.int64).bitwise_and(0x7FFF_FFFF_FFFF_FFFF)
    if size == 4:
        return values.view(b.ns.int32).to(b.int64).bitwise_and(0x7FFF_FFFF)
    return values.view(b.int16).to(b.int64).bitwise_and(0x7FFF)


def _digit_plan(low_bits: int, key_bits: int) -> List[Tuple[int, int, int]]:
    """``(field, shift, width)`` digits from the most significant: field 0 = low magnitude bits, 1 = key."""
    plan = []
    for field, bits in ((0, low_bits), (1, key_bits)):
        top = bits
        while top > 0:
            width = min(_DIGIT_BITS, top)
            plan.append((field, top - width, width))
            top -= width
    return plan


class _Candidates:
    """One tensor's entries in the threshold bucket: local positions and their two key fields."""

    __slots__ = ("pos", "low", "key", "counted")

    def __init__(self, pos: Tensor, low: Tensor, key: Tensor, counted: bool) -> None:
        self.pos, self.low, self.key, self.counted = pos, low, key, counted


def keep_mask_smallest_sharded(
    scores: Sequence[Tensor],
    specs: Sequence[ShardSpec],
    comm: Communicator,
    k: Union[int, Callable[[int], int]],
    eligible: Optional[Sequence[Optional[Tensor]]] = None,
) -> List[Tensor]:
    """Select exactly the ``k`` smallest-magnitude eligible entries of tensors spread over ranks.

    ``scores[i]`` is this rank's piece of tensor ``i`` and ``specs[i]`` where
    it sits; ``eligible[i]`` (or ``None``) restricts the choice as in the
    single-process kernel. ``k`` is a count, or a function of the number of
    eligible entries over all ranks (for amounts given as fractions). Returns
    one boolean tensor per local piece: ``False`` where the entry is selected.
    Collective: every rank calls it with pieces of the same tensors.

    Example (one rank, which holds every tensor whole):
        >>> import torch
        >>> class Alone:
        ...     rank, world = 0, 1
        ...     def all_reduce_sum(self, t): return t
        ...     def all_gather(self, t): return [t]
        >>> a, b = torch.tensor([0.1, -5.0]), torch.tensor([[2.0, -0.2], [0.3, 9.0]])
        >>> specs = [ShardSpec(tuple(a.shape)), ShardSpec(tuple(b.shape))]   # replicas
        >>> [m.tolist() for m in keep_mask_smallest_sharded([a, b], specs, Alone(), k=3)]
        [[False, True], [[True, False], [False, True]]]
    """
    if len(specs) != len(scores):
        raise ValueError(f"{len(scores)} score tensors but {len(specs)} shard specs")
    if not scores:
        raise ValueError("no tensors to select from")
    b = backend_of(scores[0]) or TORCH
    xp = b.ns
    n = len(scores)
    eligible = list(eligible) if eligible is not None else [None] * n
    for i, (s, spec) in enumerate(zip(scores, specs)):
        spec.check(tuple(s.shape), f"scores[{i}]")
    dtype = _common_dtype(scores, b)
    hist, nan, n_eligible = _histogram(scores, specs, eligible, dtype, comm, b)
    bad = nan.nonzero().reshape(-1)
    if bad.numel():
        i = int(bad[0])
        raise NaNScoresError(
            f"scores contain {int(nan[i])} NaN value(s); NaN has no magnitude order, so no exact count can be "
            "pruned. Replace them first (e.g. torch.nan_to_num) or pass importance_scores without NaN",
            i,
        )
    available = int(n_eligible.sum())
    k = k(available) if callable(k) else int(k)
    if not 0 <= k <= available:
        raise ValueError(f"cannot select k={k} entries out of {available}")
    if k == 0:
        return [xp.ones(tuple(s.shape), dtype=b.bool, device=s.device) for s in scores]
    cum = hist.cumsum(0)
    bucket = int(xp.searchsorted(cum, xp.tensor(k, dtype=cum.dtype, device=scores[0].device)))
    below = int(cum[bucket - 1]) if bucket > 0 else 0
    low_bits = 8 * _element_size(dtype, b) - 16
    pos_bits = max(spec.global_numel for spec in specs).bit_length()
    key_bits = (n - 1).bit_length() + pos_bits
    keeps, cands = _split_at_bucket(scores, specs, eligible, dtype, bucket, low_bits, pos_bits, b)
    boundary = _boundary_key(cands, comm, rank=k - below, live_total=int(hist[bucket]),
                             plan=_digit_plan(low_bits, key_bits), b=b)
    low_star, key_star = boundary
    for keep, c in zip(keeps, cands):
        if c.pos.numel():
            keep[c.pos] = (c.low > low_star) | ((c.low == low_star) & (c.key > key_star))
    return [keep.view(tuple(s.shape)) for keep, s in zip(keeps, scores)]


def _histogram(scores: Sequence[Tensor], specs: Sequence[ShardSpec], eligible: List[Optional[Tensor]], dtype: Any,
               comm: Communicator, b: Backend) -> Tuple[Tensor, Tensor, Tensor]:
    """Pass 1: the magnitude-bucket histogram over all ranks, and each tensor's NaN and eligible counts.

    One all-reduce for all of them. Entries are bucketed ``CHUNK`` at a time,
    so the workspace is a few hundred KiB whatever the shard's size.
    """
    xp, n, device = b.ns, len(scores), scores[0].device
    inf_bucket = _float_dtypes(b)[dtype]
    total = sum(spec.global_numel for spec in specs)
    count_dtype = b.ns.int32 if total < 2**31 else b.int64
    hist = xp.zeros(_BUCKETS, dtype=b.int64, device=device)
    nan = xp.zeros(n, dtype=b.int64, device=device)
    n_eligible = xp.zeros(n, dtype=b.int64, device=device)
    for i, (s, spec) in enumerate(zip(scores, specs)):
        if not spec.counted or s.numel() == 0:
            continue
        flat = _flat(s, dtype)
        e = eligible[i]
        elig = None if e is None else e.reshape(-1)
        inelig = 0 if elig is None else flat.numel() - int((elig != 0).sum())
        n_nan = -inelig
        for start in range(0, flat.numel(), CHUNK):
            part = flat[start:start + CHUNK]
            h = _buckets(part, None if elig is None else elig[start:start + CHUNK], b)
            counts = xp.bincount(h, minlength=_BUCKETS)
            n_nan += int(counts[inf_bucket + 1:].sum())
            if int(counts[inf_bucket]):
                n_nan += int(xp.isnan(part[h == inf_bucket]).sum())
            hist += counts
        nan[i] = n_nan
        n_eligible[i] = flat.numel() - inelig
    summed = comm.all_reduce_sum(xp.cat([hist, nan, n_eligible]).to(count_dtype)).to(b.int64)
    return summed[:_BUCKETS], summed[_BUCKETS:_BUCKETS + n], summed[_BUCKETS + n:]


def _split_at_bucket(scores: Sequence[Tensor], specs: Sequence[ShardSpec], eligible: List[Optional[Tensor]],
                     dtype: Any, bucket: int, low_bits: int, pos_bits: int,
                     b: Backend) -> Tuple[List[Tensor], List[_Candidates]]:
    """Pass 2: entries above ``bucket`` kept, below it selected; the bucket's entries become candidates."""
    xp, device = b.ns, scores[0].device
    keeps: List[Tensor] = []
    cands: List[_Candidates] = []
    for i, (s, spec) in enumerate(zip(scores, specs)):
        flat = _flat(s, dtype)
        e = eligible[i]
        elig = None if e is None else e.reshape(-1)
        keep = xp.empty(flat.numel(), dtype=b.bool, device=device)
        found = []
        for start in range(0, flat.numel(), CHUNK):
            h = _buckets(flat[start:start + CHUNK], None if elig is None else elig[start:start + CHUNK], b)
            xp.gt(h, bucket, out=keep[start:start + CHUNK])
            found.append((h == bucket).nonzero().reshape(-1) + start)
        pos = xp.cat(found) if found else xp.zeros(0, dtype=b.int64, device=device)
        low = _magnitude_bits(flat[pos], b).bitwise_and((1 << low_bits) - 1)
        key = spec.global_positions(pos) + (i << pos_bits)
        keeps.append(keep)
        cands.append(_Candidates(pos, low, key, spec.counted))
    return keeps, cands


def _element_size(dtype, b: Backend) -> int:
    return b.ns.empty((), dtype=dtype).element_size()


def _boundary_key(cands: List[_Candidates], comm: Communicator, rank: int, live_total: int,
                  plan: List[Tuple[int, int, int]], b: Backend) -> Tuple[int, int]:
    """The ``rank``-th smallest (low, key) among the counted candidates of every rank (1-based)."""
    xp = b.ns
    live = [(c.low, c.key) for c in cands if c.counted and c.pos.numel()]
    device = cands[0].pos.device
    chosen = [0, 0]
    for field, shift, width in plan:
        if live_total <= GATHER_LIMIT:
            break
        bins = 1 << width
        hist = xp.zeros(bins, dtype=b.int64, device=device)
        digits = []
        for pair in live:
            d = pair[field].bitwise_right_shift(shift).bitwise_and(bins - 1)
            digits.append(d)
            hist += xp.bincount(d, minlength=bins)
        hist = comm.all_reduce_sum(hist)
        cum = hist.cumsum(0)
        j = int(xp.searchsorted(cum, xp.tensor(rank, dtype=cum.dtype, device=device)))
        rank -= int(cum[j - 1]) if j > 0 else 0
        live_total = int(hist[j])
        chosen[field] |= j << shift
        live = [(lo[d == j], ke[d == j]) for (lo, ke), d in zip(live, digits)]
        live = [pair for pair in live if pair[0].numel()]
    else:
        return chosen[0], chosen[1]  # every digit resolved: the key itself
    # Few candidates left: gather their keys and rank them the same way on every rank.
    mine = (xp.cat([p[0] for p in live]) if live else xp.zeros(0, dtype=b.int64, device=device),
            xp.cat([p[1] for p in live]) if live else xp.zeros(0, dtype=b.int64, device=device))
    sizes = comm.all_gather(xp.tensor([mine[0].numel()], dtype=b.int64, device=device))
    most = max(int(s) for s in sizes)
    padded = xp.zeros((2, most), dtype=b.int64, device=device)
    padded[0, :mine[0].numel()] = mine[0]
    padded[1, :mine[1].numel()] = mine[1]
    parts = comm.all_gather(padded)
    low = xp.cat([p[0, :int(s)] for p, s in zip(parts, sizes)])
    key = xp.cat([p[1, :int(s)] for p, s in zip(parts, sizes)])
    order = xp.argsort(key, stable=True)
    order = order[xp.argsort(low[order], stable=True)]
    pick = int(order[rank - 1])
    return int(low[pick]), int(key[pick])
