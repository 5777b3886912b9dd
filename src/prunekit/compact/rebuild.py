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
:class:`~prunekit.compact.journal.Journal` first (references only, no tensor is
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

from .. import reparam
from ..io.compacted import CompactedModelError
from .handlers import REGISTRY, HandlerRegistry, ModuleHandler
from .journal import Journal
from .modules import REPLACEMENTS, PrunedMultiheadAttention

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


class _Bad(Exception):
    """A reason an entry is refused (turned into a CompactedModelError naming the module)."""


class _Missing(_Bad):
    """The description names a module the model does not have (the message names it)."""


def _tensor(owner: nn.Module, leaf: str) -> Optional[Tensor]:
    if leaf in owner._parameters:
        return owner._parameters[leaf]
    if leaf in owner._buffers:
        return owner._buffers[leaf]
    return None


def _resolve(module: nn.Module, path: str) -> Tuple[nn.Module, str]:
    prefix, _, leaf = path.rpartition(".")
    try:
        owner = module.get_submodule(prefix) if prefix else module
    except AttributeError:
        raise _Bad(f"path {path!r}: {type(module).__name__} has no submodule {prefix!r}") from None
    return owner, leaf


def _norm(v: Any) -> Any:
    return list(v) if isinstance(v, (tuple, list)) else v


# ----------------------------------------------------------------------------- replacements
def _check_mha_init(original: nn.Module, init: Dict[str, Any]) -> None:
    """PrunedMultiheadAttention: only the sizes compaction shrinks may differ from the original's."""
    if not isinstance(original, nn.MultiheadAttention):  # pragma: no cover - checked by the caller
        raise _Bad("PrunedMultiheadAttention replaces an nn.MultiheadAttention")
    limits = {"embed_dim": original.embed_dim, "num_heads": original.num_heads,
              "embed_out": original.out_proj.out_features}
    for k, top in limits.items():
        v = init.get(k)
        if type(v) is not int or not 0 <= v <= top:
            raise _Bad(f"init {k!r} must be an int in [0, {top}] (the original's), got {v!r}")
    same = {"head_dim": original.head_dim, "bias": original.in_proj_bias is not None,
            "dropout": original.dropout, "batch_first": original.batch_first}
    for k, want in same.items():
        v = init.get(k)
        if type(v) is not type(want) or v != want:
            raise _Bad(f"init {k!r} must be {want!r} (compaction never changes it), got {v!r}")


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
        raise _Bad(f"class {cls_name!r} is not one compaction puts in a model; only {sorted(REPLACEMENTS)} are")
    if not name:
        raise _Bad("the root module is never replaced")
    base = cls.__mro__[1]
    if not isinstance(original, base):
        raise _Bad(f"{cls_name} replaces an {base.__name__}, and the model's module is a {type(original).__name__}; "
                   "build the same model class as the one compacted")
    params = inspect.signature(cls).parameters
    named = {n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)} - {"device", "dtype"}
    unknown = sorted(set(init) - named)
    required = sorted(n for n in named if params[n].default is inspect.Parameter.empty and n not in init)
    if unknown or required:
        raise _Bad(f"init of {cls_name} takes {sorted(named)}; unknown {unknown}, missing {required}")
    init = INIT_FROM_TENSORS.get(cls, lambda i, t: i)(dict(init), tensors)
    check = INIT_CHECKS.get(cls)
    if check is None:
        raise _Bad(f"class {cls_name} has no check of its constructor arguments in "
                   "prunekit.compact.rebuild.INIT_CHECKS; add one to load it")
    check(original, init)
    try:
        with torch.device("meta"), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # e.g. "Initializing zero-element tensors is a no-op"
            meta = cls(**init)
    except Exception as e:
        raise _Bad(f"init {init!r} does not build a {cls_name} ({type(e).__name__}: {e})") from None
    if _numel(meta) > _numel(original):
        raise _Bad(f"init {init!r} asks for {_numel(meta)} elements, more than the {_numel(original)} of the module "
                   "it replaces (compaction only removes)")
    return cls, init, meta


# ----------------------------------------------------------------------------- sizes from shapes
def _slot_sizes(handler: ModuleHandler, module: nn.Module, shape_of: Callable[[str], Optional[Tuple[int, ...]]]
                ) -> Tuple[Dict[str, int], Dict[str, int], Set[str]]:
    """``(original sizes, new sizes the tensors determine, slots they do not)`` of a module's slots."""
    slots = handler.slots(module)
    base = {s: spec.size for s, spec in slots.items()}
    groups: Dict[Tuple[str, int], Dict[str, int]] = {}
    for sname, spec in slots.items():
        for e in spec.entries:
            g = groups.setdefault((e.path, e.axis), {})
            g[sname] = g.get(sname, 0) + 1
    current = {k: _current(module, k[0]) for k in groups}
    groups = {k: g for k, g in groups.items() if current[k] is not None}

    def left(key: Tuple[str, int], mult: Dict[str, int]) -> int:  # new axis size minus what known slots take
        path, axis = key
        rest = current[key][axis] - sum(m * base[s] for s, m in mult.items())
        return shape_of(path)[axis] - rest - sum(m * known[s] for s, m in mult.items() if s in known)

    known: Dict[str, int] = {}
    progress = True
    while progress:
        progress = False
        for key, mult in groups.items():
            unknown = [s for s in mult if s not in known]
            if len(unknown) == 1:
                s = unknown[0]
                size, r = divmod(left(key, mult), mult[s])
                if r or not 0 <= size <= base[s]:
                    raise _Bad(f"tensor {key[0]!r} has {shape_of(key[0])[key[1]]} along axis {key[1]}, which no "
                               f"size of its {s!r} dimension (at most {base[s]}) gives")
                known[s] = size
                progress = True
    for key, mult in groups.items():
        if all(s in known for s in mult) and left(key, mult) != 0:
            raise _Bad(f"tensor {key[0]!r} has {shape_of(key[0])[key[1]]} along axis {key[1]}; the module's other "
                       f"tensors say {shape_of(key[0])[key[1]] - left(key, mult)}")
    return base, known, {s for s in slots if s not in known}


def _current(module: nn.Module, path: str) -> Optional[Tuple[int, ...]]:
    prefix, _, leaf = path.rpartition(".")
    try:
        owner = module.get_submodule(prefix) if prefix else module
    except AttributeError:
        return None
    t = _tensor(owner, leaf)
    return None if t is None else tuple(t.shape)


def _expected_attrs(handler: ModuleHandler, module: nn.Module, shape_of: Callable[[str], Optional[Tuple[int, ...]]]
                    ) -> Tuple[Dict[str, Any], Set[str]]:
    """What the handler sets for the new shapes, and the keys the shapes determine (the rest: range checks only)."""
    base, known, unknown = _slot_sizes(handler, module, shape_of)
    a = handler.attrs(module, {**base, **known})
    if not unknown:
        return a, set(a)
    exact = set(a)
    # an attribute that moves when an undetermined size moves is not determined by the shapes: probe with
    # the undetermined sizes doubled and halved (far enough apart for sizes counted in heads or groups)
    for probe in ({s: 2 * base[s] + 1 for s in unknown}, {s: base[s] // 2 for s in unknown}):
        try:
            b = handler.attrs(module, {**base, **known, **probe})
        except Exception:
            return a, set()
        exact &= {k for k in a if k in b and _norm(a[k]) == _norm(b[k])}
    return a, exact


# ----------------------------------------------------------------------------- invariants of layers
_AttrOf = Callable[[nn.Module, str], Any]
_ShapeOf = Callable[[nn.Module, str], Optional[Tuple[int, ...]]]


def _invariants(o: nn.Module, attr_of: _AttrOf, shape_of: _ShapeOf) -> None:
    """Refuse a layer whose size attributes and tensor shapes disagree (after the planned changes)."""
    def attr(leaf: str) -> Any:
        return attr_of(o, leaf)

    def want(leaf: str, expected: Tuple[int, ...], what: str) -> None:
        got = shape_of(o, leaf)
        if got is not None and tuple(got[: len(expected)]) != tuple(expected):
            raise _Bad(f"{type(o).__name__}'s {leaf} would have shape {list(got)}, and its {what} say {list(expected)}")

    if isinstance(o, nn.Linear):
        want("weight", (attr("out_features"), attr("in_features")), "out_features/in_features")
        want("bias", (attr("out_features"),), "out_features")
    elif isinstance(o, nn.modules.conv._ConvNd):
        g, cin, cout = attr("groups"), attr("in_channels"), attr("out_channels")
        if type(g) is not int or g < 1 or cin % g or cout % g:
            raise _Bad(f"{type(o).__name__} would have {cin} input and {cout} output channels in {g} groups")
        w = (cin, cout // g) if o.transposed else (cout, cin // g)
        want("weight", w, "channels and groups")
        want("bias", (cout,), "out_channels")
    elif isinstance(o, nn.modules.batchnorm._NormBase):
        for leaf in ("weight", "bias", "running_mean", "running_var"):
            want(leaf, (attr("num_features"),), "num_features")
    elif isinstance(o, nn.GroupNorm):
        c, g = attr("num_channels"), attr("num_groups")
        if type(g) is not int or g < 1 or c % g:
            raise _Bad(f"GroupNorm would have {c} channels in {g} groups")
        want("weight", (c,), "num_channels")
        want("bias", (c,), "num_channels")
    elif isinstance(o, nn.LayerNorm):
        want("weight", tuple(attr("normalized_shape")), "normalized_shape")
        want("bias", tuple(attr("normalized_shape")), "normalized_shape")
    elif isinstance(o, nn.Embedding):
        want("weight", (attr("num_embeddings"), attr("embedding_dim")), "num_embeddings/embedding_dim")
    elif _is_conv1d(o):
        want("weight", (attr("nx"), attr("nf")), "nx/nf")
        want("bias", (attr("nf"),), "nf")
    _head_invariants(o, attr_of)


def _is_conv1d(o: nn.Module) -> bool:
    """Hugging Face's ``Conv1D`` (a Linear with its weight transposed: ``nx`` inputs, ``nf`` outputs)."""
    return type(o).__name__ == "Conv1D" and type(getattr(o, "nf", None)) is int and type(getattr(o, "nx", None)) is int


def _first_int(o: nn.Module, attr_of: _AttrOf, names: Tuple[str, ...]) -> Optional[Tuple[str, int]]:
    for n in names:
        if type(getattr(o, n, None)) is int:
            return n, attr_of(o, n)
    return None


def _head_invariants(o: nn.Module, attr_of: _AttrOf) -> None:
    """Attention: heads times the head size is the width of all heads; GPT-2's fused q/k/v is three of it."""
    heads = _first_int(o, attr_of, ("num_heads", "num_attention_heads", "n_heads"))
    size = _first_int(o, attr_of, ("attention_head_size", "head_dim", "key_value_proj_dim"))
    total = _first_int(o, attr_of, ("all_head_size", "split_size", "inner_dim"))
    if heads and size and total and heads[1] * size[1] != total[1]:
        raise _Bad(f"{type(o).__name__} would have {heads[0]}={heads[1]} heads of {size[0]}={size[1]}, "
                   f"and {total[0]}={total[1]}")
    c_attn = getattr(o, "c_attn", None)
    if (total and total[0] == "split_size" and not getattr(o, "is_cross_attention", False)
            and isinstance(c_attn, nn.Module) and _is_conv1d(c_attn) and attr_of(c_attn, "nf") != 3 * total[1]):
        raise _Bad(f"{type(o).__name__}'s fused c_attn would have nf={attr_of(c_attn, 'nf')}, three times "
                   f"split_size={total[1]} is {3 * total[1]}")


# ----------------------------------------------------------------------------- the plan
def _check_value(current: Any, value: Any, path: str) -> Any:
    """The value to set for ``path`` (a size: an int or a tuple of ints, no larger than now)."""
    if type(current) is int:
        if type(value) is not int or not 0 <= value <= current:
            raise _Bad(f"attribute {path!r} is {current} and compaction only shrinks it: give an int in "
                       f"[0, {current}], not {value!r}")
        return value
    if isinstance(current, tuple) and current and all(type(c) is int for c in current):
        if (not isinstance(value, (list, tuple)) or len(value) != len(current)
                or not all(type(v) is int and 0 <= v <= c for v, c in zip(value, current))):
            raise _Bad(f"attribute {path!r} is {list(current)}: give as many ints, none larger, not {value!r}")
        return tuple(value)
    raise _Bad(f"attribute {path!r} holds {type(current).__name__} {current!r}; compaction changes only sizes")


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
        t = _tensor(owner, leaf)
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
            raise _Bad("'init' is given without 'class'")
        tensors, attrs = entry.get("tensors", {}), entry.get("attrs", {})
        if not tensors and not attrs:
            return step
        handler = self.registry.lookup(module)
        if handler is None:
            raise _Bad(f"compaction has no handler for {type(module).__name__}, so it never changes one")
        try:
            slots = handler.slots(module)
            allowed = handler.attrs(module, {s: spec.size for s, spec in slots.items()})
        except Exception as e:
            raise _Bad(f"its compaction handler {type(handler).__name__} fails on it ({type(e).__name__}: {e})") from None
        axes: Dict[str, Set[int]] = {}
        for spec in slots.values():
            for e in spec.entries:
                axes.setdefault(e.path, set()).add(e.axis)
        described: Dict[str, Tuple[int, ...]] = {}
        for path, shape in tensors.items():
            owner, leaf = _resolve(module, path)
            t = _tensor(owner, leaf)
            if t is None:
                raise _Bad(f"{type(owner).__name__} has no parameter or buffer {leaf!r} (path {path!r}); "
                           "rebuild a freshly built, unpruned model")
            shape = tuple(shape)
            if step.meta is not None:
                if shape != tuple(t.shape):
                    raise _Bad(f"tensor {path!r}: the description says {list(shape)}, its init builds {list(t.shape)}")
            else:
                if path not in axes:
                    raise _Bad(f"tensor {path!r}: compaction never changes it in a {type(module).__name__}")
                if len(shape) != t.dim() or any(s > c for s, c in zip(shape, t.shape)) or any(
                        s != c for i, (s, c) in enumerate(zip(shape, t.shape)) if i not in axes[path]):
                    raise _Bad(f"tensor {path!r} is {list(t.shape)}: compaction only shrinks axes "
                               f"{sorted(axes[path])} of it, and the description says {list(shape)}")
            self._claim(self.new_shapes, owner, leaf, shape, f"tensor {path!r}")
            self.tensor_ids[id(t)] = shape
            described[path] = shape
            step.tensors.append((path, shape))

        def shape_of(path: str) -> Optional[Tuple[int, ...]]:
            return described.get(path, _current(module, path))

        try:
            expected, exact = _expected_attrs(handler, module, shape_of)
        except _Bad:
            raise
        except Exception as e:
            raise _Bad(f"its compaction handler {type(handler).__name__} fails on its new sizes "
                       f"({type(e).__name__}: {e})") from None
        for path, value in attrs.items():
            if path not in allowed:
                raise _Bad(f"attribute {path!r} is not one compaction sets on a {type(module).__name__} "
                           f"(it sets {sorted(allowed)})")
            owner, leaf = _resolve(module, path)
            value = _check_value(getattr(owner, leaf, None), value, path)
            self._claim(self.new_attrs, owner, leaf, value, f"attribute {path!r}")
            step.attrs.append((path, value))
        for path in sorted(exact):
            owner, leaf = _resolve(module, path)
            if _norm(self.attr(owner, leaf)) != _norm(expected[path]):
                raise _Bad(f"attribute {path!r} would be {_norm(self.attr(owner, leaf))!r}, and the tensors' new "
                           f"shapes make it {_norm(expected[path])!r}")
        self.owners[id(module)] = module
        for path in list(tensors) + list(attrs):
            owner, _ = _resolve(module, path)
            self.owners[id(owner)] = owner
        return step

    def _claim(self, table: Dict[_Key, Any], owner: nn.Module, leaf: str, value: Any, what: str) -> None:
        key = (id(owner), leaf)
        if key in table and _norm(table[key]) != _norm(value):
            raise _Bad(f"{what} is set twice, to {_norm(table[key])!r} and {_norm(value)!r}")
        table[key] = value

    def finish(self) -> None:
        for o in self.owners.values():
            _invariants(o, self.attr, self.shape)


def plan_rebuild(model: nn.Module, description: Mapping[str, Any], *, where: str = "compaction description",
                 registry: Optional[HandlerRegistry] = None) -> RebuildPlan:
    """Check a (structurally checked) description against ``model``; nothing is changed or allocated.

    Raises :class:`~prunekit.io.compacted.CompactedModelError` naming ``where``, the
    module and the reason.

    Example:
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
        except _Bad as e:
            raise CompactedModelError(f"{at}: {e}") from None
    try:
        planner.finish()
    except _Bad as e:
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

    Example:
        >>> from torch import nn
        >>> from prunekit.compact.journal import atomic
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
                old = _tensor(owner, leaf)
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

    Example:
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

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from prunekit.compact.journal import atomic
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
            reparam.apply_mask(owner, leaf, state_dict[key])
    model.load_state_dict(state_dict)
