"""Module surgery: slice a module's tensors, update its attributes, or swap in a replacement.

Every change is recorded in a :class:`~prunekit.compact.surgery.journal.Journal` first when
one is given, so a failure can put the model back exactly as it was.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import Tensor, nn

from ... import methods, reparam
from ..handlers import ModuleHandler
from .journal import Journal

__all__ = ["replace_tensor", "retie", "set_attr", "shrink_module", "slice_tensor", "tied_parameters"]


def set_attr(module: nn.Module, path: str, value: Any) -> None:
    """``setattr`` along a dotted path (``"query.in_features"``)."""
    owner, leaf = reparam.owner_of(module, path)
    setattr(owner, leaf, value)


def replace_tensor(owner: nn.Module, leaf: str, new: Tensor) -> None:
    """Put a copy of ``new`` in place of ``owner.leaf``: a new Parameter (same ``requires_grad``) or buffer."""
    old = getattr(owner, leaf)
    if isinstance(old, nn.Parameter) or leaf in owner._parameters:
        owner._parameters[leaf] = nn.Parameter(new.detach().clone(), requires_grad=old.requires_grad)
    else:
        owner._buffers[leaf] = new.detach().clone()


def slice_tensor(t: Tensor, keep: Dict[int, Tensor]) -> Tensor:
    """``t`` restricted to the indices ``keep[axis]`` along each axis."""
    for axis, idx in keep.items():
        t = t.index_select(axis, idx.to(t.device))
    return t


def shrink_module(
    model: nn.Module, mname: str, handler: ModuleHandler, removed: Dict[str, Tensor], journal: Optional[Journal] = None
) -> Dict[str, Any]:
    """Slice one module's tensors; returns its entry of the compaction description.

    ``removed``: per slot name, the sorted indices that go. With a ``journal``, every
    module touched and every tensor changed in place is recorded first.
    """
    module = model.get_submodule(mname) if mname else model
    if journal is not None:
        journal.modules(module)
    slots = handler.slots(module)
    sizes = {s: spec.size - int(removed.get(s, torch.empty(0)).numel()) for s, spec in slots.items()}
    # which positions of which tensor go away
    drop: Dict[str, Dict[int, List[Tensor]]] = {}
    for sname, idx in removed.items():
        for e in slots[sname].entries:
            drop.setdefault(e.path, {}).setdefault(e.axis, []).append(idx + e.offset)
    # drop every mask under this module, remembering it, and bake it into the values. A tensor
    # that is sliced below is baked after slicing (same values: the bake is elementwise), on
    # the part that stays only, and never in place; a handler that builds a replacement module
    # reads the module's tensors, so those are all baked first, in place, as remove() does.
    lazy = type(handler).convert is ModuleHandler.convert
    masks: Dict[str, Tensor] = {}
    for sub_name, sub, name in list(reparam.iter_masked(module)):
        path = f"{sub_name}.{name}" if sub_name else name
        bake = not (lazy and path in drop)
        if bake and journal is not None:  # baking zeroes the masked entries of name_orig in place
            journal.tensor(reparam.stored(sub, name))
        masks[path] = reparam.unmask(sub, name, bake=bake)
    replacement = handler.convert(module, sizes)
    if replacement is not None:
        parent, leaf = reparam.owner_of(model, mname)
        if journal is not None:
            journal.module(parent)
        setattr(parent, leaf, replacement)
        module = replacement
    shapes: Dict[str, List[int]] = {}
    for path, axes in drop.items():
        owner, leaf = reparam.owner_of(module, path)
        t = getattr(owner, leaf)
        keep = {}
        for axis, parts in axes.items():
            gone = torch.zeros(t.shape[axis], dtype=torch.bool)
            gone[torch.cat(parts)] = True
            keep[axis] = (~gone).nonzero().flatten()
        new = slice_tensor(t.detach(), keep)
        if path in masks:
            masks[path] = slice_tensor(masks[path], keep)
            if lazy:
                new = reparam.masked(new, masks[path], inplace=True)  # a fresh tensor: index_select copies
        replace_tensor(owner, leaf, new)
        shapes[path] = list(getattr(owner, leaf).shape)
    attrs = handler.attrs(module, sizes)
    for path, value in attrs.items():
        set_attr(module, path, value)
    for path, mask in masks.items():
        if not bool((mask != 0).all()):
            owner, leaf = reparam.owner_of(module, path)
            methods.apply_mask(owner, leaf, mask)
    entry: Dict[str, Any] = {
        "attrs": {k: list(v) if isinstance(v, tuple) else v for k, v in attrs.items()},
        "tensors": shapes,
    }
    if replacement is not None:
        entry["class"] = type(replacement).__name__
        entry["init"] = getattr(replacement, "init_kwargs")()  # replacement classes say how to rebuild them
    return entry


def tied_parameters(model: nn.Module) -> List[List[Tuple[str, str]]]:
    """Every parameter held by more than one ``(module name, attribute)``: tied weights.

    Examples:
        >>> import torch
        >>> m = torch.nn.ModuleDict({"a": torch.nn.Linear(2, 2), "b": torch.nn.Linear(2, 2)})
        >>> m["b"].weight = m["a"].weight
        >>> tied_parameters(m)
        [[('a', 'weight'), ('b', 'weight')]]
    """
    owners: Dict[int, List[Tuple[str, str]]] = {}
    for mname, m in model.named_modules(remove_duplicate=False):
        for leaf, p in m._parameters.items():
            if p is not None and (mname, leaf) not in owners.setdefault(id(p), []):
                owners[id(p)].append((mname, leaf))
    return [places for places in owners.values() if len(places) > 1]


def retie(model: nn.Module, tied: List[List[Tuple[str, str]]], journal: Optional[Journal] = None) -> None:
    """Make parameters that were tied (``tied``, from :func:`tied_parameters` before surgery) one again.

    Each owner sliced its own copy; the copies must be equal (the same units went from each), and
    every owner then holds the first one, so the model keeps one tensor and training updates it once.

    Examples:
        >>> import torch
        >>> m = torch.nn.ModuleDict({"a": torch.nn.Linear(2, 2), "b": torch.nn.Linear(2, 2)})
        >>> m["b"].weight = m["a"].weight; tied = tied_parameters(m)
        >>> m["b"].weight = torch.nn.Parameter(m["a"].weight.detach().clone())
        >>> retie(m, tied); m["a"].weight is m["b"].weight
        True
    """
    for places in tied:
        found = [_held(model.get_submodule(mname) if mname else model, leaf) for mname, leaf in places]
        owners = [(owner, leaf) for owner, leaf in found if leaf is not None]
        if len(owners) < len(found):
            continue  # gone from a module (a handler built a replacement): nothing to tie
        first = owners[0][0]._parameters[owners[0][1]]
        if first is None:
            continue  # a parameter slot set to None: nothing to tie
        for owner, leaf in owners[1:]:
            other = owner._parameters[leaf]
            if other is first or other is None:
                continue
            if other.shape != first.shape or not torch.equal(other.detach(), first.detach()):
                names = ", ".join(f"{m}.{leaf}" if m else leaf for m, leaf in places)
                raise ValueError(f"prunekit.compact: the tied parameters {names} lost different entries "
                                 f"({tuple(first.shape)} vs {tuple(other.shape)}); they can no longer be one tensor")
            if journal is not None:
                journal.module(owner)
            owner._parameters[leaf] = first


def _held(owner: nn.Module, leaf: str) -> Tuple[nn.Module, Optional[str]]:
    """Where a parameter recorded as ``leaf`` is now: ``name_orig`` becomes ``name`` once its mask was baked."""
    if leaf in owner._parameters:
        return owner, leaf
    if leaf.endswith("_orig") and leaf[: -len("_orig")] in owner._parameters:
        return owner, leaf[: -len("_orig")]
    return owner, None
