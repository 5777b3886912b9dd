"""``global_unstructured``: one ranking across many tensors.

torch concatenates every parameter (and every mask) into one vector, runs
``topk`` over it and stores per-tensor *views* of the concatenated mask in the
hooks — so each call keeps a full-size mask alive and needs about 13x the
weights' bytes at its peak. Here, for ``L1Unstructured``, the k-th smallest
magnitude is found across tensors by :func:`keep_mask_smallest_multi`, one
tensor at a time, and each module gets a mask of its own. Other unstructured
methods (``RandomUnstructured``, user methods) go through torch's
concatenation so that their results — and random draws — equal torch's; the
per-tensor masks are still copied out so nothing large is kept alive.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any, Dict, List, Optional, Tuple

from torch import Tensor, nn

from . import _sharded, reparam
from .reparam._internal import Snapshot, check_prunable
from ._backend import TORCH, FrameworkMismatchError, backend_of, is_module, is_tensor, same_backend
from .base import BasePruningMethod
from .base import PruningContainer
from .errors import PruningError
from .kernels.amount import compute_nparams_to_prune, validate_pruning_amount
from .kernels.select import NaNScoresError, keep_mask_smallest_multi
from .methods import CustomFromMask, L1Unstructured

__all__ = ["global_unstructured"]

log = logging.getLogger(__name__)


def _check_parameters(parameters: Any) -> List[Tuple[nn.Module, str]]:
    if not isinstance(parameters, Iterable) or isinstance(parameters, str) or is_module(parameters) or is_tensor(parameters):
        raise TypeError(
            "global_unstructured(): parameters must be an iterable of (module, name) tuples, e.g. "
            f"[(model.fc1, 'weight'), (model.fc2, 'weight')]; got {type(parameters).__name__}"
        )
    pairs = list(parameters)
    if not pairs:
        raise ValueError("global_unstructured(): parameters is empty; pass at least one (module, name) tuple")
    seen = set()
    for i, item in enumerate(pairs):
        if not (isinstance(item, tuple) and len(item) == 2 and is_module(item[0]) and isinstance(item[1], str)):
            raise TypeError(
                f"global_unstructured(): parameters[{i}] is {item!r}; each entry must be a "
                "(module, name) tuple such as (model.fc1, 'weight')"
            )
        key = (id(item[0]), item[1])
        if key in seen:
            raise ValueError(
                f"global_unstructured(): parameters[{i}] = ({reparam.describe(item[0])}, {item[1]!r}) appears twice; "
                "list each tensor once"
            )
        seen.add(key)
    b0 = backend_of(pairs[0][0])
    for i, (m, n) in enumerate(pairs):
        b = backend_of(m)
        if b is not b0 and b is not None and b0 is not None:  # every entry is a module: both are set
            raise FrameworkMismatchError(
                f"global_unstructured(): parameters[{i}] = ({reparam.describe(m)}, {n!r}) is a {b.name} "
                f"module but parameters[0] is a {b0.name} module; prune each framework's modules in its own call"
            )
    return pairs


def global_unstructured(
    parameters: Iterable[Tuple[nn.Module, str]],
    pruning_method: type,
    importance_scores: Optional[Dict[Tuple[nn.Module, str], Tensor]] = None,
    *,
    mask_dtype: Optional[Any] = None,
    **kwargs: Any,
) -> None:
    """Prune the tensors in ``parameters`` together, ranking all their entries at once.

    Args:
        parameters: ``(module, name)`` tuples.
        pruning_method: an unstructured method class, e.g. ``prunekit.L1Unstructured``.
        importance_scores: optional ``{(module, name): scores}``; scores replace the values in the ranking.
        mask_dtype: dtype of the stored masks (default: each weight's dtype; ``torch.bool`` is lean).
        **kwargs: the method's arguments, e.g. ``amount=0.8`` (a fraction of the still-unpruned entries).

    Raises:
        TypeError: ``parameters`` is not a list of ``(module, name)`` tuples, or the method is not unstructured.
        ValueError: bad amount, unknown tensor name, duplicated tensor, NaN among scores.

    Examples:
        >>> import torch, prunekit
        >>> net = torch.nn.Sequential(torch.nn.Linear(10, 4), torch.nn.Linear(4, 1))
        >>> prunekit.global_unstructured(
        ...     [(net[0], "weight"), (net[1], "weight")], pruning_method=prunekit.L1Unstructured, amount=10)
        >>> int(sum((b == 0).sum() for b in net.buffers()))
        10
    """
    pairs = _check_parameters(parameters)
    importance_scores = importance_scores if importance_scores is not None else {}
    if not isinstance(importance_scores, dict):
        raise TypeError("global_unstructured(): importance_scores must be a dict {(module, name): tensor}")
    if not (isinstance(pruning_method, type) and issubclass(pruning_method, BasePruningMethod)):
        raise TypeError(
            f"global_unstructured(): pruning_method must be a BasePruningMethod class such as "
            f"prunekit.L1Unstructured, got {pruning_method!r}"
        )
    method = pruning_method(**kwargs)
    if method.PRUNING_TYPE != "unstructured":
        raise TypeError(
            'Only "unstructured" PRUNING_TYPE supported for the `pruning_method`. '
            f"Found method {pruning_method} of type {method.PRUNING_TYPE}"
        )
    known = {(id(m), n) for m, n in pairs}
    for m, n in importance_scores:
        if (id(m), n) not in known:
            log.warning("global_unstructured(): importance_scores has an entry for %s.%s, which is not among "
                        "parameters; it is ignored", reparam.describe(m), n)

    origs, masks, scores = [], [], []
    for module, name in pairs:
        orig, pruned = check_prunable(module, name)
        s = importance_scores.get((module, name))
        if s is not None:
            same_backend(backend_of(orig) or TORCH, s, "importance_scores", f"global_unstructured(): {reparam.describe(module, name)}")
        if s is not None and (not is_tensor(s) or s.shape != orig.shape):
            got = tuple(s.shape) if is_tensor(s) else type(s).__name__
            raise PruningError(
                f"{reparam.describe(module, name)}: importance_scores has shape {got}, expected {tuple(orig.shape)}"
            )
        origs.append(orig)
        masks.append(module._buffers[name + "_mask"] if pruned else None)
        scores.append(s)

    sharded = _sharded.handler_for(*origs)
    for (module, name), orig in zip(pairs, origs):
        if _sharded.handler_for(orig) is None:
            _sharded.check_plain(orig, module, name)
    with (backend_of(origs[0]) or TORCH).no_grad():
        if sharded is not None:  # DTensor shards among them: one selection across ranks (prunekit.distributed)
            new_masks = sharded.global_masks(method, pairs, origs, masks, scores)
        elif type(method) is L1Unstructured or (
            isinstance(method, L1Unstructured) and type(method).compute_mask is L1Unstructured.compute_mask
        ):
            new_masks = _l1_masks(method, pairs, origs, masks, scores)
        else:
            new_masks = _generic_masks(method, pairs, origs, masks, scores)

    snapshots = [Snapshot(m) for m, _ in pairs]
    try:
        for i, (module, name) in enumerate(pairs):
            mask, new_masks[i] = new_masks[i], None  # freed as soon as it is stored: a low peak
            CustomFromMask.apply(module, name, mask=mask, mask_dtype=mask_dtype)
            del mask
    except BaseException:
        for snap in reversed(snapshots):
            snap.restore()
        raise


def _l1_masks(method: L1Unstructured, pairs, origs, masks, scores) -> List[Tensor]:
    eligible = [None if m is None else (m == 1) for m in masks]
    remaining = sum(o.numel() if e is None else int(e.sum()) for o, e in zip(origs, eligible))
    k = compute_nparams_to_prune(method.amount, remaining)
    try:
        validate_pruning_amount(k, remaining)
        keeps = keep_mask_smallest_multi(
            [s if s is not None else o.detach() for s, o in zip(scores, origs)], k, eligible
        )
    except NaNScoresError as e:
        module, name = pairs[e.index]
        raise ValueError(f"global_unstructured(): {reparam.describe(module, name)}: {e}") from None
    except ValueError as e:
        raise type(e)(f"global_unstructured() over {len(pairs)} tensors: {e}") from None
    return keeps


def _generic_masks(method: BasePruningMethod, pairs, origs, masks, scores) -> List[Tensor]:
    # torch's own procedure (concatenate, run the container), for methods
    # whose results must match torch's draw for draw.
    b = backend_of(origs[0]) or TORCH
    flat_scores = b.ns.cat([
        (s if s is not None else (o.detach() if m is None else o.detach() * m)).reshape(-1)
        for s, o, m in zip(scores, origs, masks)
    ])
    flat_default = b.ns.cat([
        (b.ns.ones_like(o) if m is None else m.to(o.dtype)).reshape(-1) for o, m in zip(origs, masks)
    ])
    container = PruningContainer()
    container._tensor_name = "temp"
    method._tensor_name = "temp"
    container.add_pruning_method(method)
    try:
        final = container.compute_mask(flat_scores, flat_default)
    except ValueError as e:
        raise type(e)(f"global_unstructured() over {len(pairs)} tensors: {e}") from None
    out, pointer = [], 0
    for o in origs:
        out.append(final[pointer:pointer + o.numel()].view(o.shape).clone())  # own memory, not a view
        pointer += o.numel()
    return out
