"""``compact(model, example_inputs)``: masked whole channels -> smaller dense layers.

A unit (channel, head, group of a grouped conv) is removed when every layer that
*reads* it has zero weights for it (the masked model's output then does not depend
on it), so the compacted model computes what the masked model computes. Units whose
only readers are inside the unit itself (the query/key dims of a head) must be zero
everywhere. :func:`~prunekit.compact.prune_groups` writes masks of exactly this form.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from .._backend import require_torch
from . import _masks
from .graph import DependencyGraph, Group, build_dependency_graph, check_graph
from .modules import REPLACEMENTS

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


class _NonZero:
    """Cache: for (module, tensor path, axis), which indices have any non-zero value."""

    def __init__(self, graph: DependencyGraph) -> None:
        self.graph = graph
        self.cache: Dict[Tuple[str, str, int], Tensor] = {}

    def __call__(self, mname: str, path: str, axis: int) -> Tensor:
        key = (mname, path, axis)
        if key not in self.cache:
            owner, leaf = _masks.owner_of(self.graph.module(mname), path)
            t = _masks.effective(owner, leaf)
            self.cache[key] = (t != 0).movedim(axis, 0).reshape(t.shape[axis], -1).any(dim=1)
        return self.cache[key]


def _unit_states(graph: DependencyGraph, group: Group, nz: _NonZero) -> Tuple[Tensor, Tensor]:
    """Per unit of ``group``: (removable, partially zero), as bool tensors.

    A unit is removable when it is zero in every tensor that reads it (role ``"in"``);
    a unit no tensor reads (the query/key dims of a head) must be zero everywhere.
    Every unit of a group spans the same tensors, so "has readers" is per group.
    """
    n = len(group.units)
    readers_zero = torch.ones(n, dtype=torch.bool)
    others_zero = torch.ones(n, dtype=torch.bool)
    any_zero = torch.zeros(n, dtype=torch.bool)
    has_readers = has_others = False
    for mname, e, idx, unit_of in graph.entries(group):
        nonzero = torch.zeros(n, dtype=torch.long).index_add_(0, unit_of, nz(mname, e.path, e.axis)[idx].long())
        zero = nonzero == 0
        any_zero |= zero
        if e.role == "in":
            readers_zero &= zero
            has_readers = True
        else:
            others_zero &= zero
            has_others = True
    if has_readers:
        return readers_zero, any_zero
    return others_zero & has_others, any_zero


def zero_units(graph: DependencyGraph) -> Dict[int, List[int]]:
    """For each group index, the indices of its units that :func:`compact` would remove.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from prunekit.compact import build_dependency_graph, prune_groups, zero_units
        >>> m = nn.Sequential(nn.Linear(8, 4), nn.ReLU(), nn.Linear(4, 2))
        >>> with torch.no_grad():
        ...     m[2].weight[:, 1] = 0
        >>> zero_units(build_dependency_graph(m, torch.randn(1, 8)))
        {1: [1]}
    """
    nz = _NonZero(graph)
    out: Dict[int, List[int]] = {}
    for gi, g in enumerate(graph.groups):
        if not g.prunable:
            continue
        idx = _unit_states(graph, g, nz)[0].nonzero().view(-1).tolist()
        if idx:
            out[gi] = idx
    return out


def _set_attr(module: nn.Module, path: str, value: Any) -> None:
    owner, leaf = _masks.owner_of(module, path)
    setattr(owner, leaf, value)


def _replace_tensor(owner: nn.Module, leaf: str, new: Tensor) -> None:
    old = getattr(owner, leaf)
    if isinstance(old, nn.Parameter) or leaf in owner._parameters:
        owner._parameters[leaf] = nn.Parameter(new.detach().clone(), requires_grad=old.requires_grad)
    else:
        owner._buffers[leaf] = new.detach().clone()


def _slice(t: Tensor, keep: Dict[int, Tensor]) -> Tensor:
    for axis, idx in keep.items():
        t = t.index_select(axis, idx.to(t.device))
    return t


def _shrink_module(model: nn.Module, mname: str, handler: Any, removed: Dict[str, Tensor]) -> Dict[str, Any]:
    """Slice one module's tensors; returns its entry of the compaction description."""
    module = model.get_submodule(mname) if mname else model
    slots = handler.slots(module)
    sizes = {s: spec.size - int(removed.get(s, torch.empty(0)).numel()) for s, spec in slots.items()}
    # which positions of which tensor go away
    drop: Dict[str, Dict[int, List[Tensor]]] = {}
    for sname, idx in removed.items():
        for e in slots[sname].entries:
            drop.setdefault(e.path, {}).setdefault(e.axis, []).append(idx + e.offset)
    # bake every mask under this module, remembering it
    masks: Dict[str, Tensor] = {}
    for sub_name, sub, name in list(_masks.iter_masks(module)):
        masks[f"{sub_name}.{name}" if sub_name else name] = _masks.bake(sub, name)
    replacement = handler.convert(module, sizes)
    if replacement is not None:
        parent, leaf = _masks.owner_of(model, mname)
        setattr(parent, leaf, replacement)
        module = replacement
    shapes: Dict[str, List[int]] = {}
    for path, axes in drop.items():
        owner, leaf = _masks.owner_of(module, path)
        t = getattr(owner, leaf)
        keep = {}
        for axis, parts in axes.items():
            gone = torch.zeros(t.shape[axis], dtype=torch.bool)
            gone[torch.cat(parts)] = True
            keep[axis] = (~gone).nonzero().flatten()
        _replace_tensor(owner, leaf, _slice(t, keep))
        shapes[path] = list(getattr(owner, leaf).shape)
        if path in masks:
            masks[path] = _slice(masks[path], keep)
    attrs = handler.attrs(module, sizes)
    for path, value in attrs.items():
        _set_attr(module, path, value)
    for path, mask in masks.items():
        if not bool((mask != 0).all()):
            owner, leaf = _masks.owner_of(module, path)
            _masks.apply_mask(owner, leaf, mask)
    entry: Dict[str, Any] = {
        "attrs": {k: list(v) if isinstance(v, tuple) else v for k, v in attrs.items()},
        "tensors": shapes,
    }
    if replacement is not None:
        entry["class"] = type(replacement).__name__
        entry["init"] = replacement.init_kwargs()
    return entry


def _mask_summary(model: nn.Module) -> Tuple[int, int, int]:
    n, zeros, total = 0, 0, 0
    for _, m, name in _masks.iter_masks(model):
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
) -> nn.Module:
    """Rebuild every layer whose whole channels/heads are masked with smaller dense layers.

    Returns a model whose output equals the masked model's output (up to float
    rounding). Masks left on the kept channels (unstructured sparsity) stay as masks.

    Args:
        model: a model pruned with whole-channel masks, e.g. by :func:`prune_groups`.
        example_inputs: a tensor, tuple of positional inputs, or dict of keyword inputs.
        ignored_layers: modules or names left exactly as they are (default: the final classifier).
        exact: see :func:`build_dependency_graph`.
        inplace: modify ``model`` itself instead of a deep copy.
        graph: a :func:`build_dependency_graph` result for ``model`` to reuse instead of
            tracing it again, e.g. the one passed to :func:`prune_groups` (its
            ``ignored_layers``/``exact`` apply).

    Raises:
        ValueError: no whole channel is masked (e.g. only unstructured masks).
        TraceError: the model's forward failed on ``example_inputs``.

    Example:
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
    if graph is not None:
        check_graph(graph, model, ignored_layers)
    target = model if inplace else copy.deepcopy(model)
    if graph is None:
        g = build_dependency_graph(target, example_inputs, ignored_layers=ignored_layers, exact=exact)
    else:  # the graph names modules, so it describes the deep copy as well
        g = graph if inplace else dataclasses.replace(graph, model=target)
    nz = _NonZero(g)
    removed: Dict[Tuple[str, str], List[Tensor]] = {}
    n_whole = n_partial = n_units = 0
    for grp in g.groups:
        whole, partial = _unit_states(g, grp, nz)
        n_partial += int((partial & ~whole).sum())
        if not grp.prunable:
            if bool(whole.any()):
                logger.warning("compact: %d masked unit(s) left in place: %s", int(whole.sum()), grp.blocked)
            continue
        n_units += len(grp.units)
        if bool(whole.all()):
            logger.warning("compact: every unit of %r is masked; keeping one so the layers stay valid", grp)
            whole[0] = False
        n_whole += int(whole.sum())
        for key, (idx, unit_of) in grp.member_index().items():
            removed.setdefault(key, []).append(idx[whole[unit_of]])
    if n_whole == 0:
        n_masks, zeros, total = _mask_summary(target)
        if n_masks and zeros:
            msg = (
                f"compact() found 0 whole channels/heads to remove among {n_units} prunable units; "
                f"the model's {n_masks} masks zero {zeros} of {total} weights ({100.0 * zeros / max(total, 1):.1f}%) "
                "without emptying a whole channel in every layer that reads it. Compaction needs whole channels. "
            )
            if n_partial:
                msg += (
                    f"{n_partial} units are zero in some layers but still read by others (e.g. ln_structured on one "
                    "layer only); mask whole groups with prunekit.compact.prune_groups(model, example_inputs, amount). "
                )
            msg += "For unstructured sparsity use the sparse-inference path instead: prunekit.sparsify_for_inference(model)."
        else:
            msg = (
                f"compact() found 0 whole channels/heads to remove among {n_units} prunable units: the model has no "
                "masked channels. Prune first, e.g. prunekit.compact.prune_groups(model, example_inputs, 0.5)."
            )
        raise ValueError(msg)
    by_module: Dict[str, Dict[str, Tensor]] = {}
    for (mname, sname), parts in removed.items():
        idx = torch.cat(parts)
        if idx.numel():
            by_module.setdefault(mname, {})[sname] = torch.sort(idx).values
    desc = dict(getattr(target, _DESC_ATTR, None) or {"format": FORMAT, "modules": {}})
    desc["modules"] = dict(desc.get("modules", {}))
    for mname, rem in by_module.items():
        entry = _shrink_module(target, mname, g.handlers[mname], rem)
        old = desc["modules"].get(mname)
        if old:
            merged_attrs = {**old.get("attrs", {}), **entry["attrs"]}
            merged_tensors = {**old.get("tensors", {}), **entry["tensors"]}
            entry = {**old, **entry, "attrs": merged_attrs, "tensors": merged_tensors}
        desc["modules"][mname] = entry
    object.__setattr__(target, _DESC_ATTR, desc)
    logger.info("compact: removed %d units from %d modules", n_whole, len(by_module))
    return target


# ------------------------------------------------------------------ saving
def compaction_description(model: nn.Module) -> Dict[str, Any]:
    """The JSON-able description of a compacted model's new shapes.

    Example:
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


def rebuild_from_description(model: nn.Module, description: Dict[str, Any]) -> nn.Module:
    """Reshape a freshly built original model (in place) to a compacted model's shapes.

    Only classes in :data:`prunekit.compact.modules.REPLACEMENTS` are ever instantiated:
    no code is unpickled or imported by name. Every module name and class is checked
    before anything changes, so a description that does not fit leaves ``model`` as it was.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from prunekit.compact import prune_groups, compact, compaction_description, rebuild_from_description
        >>> make = lambda: nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        >>> m = make(); x = torch.randn(2, 8); _ = prune_groups(m, x, 0.5)
        >>> rebuild_from_description(make(), compaction_description(compact(m, x)))[2].weight.shape
        torch.Size([4, 8])
    """
    if not isinstance(description, dict) or description.get("format") != FORMAT:
        raise ValueError(f"not a compaction description (expected format {FORMAT!r}, got {description.get('format') if isinstance(description, dict) else type(description).__name__!r})")
    for mname, entry in description["modules"].items():
        try:
            model.get_submodule(mname) if mname else model
        except AttributeError:
            raise ValueError(f"the description names module {mname!r}, which {type(model).__name__} does not have; build the same model class as the one compacted") from None
        cls_name = entry.get("class")
        if cls_name and cls_name not in REPLACEMENTS:
            raise ValueError(f"description asks for class {cls_name!r} for module {mname!r}; only {sorted(REPLACEMENTS)} are allowed")
    for mname, entry in description["modules"].items():
        module = model.get_submodule(mname) if mname else model
        cls_name = entry.get("class")
        if cls_name:
            new = REPLACEMENTS[cls_name](**entry["init"])
            parent, leaf = _masks.owner_of(model, mname)
            setattr(parent, leaf, new)
            module = new
        for path, shape in entry.get("tensors", {}).items():
            owner, leaf = _masks.owner_of(module, path)
            old = getattr(owner, leaf)
            _replace_tensor(owner, leaf, torch.zeros(shape, dtype=old.dtype, device=old.device))
        for path, value in entry.get("attrs", {}).items():
            _set_attr(module, path, tuple(value) if isinstance(value, list) else value)
    object.__setattr__(model, _DESC_ATTR, copy.deepcopy(description))
    return model


def load_compacted(model: nn.Module, state_dict: Dict[str, Tensor], description: Dict[str, Any]) -> nn.Module:
    """Rebuild ``model`` (a fresh instance of the original class) and load a compacted state dict.

    Masks present in the state dict (``name_orig``/``name_mask``) are re-applied through the
    pruning API.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from prunekit.compact import prune_groups, compact, compaction_description, load_compacted
        >>> make = lambda: nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        >>> m = make(); x = torch.randn(2, 8); _ = prune_groups(m, x, 0.5); small = compact(m, x)
        >>> again = load_compacted(make(), small.state_dict(), compaction_description(small))
        >>> torch.equal(again(x), small(x))
        True
    """
    rebuild_from_description(model, description)
    for key in list(state_dict):
        if key.endswith("_mask") and key[: -len("_mask")] + "_orig" in state_dict:
            owner, leaf = _masks.owner_of(model, key[: -len("_mask")])
            _masks.apply_mask(owner, leaf, state_dict[key])
    model.load_state_dict(state_dict)
    return model


def save_compacted(model: nn.Module, path: Any) -> None:
    """Save a plain state dict plus the description (loadable with ``torch.load(weights_only=True)``).

    Example:
        >>> import io, torch
        >>> from torch import nn
        >>> from prunekit.compact import prune_groups, compact, save_compacted, load_compacted
        >>> make = lambda: nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        >>> m = make(); x = torch.randn(2, 8); _ = prune_groups(m, x, 0.5); small = compact(m, x)
        >>> buf = io.BytesIO(); save_compacted(small, buf); _ = buf.seek(0)
        >>> saved = torch.load(buf, weights_only=True)
        >>> torch.equal(load_compacted(make(), saved["state_dict"], saved["description"])(x), small(x))
        True
    """
    torch.save({"state_dict": model.state_dict(), "description": compaction_description(model)}, path)
