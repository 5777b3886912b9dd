"""The built-in pruning methods on sharded tensors: the single-process decision, made across ranks.

Each function returns this rank's part of the new mask. What is exchanged:

* ``L1Unstructured`` (and ``global_unstructured`` with it): one histogram
  all-reduce and a few candidate keys (:mod:`prunekit.kernels.select_sharded`);
* ``LnStructured``: one norm per channel (:mod:`prunekit.kernels.norms_sharded`);
* ``RandomUnstructured`` / ``RandomStructured``: rank 0's generator state, then
  every rank draws the numbers one process would draw (for the whole tensor:
  a temporary of its size) and keeps its own part; with an earlier mask, one
  count per row says which draw belongs to which entry;
* ``CustomFromMask``, ``Identity``: nothing (a full-size mask is sliced).

Amount rules, rounding and error messages are the single-process ones, and
every rank reaches the same decision, so every rank raises the same error.
"""

from __future__ import annotations

import functools
from typing import Any, List, Optional, Sequence

import torch
from torch import Tensor

from ..kernels.amount import compute_nparams_to_prune, validate_pruning_amount
from ..kernels.norms_sharded import channel_norms_sharded
from ..kernels.select import select_lowest
from ..kernels.select_sharded import keep_mask_smallest_sharded
from ..kernels.sharded import gather_along, prefix_index
from .layout import Piece

__all__ = ["kind_of", "method_mask", "global_l1", "global_random"]

_KINDS = ("Identity", "L1Unstructured", "RandomUnstructured", "LnStructured", "RandomStructured", "CustomFromMask")


def _count(amount: Any, units: int) -> int:
    k = compute_nparams_to_prune(amount, units)
    validate_pruning_amount(k, units)
    return k


def kind_of(method: Any) -> Optional[str]:
    """Which built-in method's rule ``method`` follows (a subclass that keeps its ``compute_mask``
    counts), or ``None`` for a method with a rule of its own."""
    from .. import methods as builtin

    for name in _KINDS:
        cls = getattr(builtin, name)
        if isinstance(method, cls) and type(method).compute_mask is cls.compute_mask:
            if name == "L1Unstructured" and type(method)._combine_fast is not cls._combine_fast:
                return None
            return name
    return None


def _float_dtype(t: Tensor) -> torch.dtype:
    return t.dtype if t.is_floating_point() else torch.get_default_dtype()


def method_mask(method: Any, piece: Piece, scores: Tensor, existing: Optional[Tensor]) -> Tensor:
    """This rank's part of the mask ``method`` gives the whole tensor: 0/1 values, a tensor of its own
    (the weight's float dtype, or the given mask's for ``CustomFromMask``).

    ``scores``: the local part of what is ranked (importance scores, the
    weights, or for a structured method on a pruned tensor ``orig * mask``);
    ``existing``: the local part of the current mask, or ``None``.
    """
    kind = kind_of(method)
    local = piece.local
    fdt = _float_dtype(local)

    def default() -> Tensor:  # the current mask as a float tensor of its own (made only when needed)
        if existing is None:
            return torch.ones(local.shape, dtype=fdt, device=local.device)
        return existing.to(dtype=fdt, memory_format=torch.contiguous_format, copy=True)

    def with_keep(keep: Tensor) -> Tensor:
        return keep.to(fdt) if existing is None else existing.to(fdt) * keep

    if kind == "Identity":
        return default()
    if kind == "CustomFromMask":
        if method.mask is None:
            raise ValueError("this CustomFromMask was already applied; its mask lives in the module's name_mask buffer")
        from .layout import to_local_like

        given = to_local_like(method.mask, piece, "mask").to(local.device)
        if existing is not None:
            return existing.to(fdt) * given
        if getattr(method.mask, "_prunekit_owned", False) and given.is_contiguous():
            return given  # global_unstructured's own keep-mask: stored as it is, no copy
        return given.to(memory_format=torch.contiguous_format, copy=True)
    if kind == "L1Unstructured":
        eligible = None if existing is None else existing == 1
        scorer = getattr(method, "scorer", None)  # the importance registry's criterion (element-wise)
        ranked = scores if scorer is None else scorer.ranking_input(scores)
        keep = keep_mask_smallest_sharded([ranked], [piece.spec], piece.comm,
                                          lambda n: _count(method.amount, n), [eligible])[0]
        return with_keep(keep)
    if kind == "RandomUnstructured":
        return _random_unstructured(method, piece, existing, default())
    if kind in ("LnStructured", "RandomStructured"):
        return _structured(method, kind, piece, scores, existing, default())
    raise TypeError(
        f"{type(method).__name__} has no sharded implementation: prunekit.distributed prunes DTensor shards with "
        f"the built-in methods ({', '.join(_KINDS)}). Compute your mask and apply it with "
        "prunekit.custom_from_mask(module, name, mask) (a DTensor placed like the parameter, or a full-size tensor)"
    )


def _select_drawn(prob: Tensor, k: int) -> Tensor:
    """Which of the drawn numbers the single-process method selects (``topk`` of the draw)."""
    selected = torch.zeros(prob.numel(), dtype=torch.bool, device=prob.device)
    selected[torch.topk(prob.reshape(-1), k=k)[1]] = True
    return selected


def _random_unstructured(method: Any, piece: Piece, existing: Optional[Tensor], default: Tensor) -> Tensor:
    local, spec, comm = piece.local, piece.spec, piece.comm
    flat_default = default.reshape(-1)
    if existing is None:
        total = spec.global_numel
        k = _count(method.amount, total)
        if k == 0:
            return default
        comm.same_generator(local.device)
        prob = torch.rand(spec.global_shape, dtype=local.dtype, device=local.device)
        selected = _select_drawn(prob, k)
        del prob
        mine = selected[spec.global_positions(torch.arange(local.numel(), device=local.device))]
        flat_default[mine] = 0
        return default
    eligible = (existing == 1).reshape(-1)
    index, remaining = prefix_index(eligible, spec, comm)
    k = _count(method.amount, remaining)
    if k == 0:
        return default
    comm.same_generator(local.device)
    prob = torch.rand(remaining, dtype=local.dtype, device=local.device)
    selected = _select_drawn(prob, k)
    del prob
    positions = eligible.nonzero().reshape(-1)
    flat_default[positions[selected[index]]] = 0
    return default


def _channel_vector(values: Tensor, piece: Piece, dim: int, reduce_any: bool) -> Tensor:
    """A per-channel vector over every channel of the global tensor from this rank's per-channel values."""
    spec = piece.spec
    if spec.dim is None:
        return values
    if spec.dim == dim:
        return gather_along(values, spec, piece.comm)
    summed = piece.comm.all_reduce_sum(values.to(torch.int64) if reduce_any else values)
    return summed != 0 if reduce_any else summed


def _validate_structured(shape: Sequence[int], dim: Any) -> int:
    from ..methods import validate_structured as validate

    return validate(torch.empty(tuple(shape), device="meta"), dim)


def _structured(method: Any, kind: str, piece: Piece, scores: Tensor, existing: Optional[Tensor],
                default: Tensor) -> Tensor:
    spec = piece.spec
    dim = _validate_structured(spec.global_shape, method.dim)
    channels = spec.global_shape[dim]
    other = [d for d in range(len(spec.global_shape)) if d != dim]
    if existing is None:
        remaining = None
        n_remaining = channels
    else:
        local_any = (existing != 0).sum(other) != 0 if existing.numel() else torch.zeros(
            existing.shape[dim], dtype=torch.bool, device=existing.device)
        remaining = _channel_vector(local_any, piece, dim, reduce_any=True)
        n_remaining = int(remaining.sum())
    k = _count(method.amount, n_remaining)
    if k == 0:
        return default
    if kind == "RandomStructured":
        piece.comm.same_generator(torch.device("cpu"))
        prob = torch.rand(n_remaining)  # the CPU draw torch's method makes
        threshold = torch.kthvalue(prob, k)[0]
        keep_left = prob > threshold
    else:
        norms = channel_norms_sharded(scores, method.n, dim, spec, piece.comm)
        if remaining is not None:
            norms = norms[remaining.to(norms.device)]
        nan = norms.isnan()
        if bool(nan.any()):
            raise ValueError(
                f"{int(nan.sum())} channel norm(s) are NaN (NaN in the weights or scores); "
                "no channel order exists. Replace NaN first (e.g. torch.nan_to_num)"
            )
        keep_left = ~select_lowest(norms, k)  # the lowest norms, ties by position: as in one process
    keep = torch.ones(channels, dtype=torch.bool, device=keep_left.device)
    if remaining is None:
        keep = keep_left
    else:
        keep[remaining.to(keep.device).nonzero().reshape(-1)] = keep_left
    if spec.dim == dim:
        keep = keep[spec.offset:spec.offset + spec.length]
    shape = [1] * len(spec.global_shape)
    shape[dim] = -1
    return default * keep.to(default.device).view(shape)


# ----------------------------------------------------------------- global_unstructured
def global_l1(amount: Any, pieces: Sequence[Piece], scores: Sequence[Tensor],
              existing: Sequence[Optional[Tensor]]) -> List[Tensor]:
    """Keep-masks (boolean, local) of ``global_unstructured`` with ``L1Unstructured`` across ranks."""
    eligible = [None if m is None else (m == 1) for m in existing]
    return keep_mask_smallest_sharded(list(scores), [p.spec for p in pieces], pieces[0].comm,
                                      lambda n: _count(amount, n), eligible)


def global_random(amount: Any, pieces: Sequence[Piece], existing: Sequence[Optional[Tensor]],
                  dtypes: Sequence[torch.dtype]) -> List[Tensor]:
    """Keep-masks of ``global_unstructured`` with ``RandomUnstructured``: torch's one draw over the
    concatenation of every tensor's remaining entries, split back to each rank's entries."""
    comm = pieces[0].comm
    flags, index, offsets, total = [], [], [], 0
    for p, m in zip(pieces, existing):
        f = torch.ones(p.local.numel(), dtype=torch.bool, device=p.local.device) if m is None else (m == 1).reshape(-1)
        idx, n = prefix_index(f, p.spec, comm)
        flags.append(f)
        index.append(idx)
        offsets.append(total)
        total += n
    k = _count(amount, total)
    out = [torch.ones(tuple(p.local.shape), dtype=torch.bool, device=p.local.device) for p in pieces]
    if k == 0:
        return out
    device = pieces[0].local.device
    comm.same_generator(device)
    prob = torch.rand(total, dtype=functools.reduce(torch.promote_types, dtypes), device=device)
    selected = _select_drawn(prob, k)
    del prob
    for keep, f, idx, off in zip(out, flags, index, offsets):
        keep.view(-1)[f.nonzero().reshape(-1)[selected[off + idx]]] = False
    return out
