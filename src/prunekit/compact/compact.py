"""``compact(model, example_inputs)``: masked whole channels -> smaller dense layers.

A unit (channel, head, group of a grouped conv) is removed when every layer that
*reads* it has zero weights for it (the masked model's output then does not depend
on it), so the compacted model computes what the masked model computes. Units whose
only readers are inside the unit itself (the query/key dims of a head) must be zero
everywhere. :func:`~prunekit.compact.prune_groups` writes masks of exactly this form.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import itertools
import logging
import os
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from .._backend import require_torch
from .. import reparam
from . import weights
from .proofs.dead import Fold, NonZero, dead_units, zero_units
from .errors import CompactionError
from .handlers import HandlerRegistry, ModuleHandler
from .trace.graph import DependencyGraph, Group, build_dependency_graph, check_graph, traced_dependency_graph
from .hf_config import apply_config
from .trace.inputs import flatten_output, split_inputs
from .surgery.journal import Journal, atomic, run_then_clean
from .surgery.rebuild import apply_plan, check_state_dict, load_state, plan_rebuild
from .trace.ops import tensors_in
from .surgery.shrink import retie, shrink_module, tied_parameters

logger = logging.getLogger(__name__)

__all__ = [
    "compact",
    "compaction_description",
    "load_compacted",
    "rebuild_from_description",
    "save_compacted",
    "zero_units",
]

FORMAT = "prunekit.compact/1"
_DESC_ATTR = "_prunekit_compaction"


def _mask_summary(model: nn.Module) -> Tuple[int, int, int]:
    n, zeros, total = 0, 0, 0
    for _, m, name in reparam.iter_masked(model):
        mask = getattr(m, name + "_mask")
        n += 1
        zeros += int((mask == 0).sum())
        total += mask.numel()
    return n, zeros, total


def compact(
    model: nn.Module,
    example_inputs: Any,
    *,
    ignored_layers: Optional[Sequence[Any]] = None,
    exact: bool = True,
    inplace: bool = False,
    graph: Optional[DependencyGraph] = None,
    check: bool = True,
    rtol: float = 1e-4,
    gqa: str = "groups",
) -> nn.Module:
    """Rebuild every layer whose whole channels/heads are masked with smaller dense layers.

    Returns a model whose output equals the masked model's output (up to float
    rounding). Masks left on the kept channels (unstructured sparsity) stay as masks.

    Args:
        model: a model pruned with whole-channel masks, e.g. by :func:`prune_groups`.
        example_inputs: a tensor, tuple of positional inputs, or dict of keyword inputs.
        ignored_layers: modules or names left exactly as they are (default: the final classifier).
        exact: see :func:`build_dependency_graph`.
        inplace: modify ``model`` itself instead of a deep copy. Failure-atomic: on any
            exception (``KeyboardInterrupt`` included) ``model`` is left exactly as it was.
        graph: a :func:`build_dependency_graph` result for ``model`` to reuse instead of
            tracing it again, e.g. the one passed to :func:`prune_groups` (its
            ``ignored_layers``/``exact`` apply).
        check: run the compacted model on ``example_inputs`` (in eval mode) and compare
            its outputs with the masked model's before returning it.
        rtol: the largest relative error (``||a - b|| / ||b||`` per output tensor) the
            check accepts. With ``exact=False`` (approximate pruning through a norm) the
            error is not a failure: it is reported in the description (``"approximate"``)
            and logged.
        gqa: see :func:`build_dependency_graph` (use the value the masks were made with).

    A Hugging Face model keeps its class; when its blocks all have the same sizes its
    ``config`` is updated to them (``save_pretrained``/``from_pretrained`` then work
    without prunekit), otherwise the description says why not (``"hf_config"``).

    Raises:
        ValueError: no whole channel is masked (e.g. only unstructured masks).
        TraceError: the model's forward failed on ``example_inputs``.
        CompactionError: the compacted model fails or its output differs from the masked
            model's (``model`` is unchanged; please report it with the model).

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> from prunekit.compact import prune_groups, compact
        >>> m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        >>> x = torch.randn(2, 8)
        >>> _ = prune_groups(m, x, 0.5)
        >>> small = compact(m, x)
        >>> small[0].out_features, torch.allclose(small(x), m(x), atol=1e-6)
        (8, True)
    """
    require_torch(model, "prunekit.compact")
    if not isinstance(model, nn.Module):
        raise TypeError(f"compact expects an nn.Module, got {type(model).__name__}")
    if isinstance(rtol, bool) or not isinstance(rtol, (int, float)) or not rtol >= 0:
        raise ValueError(f"rtol must be a number >= 0, got {rtol!r}")
    if graph is not None:
        check_graph(graph, model, ignored_layers)
    reference = None
    if check and graph is None and not _has_fastpath(model):
        # The reference (the masked model's outputs) comes from the forward pass that traces the
        # model: one forward pass less. Not for models with fused attention fast paths, which the
        # tracer turns off (the reference is the model's output as it runs).
        graph, out = traced_dependency_graph(model, example_inputs, ignored_layers=ignored_layers, exact=exact, gqa=gqa)
        reference = [t.detach() for t in tensors_in(flatten_output(out))]
        del out
    elif check:
        reference = _outputs(model, example_inputs)
    if not inplace:
        plan = memo = None
        if graph is not None:
            # plan on the model itself (read only), then copy it without the tensors the copy
            # replaces by sliced ones anyway: the copy holds the model's own objects there until
            # it drops them, and never writes into them
            plan = _plan(model, graph)
            memo = {id(t): t for t in _replaced_unchanged(model, graph, plan[0], plan[2])}
        target = copy.deepcopy(model, memo)
        g = None if graph is None else dataclasses.replace(graph, model=target)  # the graph names modules
        _compact_into(target, example_inputs, g, ignored_layers, exact, gqa, None, reference, rtol, plan)
        return target
    with atomic() as journal:
        _compact_into(model, example_inputs, graph, ignored_layers, exact, gqa, journal, reference, rtol)
        return model  # inside the block: an interrupt before the return rolls everything back


def _has_fastpath(model: nn.Module) -> bool:
    """Whether ``model`` holds modules whose inference fast path the tracer disables."""
    kinds = (nn.MultiheadAttention, nn.TransformerEncoderLayer, nn.TransformerEncoder)
    return any(isinstance(m, kinds) for m in model.modules())


def _compact_into(
    target: nn.Module,
    example_inputs: Any,
    g: Optional[DependencyGraph],
    ignored_layers: Optional[Sequence[Any]],
    exact: bool,
    gqa: str,
    journal: Optional[Journal],
    reference: Optional[List[Tensor]],
    rtol: float,
    plan: Optional[Tuple[Dict[str, Dict[str, Tensor]], int, List[Fold], List[Dict[str, Any]]]] = None,
) -> None:
    if g is None:
        g = build_dependency_graph(target, example_inputs, ignored_layers=ignored_layers, exact=exact, gqa=gqa)
    by_module, n_whole, folds, kept = _plan(target, g) if plan is None else plan
    if journal is not None:
        journal.module(target)
    _apply_folds(target, folds, journal)
    desc = dict(getattr(target, _DESC_ATTR, None) or {"format": FORMAT, "modules": {}})
    desc["modules"] = dict(desc.get("modules", {}))
    tied = tied_parameters(target)
    for mname, rem in by_module.items():
        entry = shrink_module(target, mname, g.handlers[mname], rem, journal)
        old = desc["modules"].get(mname)
        if old:
            merged_attrs = {**old.get("attrs", {}), **entry["attrs"]}
            merged_tensors = {**old.get("tensors", {}), **entry["tensors"]}
            entry = {**old, **entry, "attrs": merged_attrs, "tensors": merged_tensors}
        desc["modules"][mname] = entry
    retie(target, tied, journal)
    desc["kept"] = kept
    _update_hf_config(target, desc, journal)
    object.__setattr__(target, _DESC_ATTR, desc)
    if reference is not None:
        err = _check_outputs(target, example_inputs, reference, rtol, raise_above=g.options.get("exact", True))
        if not g.options.get("exact", True):
            desc["approximate"] = {"output_relative_error": err}
            logger.warning("compact: approximate compaction (exact=False): output relative error %.3g", err)
    logger.info("compact: removed %d units from %d modules", n_whole, len(by_module))


def _plan(target: nn.Module, g: DependencyGraph) -> Tuple[Dict[str, Dict[str, Tensor]], int, List[Fold], List[Dict[str, Any]]]:
    """Per module and slot, the sorted indices to remove; how many units go; the constants
    to fold into readers' biases; and a reason for every unit that is masked but stays."""
    nz = NonZero(g)
    removed: Dict[Tuple[str, str], List[Tensor]] = {}
    folds: List[Fold] = []
    kept: List[Dict[str, Any]] = []
    n_whole = n_partial = n_units = 0
    for gi, grp in enumerate(g.groups):
        verdict = dead_units(g, grp, nz)
        whole, partial = verdict.removable, verdict.partial
        n_partial += int((partial & ~whole).sum())
        if not grp.prunable:
            if bool((whole | partial).any()):
                logger.warning("compact: %d masked unit(s) left in place: %s", int((whole | partial).sum()), grp.blocked)
                kept.append(_kept_entry(grp, (whole | partial).nonzero().view(-1).tolist(), grp.blocked))
            continue
        n_units += grp.n_units
        if bool(whole.all()):
            logger.warning("compact: every unit of %r is masked; keeping one so the layers stay valid", grp)
            whole = whole.clone()
            whole[0] = False
            kept.append(_kept_entry(grp, [0], "every unit of its group is removable; one stays so the layers keep a channel"))
        if verdict.reasons:
            channels = _unit_channels(grp)
            kept.extend({"units": [u], "channels": channels(u), "reason": why or ""} for u, why in verdict.reasons.items())
        n_whole += int(whole.sum())
        index = grp.member_index()
        for key, (idx, unit_of) in index.items():
            removed.setdefault(key, []).append(idx[whole[unit_of]])
        for f in verdict.folds:
            idx, unit_of = index[(f.module, f.slot)]
            gone = torch.zeros(g.slots[(f.module, f.slot)].spec.size, dtype=torch.bool)
            gone[idx[whole[unit_of]]] = True
            mine = gone[f.index]
            if bool(mine.any()):
                folds.append(Fold(f.module, f.slot, f.index[mine], f.values[mine], f.rules))
    if n_whole == 0:
        raise ValueError(_nothing_to_remove(target, n_units, n_partial, kept))
    by_module: Dict[str, Dict[str, Tensor]] = {}
    for (mname, sname), parts in removed.items():
        idx = torch.cat(parts)
        if idx.numel():
            by_module.setdefault(mname, {})[sname] = torch.sort(idx).values
    return by_module, n_whole, folds, kept


def _kept_entry(grp: Group, units: List[int], reason: Optional[str]) -> Dict[str, Any]:
    index = grp.member_index()
    channels = {}
    for (mname, sname), (idx, unit_of) in index.items():
        mine = idx[torch.isin(unit_of, torch.tensor(units))]
        if mine.numel():
            channels[f"{mname}.{sname}" if mname else sname] = mine.tolist()
    return {"units": units, "channels": channels, "reason": reason or ""}


def _replaced_unchanged(
    model: nn.Module, g: DependencyGraph, by_module: Dict[str, Dict[str, Tensor]], folds: List[Fold]
) -> List[Tensor]:
    """The tensors of ``model`` that compacting a copy of it replaces without ever writing into them.

    Those :func:`~prunekit.compact.surgery.shrink_module` slices (their masks are baked after
    slicing) under a module whose handler builds no replacement; prunekit's own masks or none
    (``torch.nn.utils.prune``'s remove rewrites ``name_orig``); held by one module under one
    name only (a tied tensor stays tied in the copy); not a bias a constant is folded into.
    """
    held = collections.Counter(
        id(t) for m in model.modules() for t in itertools.chain(m._parameters.values(), m._buffers.values())
        if t is not None
    )
    folded = set()
    for f in folds:
        module = g.module(f.module)
        for _, _, _, bpath in f.rules:
            owner, leaf = reparam.owner_of(module, bpath)
            folded.add(id(reparam.stored(owner, leaf)))
    out: List[Tensor] = []
    for mname, removed in by_module.items():
        handler = g.handlers[mname]
        if type(handler).convert is not ModuleHandler.convert:
            continue
        module = g.module(mname)
        slots = handler.slots(module)
        for path in dict.fromkeys(e.path for sname in removed for e in slots[sname].entries):
            owner, leaf = reparam.owner_of(module, path)
            if "_flat_weights_names" in owner.__dict__:  # an RNN's flat weights alias its tensors
                continue
            if reparam.is_masked(owner, leaf):
                if leaf not in reparam.pruned_names(owner):
                    continue
                tensors = [t for t in (owner._parameters[leaf + "_orig"], owner._buffers[leaf + "_mask"]) if t is not None]
            else:
                t = owner._parameters.get(leaf, owner._buffers.get(leaf))
                tensors = [] if t is None else [t]
            out.extend(t for t in tensors if held[id(t)] == 1 and id(t) not in folded)
    return out


def _unit_channels(grp: Group) -> Callable[[int], Dict[str, List[int]]]:
    """``_kept_entry(grp, [u], ...)["channels"]`` for any single unit ``u``, from one pass over the group."""
    n = grp.n_units
    per_key = []
    for (mname, sname), (idx, unit_of) in grp.member_index().items():
        order = torch.argsort(unit_of, stable=True)  # a unit's indices stay in their order
        starts = [0, *itertools.accumulate(torch.bincount(unit_of, minlength=n).tolist())]
        per_key.append((f"{mname}.{sname}" if mname else sname, idx[order].tolist(), starts))

    def channels(u: int) -> Dict[str, List[int]]:
        return {key: vals[starts[u]:starts[u + 1]] for key, vals, starts in per_key if starts[u + 1] > starts[u]}

    return channels


def _apply_folds(target: nn.Module, folds: List[Fold], journal: Optional[Journal]) -> None:
    """Add what removed constant channels contributed to their readers' biases (before slicing)."""
    for f in folds:
        module = target.get_submodule(f.module) if f.module else target
        for wpath, in_axis, out_axis, bpath in f.rules:
            w = weights.effective(module, wpath).to(torch.float64)
            cols = w.index_select(in_axis, f.index)
            shape = [1] * cols.dim()
            shape[in_axis] = -1
            contrib = cols * f.values.view(shape)
            delta = contrib.sum(dim=[d for d in range(cols.dim()) if d != out_axis])
            owner, leaf = reparam.owner_of(module, bpath)
            bias = getattr(owner, leaf)
            if journal is not None:
                journal.tensor(bias)
            with torch.no_grad():
                bias.add_(delta.to(bias.dtype))
        logger.info("compact: folded %d constant channel(s) into the biases of '%s'", f.index.numel(), f.module)


def _nothing_to_remove(target: nn.Module, n_units: int, n_partial: int, kept: List[Dict[str, Any]]) -> str:
    n_masks, zeros, total = _mask_summary(target)
    if n_masks and zeros:
        msg = (
            f"compact() found 0 whole channels/heads to remove among {n_units} prunable units; "
            f"the model's {n_masks} masks zero {zeros} of {total} weights ({100.0 * zeros / max(total, 1):.1f}%) "
            "without emptying a whole channel in every layer that reads it. Compaction needs whole channels. "
        )
        if n_partial:
            first = next((k for k in kept if k["reason"]), None)
            msg += (
                f"{n_partial} units are zero in some layers but still read by others (e.g. ln_structured on one "
                "layer only)"
                + (f", e.g. {next(iter(first['channels']))} {first['channels'][next(iter(first['channels']))][:4]}: "
                   f"{first['reason']}" if first else "")
                + "; mask whole groups with prunekit.compact.prune_groups(model, example_inputs, amount). "
            )
        return msg + "For unstructured sparsity use the sparse-inference path instead: prunekit.sparsify_for_inference(model)."
    return (
        f"compact() found 0 whole channels/heads to remove among {n_units} prunable units: the model has no "
        "masked channels. Prune first, e.g. prunekit.compact.prune_groups(model, example_inputs, 0.5)."
    )


def _outputs(model: nn.Module, example_inputs: Any) -> List[Tensor]:
    """The model's output tensors on ``example_inputs``, in eval mode (training flags restored)."""
    args, kwargs = split_inputs(example_inputs)
    was = [(m, m.training) for m in model.modules()]

    def restore() -> None:  # idempotent: run again if an interrupt cuts it short
        for m, t in was:
            m.training = t

    def run() -> Any:
        model.eval()
        with torch.no_grad():
            return model(*args, **kwargs)

    out = run_then_clean(run, restore)
    return [t.detach() for t in tensors_in(flatten_output(out))]


def _update_hf_config(target: nn.Module, desc: Dict[str, Any], journal: Optional[Journal]) -> None:
    """Give a compacted Hugging Face model a config that matches its new shapes, when one can."""
    old = getattr(target, "config", None)
    if old is None or not hasattr(old, "model_type"):
        return
    reason = apply_config(target, journal)
    if reason:
        desc["hf_config"] = f"not updated: {reason}"
        logger.warning("compact: the model's config was not updated (%s); save it with save_compacted", reason)
        return
    desc["hf_config"] = "updated"


def _check_outputs(
    target: nn.Module, example_inputs: Any, reference: List[Tensor], rtol: float, raise_above: bool = True
) -> float:
    """The largest relative error of the compacted model's outputs; raises above ``rtol`` if asked."""
    try:
        got = _outputs(target, example_inputs)
    except Exception as exc:
        raise CompactionError(
            f"the compacted model fails on example_inputs ({type(exc).__name__}: {exc}); the masked model does not. "
            "Nothing was changed. This is a bug in a compaction handler: please report it with the model"
        ) from exc
    if len(got) != len(reference):
        raise CompactionError(f"the compacted model returns {len(got)} tensors, the masked model {len(reference)}")
    worst = 0.0
    for i, (a, b) in enumerate(zip(got, reference)):
        if a.shape != b.shape:
            raise CompactionError(
                f"output {i} of the compacted model has shape {tuple(a.shape)}, the masked model's {tuple(b.shape)}"
            )
        if not a.is_floating_point():
            ok = torch.equal(a, b)
            err = 0.0 if ok else float("inf")
        else:
            a64, b64 = a.double(), b.double()
            same_nan = torch.isnan(a64) == torch.isnan(b64)
            a64, b64 = torch.nan_to_num(a64), torch.nan_to_num(b64)
            err = float((a64 - b64).norm() / b64.norm().clamp_min(1e-30)) if bool(same_nan.all()) else float("inf")
            ok = err <= rtol or bool((a64 == b64).all())
        worst = max(worst, err)
        if not ok and raise_above:
            raise CompactionError(
                f"output {i} of the compacted model differs from the masked model's by {err:.3g} (relative, "
                f"allowed {rtol:g}); nothing was changed. Pass check=False to get the model anyway, or report it"
            )
    return worst


# ------------------------------------------------------------------ saving
def compaction_description(model: nn.Module) -> Dict[str, Any]:
    """The JSON-able description of a compacted model's new shapes.

    Examples:
        >>> import json, torch
        >>> from torch import nn
        >>> from prunekit.compact import prune_groups, compact, compaction_description
        >>> m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)); x = torch.randn(2, 8)
        >>> _ = prune_groups(m, x, 0.5)
        >>> json.dumps(compaction_description(compact(m, x))["modules"]["0"]["attrs"])
        '{"in_features": 8, "out_features": 8}'
    """
    desc = getattr(model, _DESC_ATTR, None)
    if desc is None:
        raise ValueError(f"{type(model).__name__} was not produced by prunekit.compact.compact(); it has no compaction description")
    return copy.deepcopy(desc)


def rebuild_from_description(
    model: nn.Module, description: Dict[str, Any], *, registry: Optional[HandlerRegistry] = None
) -> nn.Module:
    """Reshape a freshly built original model (in place) to a compacted model's shapes.

    The description is hostile input: every entry is checked against ``model`` first
    (:func:`prunekit.compact.surgery.rebuild.plan_rebuild`: only the sizes compaction changes,
    to values consistent with the new tensor shapes; only classes in
    :data:`prunekit.compact.modules.REPLACEMENTS` are instantiated, nothing is
    unpickled or imported by name), and nothing is allocated until all of it passed.
    All or nothing: on any failure (``KeyboardInterrupt`` included) ``model`` is exactly
    as it was. The new tensors hold zeros: load the state dict next, or use
    :func:`load_compacted`. ``registry``: the handler registry compaction used.

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> from prunekit.compact import prune_groups, compact, compaction_description, rebuild_from_description
        >>> make = lambda: nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        >>> m = make(); x = torch.randn(2, 8); _ = prune_groups(m, x, 0.5)
        >>> rebuild_from_description(make(), compaction_description(compact(m, x)))[2].weight.shape
        torch.Size([4, 8])
    """
    from ..io.compacted import check_description

    check_description(description)
    plan = plan_rebuild(model, description, registry=registry)
    with atomic() as journal:
        apply_plan(model, plan, journal)
        object.__setattr__(model, _DESC_ATTR, copy.deepcopy(description))
        return model  # inside the block: an interrupt before the return rolls everything back


def load_compacted(
    model: nn.Module,
    state_dict: Any,
    description: Optional[Dict[str, Any]] = None,
    *,
    require_checksum: bool = True,
    registry: Optional[HandlerRegistry] = None,
) -> nn.Module:
    """Rebuild ``model`` (a fresh instance of the original class) and load a compacted state dict.

    ``load_compacted(model, path)`` reads a file written by :func:`save_compacted`
    (checksum verified first; see :func:`prunekit.io.compacted.read_compacted` for
    ``require_checksum``); ``load_compacted(model, state_dict, description)`` takes them
    in memory. Every size in the description is checked against the state dict's
    shapes and the model, and every state-dict key and shape against the rebuilt
    model, before anything changes or is allocated; errors are
    :class:`~prunekit.io.compacted.CompactedModelError` (a ``ValueError``) naming the
    file. Masks present in the state dict (``name_orig``/``name_mask``) are re-applied
    through the pruning API. All or nothing: on any failure (``KeyboardInterrupt``
    included) ``model`` is exactly as it was; only the values of tensors whose shape
    does not change are kept aside meanwhile, never a copy of the model.

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> from prunekit.compact import prune_groups, compact, compaction_description, load_compacted
        >>> make = lambda: nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        >>> m = make(); x = torch.randn(2, 8); _ = prune_groups(m, x, 0.5); small = compact(m, x)
        >>> again = load_compacted(make(), small.state_dict(), compaction_description(small))
        >>> torch.equal(again(x), small(x))
        True
    """
    from ..io.compacted import check_description, check_sizes, read_compacted

    where = "compaction description"
    if description is None:
        if not isinstance(state_dict, (str, os.PathLike)):
            raise TypeError("load_compacted(model, path) or load_compacted(model, state_dict, description); "
                            f"got a {type(state_dict).__name__} and no description")
        path = os.fspath(state_dict)
        state_dict, description = read_compacted(path, require_checksum=require_checksum)
        where = f"{path}: description"
    check_description(description, where)
    if not isinstance(state_dict, Mapping) or not all(isinstance(v, Tensor) for v in state_dict.values()):
        raise TypeError(f"load_compacted: state_dict must map names to tensors, got {type(state_dict).__name__}")
    plan = plan_rebuild(model, description, where=where, registry=registry)
    check_sizes(description, {k: v.shape for k, v in state_dict.items()}, where)
    check_state_dict(model, plan, state_dict, where)
    with atomic() as journal:
        fresh = apply_plan(model, plan, journal)
        load_state(model, state_dict, journal, fresh)
        object.__setattr__(model, _DESC_ATTR, copy.deepcopy(description))
        return model  # inside the block: an interrupt before the return rolls everything back


def save_compacted(model: nn.Module, path: Any) -> None:
    """Save a plain state dict plus the description (loadable with ``torch.load(weights_only=True)``).

    Written by prunekit's atomic writer (a failed save leaves ``path`` as it was) and
    sealed with a SHA-256 checksum that :func:`load_compacted` verifies before it reads
    anything else (see ``docs/trust-compacted.md``).

    Examples:
        >>> import os, tempfile, torch
        >>> from torch import nn
        >>> from prunekit.compact import prune_groups, compact, save_compacted, load_compacted
        >>> make = lambda: nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        >>> m = make(); x = torch.randn(2, 8); _ = prune_groups(m, x, 0.5); small = compact(m, x)
        >>> path = os.path.join(tempfile.mkdtemp(), "small.pt"); save_compacted(small, path)
        >>> torch.equal(load_compacted(make(), path)(x), small(x))
        True
    """
    from ..io.compacted import write_compacted

    write_compacted(model.state_dict(), compaction_description(model), path)
