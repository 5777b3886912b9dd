"""Rebuild a compacted model from its description: check every entry first, then apply with an undo log.

A description usually comes from a file, so it is hostile input. :func:`plan_rebuild`
checks all of it against the model without changing or allocating anything:

* every module it names exists; a replacement class is one of
  :data:`~prunekit.compact.modules.REPLACEMENTS`, put in place of an instance of the
  class it derives from, with constructor arguments that are plain values within the
  original module's sizes (it is built on the ``meta`` device to learn its shapes);
* a tensor path names a parameter or buffer that the module's compaction handler
  slices; its new shape has the same rank, no dimension larger than now, and the
  axes compaction never slices unchanged;
* an attribute path names an attribute the module's handler sets (``in_features``,
  ``num_heads``, ...: the keys of :meth:`~prunekit.compact.ModuleHandler.attrs`),
  holding an int (or a tuple of ints) now; the new value has that type, is no
  larger, and equals what the handler computes from the new tensor shapes wherever
  those shapes determine it;
* the layers' own invariants hold afterwards (a Linear's ``in_features`` and
  ``out_features`` are its weight's shape, a convolution's channels divide by its
  groups, ...).

:func:`apply_plan` then makes the changes with every module recorded in a
:class:`~prunekit.compact.surgery.journal.Journal` first (references only, no tensor is
copied), so a failure -- ``KeyboardInterrupt`` included -- puts the model back.
:func:`check_state_dict` and :func:`load_state` do the same for the state dict that
:func:`~prunekit.compact.load_compacted` loads into the rebuilt model.
"""

from __future__ import annotations

import inspect
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Set, Tuple

import torch
from torch import Tensor, nn

from ... import methods, reparam
from ...io.compacted import CompactedModelError
from .consistency import (
    Inconsistent,
    check_layer,
    check_size_value,
    current_shape,
    expected_attrs,
    plain,
    resolve,
    tensor_of,
)
from ..handlers import REGISTRY, HandlerRegistry
from .journal import Journal
from ..modules import REPLACEMENTS, PrunedMultiheadAttention

__all__ = ["INIT_CHECKS", "INIT_FROM_TENSORS", "RebuildPlan", "apply_plan", "check_state_dict", "load_state",
           "plan_rebuild"]

_Key = Tuple[int, str]  # (id of the owning module, leaf name)


@dataclass
class _Step:
    name: str
    replacement: Optional[type] = None
    init: Dict[str, Any] = field(default_factory=dict)
    meta: Optional[nn.Module] = None  # the replacement built on the meta device
    tensors: List[Tuple[str, Tuple[int, ...]]] = field(default_factory=list)
    attrs: List[Tuple[str, Any]] = field(default_factory=list)


@dataclass
class RebuildPlan:
    """What a checked description changes: one step per module, in the description's order."""

    steps: List[_Step]
    new_shapes: Dict[int, Tuple[int, ...]]  # id of a tensor of the model -> its shape after the rebuild


class _Missing(Inconsistent):
    """The description names a module the model does not have (the message names it)."""


# ----------------------------------------------------------------------------- replacements
def _check_mha_init(original: nn.Module, init: Dict[str, Any]) -> None:
    """PrunedMultiheadAttention: only the sizes compaction shrinks may differ from the original's."""
    if not isinstance(original, nn.MultiheadAttention):  # pragma: no cover - checked by the caller
        raise Inconsistent("PrunedMultiheadAttention replaces an nn.MultiheadAttention")
    limits = {"embed_dim": original.embed_dim, "num_heads": original.num_heads,
              "embed_out": original.out_proj.out_features}
    for k, top in limits.items():
        v = init.get(k)
        if type(v) is not int or not 0 <= v <= top:
            raise Inconsistent(f"init {k!r} must be an int in [0, {top}] (the original's), got {v!r}")
    same = {"head_dim": original.head_dim, "bias": original.in_proj_bias is not None,
            "dropout": original.dropout, "batch_first": original.batch_first}
    for k, want in same.items():
        v = init.get(k)
        if type(v) is not type(want) or v != want:
            raise Inconsistent(f"init {k!r} must be {want!r} (compaction never changes it), got {v!r}")


def _mha_init_from_tensors(init: Dict[str, Any], tensors: Mapping[str, Any]) -> Dict[str, Any]:
    """``embed_out`` is the rows of ``out_proj.weight``: compaction records the unpruned width there when
    it prunes the attention's outputs (its ``out_proj`` keeps its old ``out_features``)."""
    w = tensors.get("out_proj.weight")
    if isinstance(w, (list, tuple)) and len(w) == 2 and "embed_out" in init:
        return {**init, "embed_out": w[0]}
    return init


#: per replacement class, the check of its constructor arguments against the module it replaces
INIT_CHECKS: Dict[type, Callable[[nn.Module, Dict[str, Any]], None]] = {PrunedMultiheadAttention: _check_mha_init}
#: per replacement class, the constructor arguments that the described tensor shapes decide
INIT_FROM_TENSORS: Dict[type, Callable[[Dict[str, Any], Mapping[str, Any]], Dict[str, Any]]] = {
    PrunedMultiheadAttention: _mha_init_from_tensors}


def _numel(module: nn.Module) -> int:
    return sum(t.numel() for t in list(module.parameters()) + list(module.buffers()))


def _replacement(original: nn.Module, name: str, cls_name: str, init: Dict[str, Any], tensors: Mapping[str, Any]
                 ) -> Tuple[type, Dict[str, Any], nn.Module]:
    """The class, the constructor arguments and a ``meta``-device instance of a checked replacement."""
    cls = REPLACEMENTS.get(cls_name)
    if cls is None:
        raise Inconsistent(f"class {cls_name!r} is not one compaction puts in a model; only {sorted(REPLACEMENTS)} are")
    if not name:
        raise Inconsistent("the root module is never replaced")
    base = cls.__mro__[1]
    if not isinstance(original, base):
        raise Inconsistent(f"{cls_name} replaces an {base.__name__}, and the model's module is a {type(original).__name__}; "
                   "build the same model class as the one compacted")
    params = inspect.signature(cls).parameters
    named = {n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)} - {"device", "dtype"}
    unknown = sorted(set(init) - named)
    required = sorted(n for n in named if params[n].default is inspect.Parameter.empty and n not in init)
    if unknown or required:
        raise Inconsistent(f"init of {cls_name} takes {sorted(named)}; unknown {unknown}, missing {required}")
    init = INIT_FROM_TENSORS.get(cls, lambda i, t: i)(dict(init), tensors)
    check = INIT_CHECKS.get(cls)
    if check is None:
        raise Inconsistent(f"class {cls_name} has no check of its constructor arguments in "
                   "prunekit.compact.surgery.rebuild.INIT_CHECKS; add one to load it")
    check(original, init)
    try:
        with torch.device("meta"), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # e.g. "Initializing zero-element tensors is a no-op"
            meta = cls(**init)
    except Exception as e:
        raise Inconsistent(f"init {init!r} does not build a {cls_name} ({type(e).__name__}: {e})") from None
    if _numel(meta) > _numel(original):
        raise Inconsistent(f"init {init!r} asks for {_numel(meta)} elements, more than the {_numel(original)} of the module "
                   "it replaces (compaction only removes)")
    return cls, init, meta


class _Planner:
    def __init__(self, model: nn.Module, registry: HandlerRegistry) -> None:
        self.model = model
        self.registry = registry
        self.new_shapes: Dict[_Key, Tuple[int, ...]] = {}
        self.new_attrs: Dict[_Key, Any] = {}
        self.owners: Dict[int, nn.Module] = {}
        self.tensor_ids: Dict[int, Tuple[int, ...]] = {}

    def shape(self, owner: nn.Module, leaf: str) -> Optional[Tuple[int, ...]]:
        got = self.new_shapes.get((id(owner), leaf))
        if got is not None:
            return got
        t = tensor_of(owner, leaf)
        return None if t is None else tuple(t.shape)

    def attr(self, owner: nn.Module, leaf: str) -> Any:
        key = (id(owner), leaf)
        return self.new_attrs[key] if key in self.new_attrs else getattr(owner, leaf, None)

    def entry(self, mname: str, entry: Mapping[str, Any]) -> _Step:
        try:
            original = self.model.get_submodule(mname) if mname else self.model
        except AttributeError:
            raise _Missing(f"the description names module {mname!r}, which {type(self.model).__name__} does not "
                           "have; build the same model class as the one compacted") from None
        step = _Step(mname)
        module = original
        if entry.get("class"):
            step.replacement, step.init, step.meta = _replacement(original, mname, entry["class"],
                                                                  entry.get("init", {}), entry.get("tensors", {}))
            module = step.meta
        elif entry.get("init"):
            raise Inconsistent("'init' is given without 'class'")
        tensors, attrs = entry.get("tensors", {}), entry.get("attrs", {})
        if not tensors and not attrs:
            return step
        handler = self.registry.lookup(module)
        if handler is None:
            raise Inconsistent(f"compaction has no handler for {type(module).__name__}, so it never changes one")
        try:
            slots = handler.slots(module)
            allowed = handler.attrs(module, {s: spec.size for s, spec in slots.items()})
        except Exception as e:
            raise Inconsistent(f"its compaction handler {type(handler).__name__} fails on it ({type(e).__name__}: {e})") from None
        axes: Dict[str, Set[int]] = {}
        for spec in slots.values():
            for slot_entry in spec.entries:
                axes.setdefault(slot_entry.path, set()).add(slot_entry.axis)
        described: Dict[str, Tuple[int, ...]] = {}
        for path, shape in tensors.items():
            owner, leaf = resolve(module, path)
            t = tensor_of(owner, leaf)
            if t is None:
                raise Inconsistent(f"{type(owner).__name__} has no parameter or buffer {leaf!r} (path {path!r}); "
                           "rebuild a freshly built, unpruned model")
            shape = tuple(shape)
            if step.meta is not None:
                if shape != tuple(t.shape):
                    raise Inconsistent(f"tensor {path!r}: the description says {list(shape)}, its init builds {list(t.shape)}")
            else:
                if path not in axes:
                    raise Inconsistent(f"tensor {path!r}: compaction never changes it in a {type(module).__name__}")
                if len(shape) != t.dim() or any(s > c for s, c in zip(shape, t.shape)) or any(
                        s != c for i, (s, c) in enumerate(zip(shape, t.shape)) if i not in axes[path]):
                    raise Inconsistent(f"tensor {path!r} is {list(t.shape)}: compaction only shrinks axes "
                               f"{sorted(axes[path])} of it, and the description says {list(shape)}")
            self._claim(self.new_shapes, owner, leaf, shape, f"tensor {path!r}")
            self.tensor_ids[id(t)] = shape
            described[path] = shape
            step.tensors.append((path, shape))

        def shape_of(path: str) -> Optional[Tuple[int, ...]]:
            return described.get(path, current_shape(module, path))

        try:
            expected, exact = expected_attrs(handler, module, shape_of)
        except Inconsistent:
            raise
        except Exception as e:
            raise Inconsistent(f"its compaction handler {type(handler).__name__} fails on its new sizes "
                       f"({type(e).__name__}: {e})") from None
        for path, value in attrs.items():
            if path not in allowed:
                raise Inconsistent(f"attribute {path!r} is not one compaction sets on a {type(module).__name__} "
                           f"(it sets {sorted(allowed)})")
            owner, leaf = resolve(module, path)
            value = check_size_value(getattr(owner, leaf, None), value, path)
            self._claim(self.new_attrs, owner, leaf, value, f"attribute {path!r}")
            step.attrs.append((path, value))
        for path in sorted(exact):
            owner, leaf = resolve(module, path)
            if plain(self.attr(owner, leaf)) != plain(expected[path]):
                raise Inconsistent(f"attribute {path!r} would be {plain(self.attr(owner, leaf))!r}, and the tensors' new "
                           f"shapes make it {plain(expected[path])!r}")
        self.owners[id(module)] = module
        for path in list(tensors) + list(attrs):
            owner, _ = resolve(module, path)
            self.owners[id(owner)] = owner
        return step

    def _claim(self, table: Dict[_Key, Any], owner: nn.Module, leaf: str, value: Any, what: str) -> None:
        key = (id(owner), leaf)
        if key in table and plain(table[key]) != plain(value):
            raise Inconsistent(f"{what} is set twice, to {plain(table[key])!r} and {plain(value)!r}")
        table[key] = value

    def finish(self) -> None:
        for o in self.owners.values():
            check_layer(o, self.attr, self.shape)


def plan_rebuild(model: nn.Module, description: Mapping[str, Any], *, where: str = "compaction description",
                 registry: Optional[HandlerRegistry] = None) -> RebuildPlan:
    """Check a (structurally checked) description against ``model``; nothing is changed or allocated.

    Raises :class:`~prunekit.io.compacted.CompactedModelError` naming ``where``, the
    module and the reason.

    Examples:
        >>> from torch import nn
        >>> d = {"format": "prunekit.compact/1", "modules": {"0": {"attrs": {"eps": 1000.0}}}}
        >>> try:
        ...     plan_rebuild(nn.Sequential(nn.BatchNorm1d(4)), d)
        ... except ValueError as e:
        ...     print(e)
        compaction description: module '0': attribute 'eps' is not one compaction sets on a BatchNorm1d (it sets ['num_features'])
    """
    planner = _Planner(model, registry or REGISTRY)
    steps: List[_Step] = []
    names = list(description["modules"])
    replaced = [n for n in names if description["modules"][n].get("class")]
    for mname in names:
        at = f"{where}: module {mname!r}"
        inside = [r for r in replaced if mname.startswith(r + ".")]
        if inside:
            raise CompactedModelError(f"{at}: lies inside {inside[0]!r}, which the description replaces")
        try:
            steps.append(planner.entry(mname, description["modules"][mname]))
        except _Missing as e:
            raise CompactedModelError(f"{where}: {e}") from None
        except Inconsistent as e:
            raise CompactedModelError(f"{at}: {e}") from None
    try:
        planner.finish()
    except Inconsistent as e:
        raise CompactedModelError(f"{where}: {e}") from None
    return RebuildPlan(steps, planner.tensor_ids)


# ----------------------------------------------------------------------------- applying it
def _build_like(cls: type, init: Dict[str, Any], like: nn.Module) -> nn.Module:
    """``cls(**init)`` on the device and in the floating dtype of the module it replaces."""
    t = next(iter(list(like.parameters()) + list(like.buffers())), None)
    kw: Dict[str, Any] = {}
    params = inspect.signature(cls).parameters
    if t is not None and "device" in params:
        kw["device"] = t.device
    if t is not None and t.is_floating_point() and "dtype" in params:
        kw["dtype"] = t.dtype
    new = cls(**init, **kw)
    new.train(like.training)
    return new


def apply_plan(model: nn.Module, plan: RebuildPlan, journal: Journal) -> Set[int]:
    """Make a plan's changes, every module recorded in ``journal`` first; return the ids of the new tensors.

    A new tensor is zeros of the described shape (a replacement module is built from
    its ``init``); the rebuilt model's values come from the state dict loaded next.

    Examples:
        >>> from torch import nn
        >>> from prunekit.compact.surgery.journal import atomic
        >>> m = nn.Sequential(nn.Linear(4, 8))
        >>> d = {"format": "prunekit.compact/1", "modules": {"0": {"tensors": {"weight": [2, 4], "bias": [2]},
        ...                                                       "attrs": {"out_features": 2, "in_features": 4}}}}
        >>> with atomic() as journal:
        ...     fresh = apply_plan(m, plan_rebuild(m, d), journal)
        >>> m[0], len(fresh)
        (Linear(in_features=4, out_features=2, bias=True), 2)
    """
    journal.modules(model)
    fresh: Set[int] = set()
    for step in plan.steps:
        module = model.get_submodule(step.name) if step.name else model
        if step.replacement is not None:
            parent, leaf = reparam.owner_of(model, step.name)
            module = _build_like(step.replacement, step.init, module)
            journal.modules(module)
            setattr(parent, leaf, module)
            fresh.update(id(t) for t in list(module.parameters()) + list(module.buffers()))
        else:
            for path, shape in step.tensors:
                owner, leaf = reparam.owner_of(module, path)
                old = tensor_of(owner, leaf)
                if old is None:
                    raise Inconsistent(f"module {step.name!r} has no tensor {path!r} to rebuild")
                new = torch.zeros(shape, dtype=old.dtype, device=old.device)
                if leaf in owner._parameters:
                    new = nn.Parameter(new, requires_grad=old.requires_grad)
                    owner._parameters[leaf] = new
                else:
                    owner._buffers[leaf] = new
                fresh.add(id(new))
        for path, value in step.attrs:
            owner, leaf = reparam.owner_of(module, path)
            setattr(owner, leaf, value)
    return fresh


def _kind(t: Tensor) -> str:
    return "complex" if t.is_complex() else "floating" if t.is_floating_point() else "integer"


def check_state_dict(model: nn.Module, plan: RebuildPlan, state_dict: Mapping[str, Tensor],
                     where: str = "compaction description") -> None:
    """Check that ``state_dict`` fits ``model`` once ``plan`` is applied: the same keys, shapes and kinds of dtype.

    Nothing is changed or allocated; masked tensors (``name_orig``/``name_mask``) count as ``name``.

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> m = nn.Sequential(nn.Linear(4, 8))
        >>> d = {"format": "prunekit.compact/1", "modules": {"0": {"tensors": {"weight": [2, 4], "bias": [2]},
        ...                                                       "attrs": {"out_features": 2}}}}
        >>> try:
        ...     check_state_dict(m, plan_rebuild(m, d), {"0.weight": torch.zeros(2, 4)})
        ... except ValueError as e:
        ...     print(str(e).split(", unexpected")[0])
        compaction description: the state dict does not fit the rebuilt Sequential: missing ['0.bias']
    """
    replaced = {s.name: s.meta for s in plan.steps if s.meta is not None}
    prefixes = tuple(n + "." for n in replaced)
    expected: Dict[str, Tensor] = {}
    shapes: Dict[str, Tuple[int, ...]] = {}
    for k, t in model.state_dict(keep_vars=True).items():
        if not k.startswith(prefixes):
            expected[k], shapes[k] = t, tuple(plan.new_shapes.get(id(t), t.shape))
    for n, meta in replaced.items():
        for k, t in meta.state_dict(keep_vars=True).items():
            expected[f"{n}.{k}"], shapes[f"{n}.{k}"] = t, tuple(t.shape)
    for k in state_dict:
        base = k[: -len("_mask")]
        if k.endswith("_mask") and base + "_orig" in state_dict and base in expected:
            t, s = expected.pop(base), shapes.pop(base)
            expected[base + "_orig"], shapes[base + "_orig"] = t, s
            expected[k], shapes[k] = t, s
    missing, unexpected = sorted(set(shapes) - set(state_dict)), sorted(set(state_dict) - set(shapes))
    if missing or unexpected:
        raise CompactedModelError(f"{where}: the state dict does not fit the rebuilt {type(model).__name__}: missing "
                                  f"{missing[:5]}{' ...' if len(missing) > 5 else ''}, unexpected {unexpected[:5]}"
                                  f"{' ...' if len(unexpected) > 5 else ''}; give the state dict saved with this "
                                  "description, and build the same model class as the one compacted")
    for k, v in state_dict.items():
        if not isinstance(v, Tensor):
            raise CompactedModelError(f"{where}: state dict entry {k!r} is a {type(v).__name__}, not a tensor")
        if tuple(v.shape) != shapes[k]:
            raise CompactedModelError(f"{where}: state dict entry {k!r} has shape {list(v.shape)}, the rebuilt model's "
                                      f"is {list(shapes[k])}")
        if not k.endswith("_mask") and _kind(v) != _kind(expected[k]):
            raise CompactedModelError(f"{where}: state dict entry {k!r} is {v.dtype}, the model's is "
                                      f"{expected[k].dtype}; give the state dict saved with this description")


def load_state(model: nn.Module, state_dict: Mapping[str, Tensor], journal: Journal, fresh: Set[int]) -> None:
    """Re-apply the masks of ``state_dict`` and load it (strict), recording what it overwrites in ``journal``.

    Tensors in ``fresh`` (made by :func:`apply_plan`) are overwritten without a record;
    the others' values are recorded first, so a failure restores them.

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> from prunekit.compact.surgery.journal import atomic
        >>> m = nn.Linear(2, 1)
        >>> with atomic() as journal:
        ...     load_state(m, {"weight": torch.ones(1, 2), "bias": torch.zeros(1)}, journal, set())
        >>> m.weight.tolist()
        [[1.0, 1.0]]
    """
    journal.modules(model)
    seen: Set[int] = set()
    for t in list(model.parameters()) + list(model.buffers()):
        if id(t) not in fresh and id(t) not in seen:
            seen.add(id(t))
            journal.tensor(t)
    for key in list(state_dict):
        base = key[: -len("_mask")]
        if key.endswith("_mask") and base + "_orig" in state_dict:
            owner, leaf = reparam.owner_of(model, base)
            methods.apply_mask(owner, leaf, state_dict[key])
    model.load_state_dict(state_dict)
