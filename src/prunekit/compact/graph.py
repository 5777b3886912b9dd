"""Dependency groups: which channels of which layers must be removed together.

How it works
------------
The model is run once on the example inputs. Every module with a handler
(``Linear``, ``Conv2d``, ``BatchNorm2d``, ``nn.MultiheadAttention``, BERT-style
self-attention, ...) is a *leaf*: its handler says which parameter dimensions
("slots") it owns and how its inputs and outputs relate to them. Every torch
operation *between* leaves (``+``, ``torch.cat``, ``flatten``, ``view``,
``permute``, activations, pooling, ``matmul``, ...) is seen through a
``TorchFunctionMode``.

Each activation gets a *shadow*: an int64 tensor of the same shape whose every
element holds the id of the channel that element belongs to (``-1``: none).
Shape operations are applied to the shadow exactly as to the activation, so a
flatten, a view, a transpose or a concatenation needs no special rule.
Element-wise operations union the ids they combine (a residual add couples the
two branches' channels); a consumer layer unions its input-channel ids with the
shadow it receives. The connected components of this union-find are the
*units* (one channel, one head, one group of a grouped conv); units spanning
the same set of layer dimensions form a *group*.

Cost: about one forward pass. Shadows are *canonical* zero-copy views: stride 0
along exactly the dims where their labels are constant, so a 1x64x112x112 layer
output's shadow is a 64-element ``arange`` expanded, every rule reads "which dims
vary" from strides and works on the small core (never on activation-sized
data). The model runs once under ``torch.no_grad()`` (no autograd bookkeeping);
unions and blocks are only recorded during the run and solved at the end with
vectorized hooking and pointer jumping; units and groups are formed with a few
sorts instead of per-channel Python loops.

Why this tracer and not torch.fx or torch.export
------------------------------------------------
* ``torch.fx.symbolic_trace`` fails on data-dependent Python control flow and
  on most Hugging Face models (shape checks, ``if attention_mask is None``,
  dataclass outputs); ``torch.export`` is stricter still and slow, and it
  decomposes ``nn.MultiheadAttention`` into aten ops, losing the head
  structure.
* The autograd graph (Torch-Pruning's choice) handles any model that runs, but
  it sees ``grad_fn`` types instead of operations (no ``cat`` dimension, no
  view sizes without private attributes) and needs gradients everywhere.
* Running the model eagerly under a ``TorchFunctionMode`` handles every model
  that runs -- control flow takes the path it takes on the example -- and sees
  real operations with their real arguments. Pruned modules (prunekit or
  ``torch.nn.utils.prune``) are traced like the originals.

Anything the tracer does not understand is never guessed: the channels that
flow into an unknown operation are *blocked* (not prunable) and the reason
names the operation and the module, e.g. ``"op 'einsum' in module
'blocks.0.attn'"``. Channels that reach the model's outputs are blocked too
(removing them would change the output's shape).
"""

from __future__ import annotations

import gc
import itertools
import logging
import weakref
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

logger = logging.getLogger(__name__)

__all__ = [
    "DependencyGraph",
    "Group",
    "TraceError",
    "Unit",
    "build_dependency_graph",
]

class TraceError(RuntimeError):
    """The model's forward pass failed while prunekit traced it."""


# ------------------------------------------------------------------ op tables
def _names(*groups: str) -> frozenset:
    out = set()
    for g in groups:
        out.update(g.split())
    return frozenset(out)


# Element-wise operations: each output element combines input elements at the same
# (broadcast) position. In-place variants ("add_") are matched after stripping "_".
POINTWISE = _names(
    "add sub mul div true_divide rsub __add__ __radd__ __iadd__ __sub__ __rsub__ __isub__",
    "__mul__ __rmul__ __imul__ __truediv__ __rtruediv__ __itruediv__ __div__ __neg__ __pos__",
    "__pow__ __rpow__ pow neg abs exp log sqrt rsqrt square reciprocal sin cos erf tanh sigmoid",
    "relu relu6 gelu silu mish hardswish hardsigmoid hardtanh leaky_relu elu selu celu softplus",
    "softsign logsigmoid prelu dropout dropout1d dropout2d dropout3d alpha_dropout feature_alpha_dropout",
    "clamp clamp_min clamp_max clip where masked_fill maximum minimum addcmul addcdiv lerp sign",
    "threshold glu_never",
)
# Operations that only move elements around (or change dtype/device): apply them to the shadow.
SHAPE = _names(
    "view reshape flatten unflatten permute transpose t contiguous unsqueeze squeeze expand",
    "expand_as __getitem__ narrow select movedim moveaxis swapaxes swapdims view_as reshape_as",
    "clone repeat flip roll detach",
)
SAME = _names("to type float double half bfloat16 cpu cuda requires_grad_ __deepcopy__")
MULTI = _names("split chunk unbind tensor_split split_with_sizes")
CAT = _names("cat concat concatenate stack hstack vstack")
REDUCE = _names("mean sum amax amin max min std var norm logsumexp prod nansum nanmean")
SOFTMAX = _names("softmax log_softmax _softmax")
POOL = _names(
    "avg_pool1d avg_pool2d avg_pool3d max_pool1d max_pool2d max_pool3d adaptive_avg_pool1d",
    "adaptive_avg_pool2d adaptive_avg_pool3d adaptive_max_pool1d adaptive_max_pool2d",
    "adaptive_max_pool3d lp_pool1d lp_pool2d interpolate upsample max_pool2d_with_indices",
    "_max_pool2d boolean_dispatch pixel_shuffle_never",
)
MATMUL = _names("matmul __matmul__ __rmatmul__ bmm mm")
HARMLESS_MUTATORS = _names("requires_grad_ retain_grad share_memory_")
# one-tensor calls of these (no other argument) copy their input's labels when the shape is kept
def _base(name: str) -> str:
    """The out-of-place name of an in-place op ("add_" -> "add"; dunders unchanged)."""
    return name[:-1] if name.endswith("_") and not name.endswith("__") else name


_SAME_LABELS = frozenset(
    n for n in POINTWISE | SAME | {p + "_" for p in POINTWISE | SAME} if _base(n) in POINTWISE | SAME
) - {"__deepcopy__"}


def _op_name(func: Any) -> str:
    name = getattr(func, "__name__", None) or str(func)
    if name == "__get__":  # properties: Tensor.shape.__get__, Tensor.T.__get__
        owner = getattr(func, "__self__", None)
        name = getattr(owner, "__name__", "__get__")
    return name


def _tensors(obj: Any) -> List[Tensor]:
    out: List[Tensor] = []
    stack = [obj]
    while stack:
        o = stack.pop()
        if isinstance(o, Tensor):
            out.append(o)
        elif isinstance(o, (list, tuple)):
            stack.extend(o)
        elif isinstance(o, dict):
            stack.extend(o.values())
    return out


# ------------------------------------------------------------------ results
@dataclass(slots=True)  # no per-instance __dict__: a graph holds thousands of units
class Unit:
    """One removable piece: a channel, a head or a group of a grouped conv.

    ``members`` maps ``(module_name, slot_name)`` to the indices of that slot in this unit.
    """

    members: Dict[Tuple[str, str], Tensor]  # read-only: units may share index tensors

    def width(self) -> int:
        """Channels per unit in its widest slot (32 for a 32-dim head)."""
        return max(int(v.numel()) for v in self.members.values())


class Group:
    """Units that span the same layer dimensions (e.g. conv1.out + bn1 + conv2.in).

    ``units`` is built on first access (a graph can hold thousands); ``member_index()``
    and ``slots`` never need it.
    """

    __hash__ = None  # type: ignore[assignment]  # mutable, compared by value

    def __init__(
        self, slots: Tuple[Tuple[str, str], ...], units: Optional[List[Unit]], blocked: Optional[str] = None
    ) -> None:
        self.slots = slots
        self.blocked = blocked  # reason this group cannot be pruned, or None
        self._units = units
        # deferred units: (member keys in order, every unit's pieces in a row, units) -- see _collect
        self._deferred: Optional[Tuple[Tuple[Tuple[str, str], ...], List[Tensor], int]] = None
        self._index: Optional[Dict[Tuple[str, str], Tuple[Tensor, Tensor]]] = None

    @classmethod
    def _lazy(
        cls, slots: Tuple[Tuple[str, str], ...], names: Tuple[Tuple[str, str], ...], pieces: List[Tensor],
        count: int, blocked: Optional[str],
    ) -> "Group":
        g = cls(slots, None, blocked)
        g._deferred = (names, pieces, count)
        return g

    @property
    def units(self) -> List[Unit]:
        if self._units is None:
            names, pieces, count = self._deferred  # type: ignore[misc]
            rows = zip(*[iter(pieces)] * len(names))  # one unit's pieces per row
            self._units = list(map(Unit, map(dict, map(zip, itertools.repeat(names, count), rows))))
            self._deferred = None
        return self._units

    @units.setter
    def units(self, value: List[Unit]) -> None:
        self._units, self._deferred, self._index = value, None, None

    @property
    def prunable(self) -> bool:
        return self.blocked is None

    def member_index(self) -> Dict[Tuple[str, str], Tuple[Tensor, Tensor]]:
        """Per slot, every unit's indices at once: ``(indices, unit number of each index)``.

        Lets per-unit sums and selections run as one ``index_add_``/mask per slot instead
        of a Python loop over units (computed once, then cached; treat as read-only).
        """
        if self._index is None:
            index: Dict[Tuple[str, str], Tuple[Tensor, Tensor]] = {}
            if self._deferred is not None:
                names, pieces, _ = self._deferred
                per_key = [(key, pieces[j :: len(names)]) for j, key in enumerate(names)]
            else:
                keys = self._units[0].members if self._units else ()
                per_key = [(key, [u.members[key] for u in self._units]) for key in keys]
            for key, parts in per_key:
                counts = torch.tensor([int(p.numel()) for p in parts])
                index[key] = (torch.cat(parts), torch.repeat_interleave(torch.arange(len(parts)), counts))
            self._index = index
        return self._index

    def __eq__(self, other: object) -> bool:
        if other.__class__ is not self.__class__:
            return NotImplemented
        return (self.slots, self.units, self.blocked) == (other.slots, other.units, other.blocked)  # type: ignore[attr-defined]

    def __repr__(self) -> str:
        names = ", ".join(f"{m}.{s}" for m, s in self.slots[:6])
        more = f", +{len(self.slots) - 6}" if len(self.slots) > 6 else ""
        state = "prunable" if self.blocked is None else f"blocked: {self.blocked}"
        units = self.units
        return f"Group({len(units)} units x{units[0].width() if units else 0} [{names}{more}]; {state})"


@dataclass
class SlotInfo:
    module_name: str
    slot_name: str
    start: int
    spec: Any  # handlers.Slot


@dataclass
class DependencyGraph:
    """The result of :func:`build_dependency_graph`."""

    model: nn.Module
    groups: List[Group]
    slots: Dict[Tuple[str, str], SlotInfo]
    handlers: Dict[str, Any]  # module name -> handler
    ignored: Tuple[str, ...] = ()

    def prunable_groups(self) -> List[Group]:
        return [g for g in self.groups if g.prunable]

    def module(self, name: str) -> nn.Module:
        return self.model.get_submodule(name) if name else self.model

    def entries(self, group: Group) -> Iterator[Tuple[str, Any, Tensor, Tensor]]:
        """``(module name, Entry, tensor indices, unit number of each index)`` for every
        weight/bias/norm tensor ``group`` spans (running-stat buffers are skipped)."""
        for (mname, sname), (idx, unit_of) in group.member_index().items():
            for e in self.slots[(mname, sname)].spec.entries:
                if e.role != "buffer":
                    yield mname, e, idx + e.offset if e.offset else idx, unit_of


# ------------------------------------------------------------------ union-find
_NEG_ONE = torch.full((1,), -1, dtype=torch.long)


class _UnionFind:
    """Channel ids joined into components; a component may carry a "blocked" reason.

    Unions and blocks are only *recorded* while the model runs (a tensor append each);
    :meth:`solve` computes every component at once with vectorized hooking and pointer
    jumping (O(log n) rounds of tensor ops instead of one Python call per union). A
    component's root is its smallest id; its reason is the one recorded first among
    its ids.
    """

    def __init__(self) -> None:
        self.n = 0
        self._edges: List[Tensor] = []  # (k, 2) int64 rows to union
        self._rows: List[Tuple[Tensor, Tensor]] = []  # (a, b): union a[i] with b[i]; stacked in solve()
        # ids, reason, and an optional tensor: only ids where it is < 0 (in the order recorded)
        self._blocks: List[Tuple[Tensor, str, Optional[Tensor]]] = []
        self.roots: Optional[Tensor] = None  # after solve(): root of every id
        self.blocked: Dict[int, str] = {}  # after solve(): root -> reason

    def add(self, n: int) -> int:
        start = self.n
        self.n += n
        self.roots = None
        return start

    def union_pairs(self, pairs: Tensor) -> None:
        """Union every row (a, b) of an (N, 2) int64 tensor where both are >= 0."""
        if pairs.numel():
            self._edges.append(pairs.reshape(-1, 2))  # rows with a negative id are dropped in solve()
            self.roots = None

    def union_rows(self, a: Tensor, b: Tensor) -> None:
        """Union ``a[i]`` with ``b[i]`` for every i (1-d, same length; negative ids are ignored)."""
        if a.numel():
            self._rows.append((a, b))
            self.roots = None

    def block(self, ids: Tensor, reason: str, where_negative: Optional[Tensor] = None) -> None:
        """Record a reason for the components of ``ids`` (negative ids are ignored).

        ``where_negative``: same length as ``ids``; only ids at its negative entries count.
        """
        if ids.numel():
            self._blocks.append((ids.reshape(-1), reason, where_negative))
            self.roots = None

    def solve(self) -> Tensor:
        """Root (smallest id) of every id's component; fills :attr:`blocked`."""
        if self.roots is not None:
            return self.roots
        parent = torch.arange(self.n, dtype=torch.long)
        if self._rows:  # one stack for every union_rows() call
            self._edges.append(
                torch.stack([torch.cat([a for a, _ in self._rows]), torch.cat([b for _, b in self._rows])], dim=1)
            )
            self._rows = []
        if self._edges:
            edges = torch.cat(self._edges).to(torch.long)
            edges = edges[(edges >= 0).all(dim=1) & (edges[:, 0] != edges[:, 1])]
            self._edges = [edges]
            a, b = edges[:, 0], edges[:, 1]
            while True:
                pa, pb = parent[a], parent[b]
                differ = pa != pb
                if not bool(differ.any()):
                    break
                pa, pb = pa[differ], pb[differ]
                lo = torch.minimum(pa, pb)
                # hook each root onto the smallest root it touches (roots only decrease: no cycles)
                parent.scatter_reduce_(0, torch.maximum(pa, pb), lo, reduce="amin")
                while True:  # pointer jumping until every id points at its root
                    nxt = parent[parent]
                    if torch.equal(nxt, parent):
                        break
                    parent = nxt
        self.blocked = {}
        if self._blocks:
            # all blocks at once: an id counts where it is >= 0 and its condition (if any) < 0
            ids = torch.cat([i for i, _, _ in self._blocks]).to(torch.long)
            conds = torch.cat([_NEG_ONE.expand(i.numel()) if c is None else c.reshape(-1) for i, _, c in self._blocks])
            order = torch.repeat_interleave(
                torch.arange(len(self._blocks)), torch.tensor([i.numel() for i, _, _ in self._blocks])
            )
            keep = (ids >= 0) & (conds < 0)
            ids, order = ids[keep], order[keep]
            first = torch.full((self.n,), len(self._blocks), dtype=torch.long)
            first.scatter_reduce_(0, parent[ids], order, reduce="amin")
            hit = (first < len(self._blocks)).nonzero().view(-1)
            self.blocked = {r: self._blocks[k][1] for r, k in zip(hit.tolist(), first[hit].tolist())}
        self.roots = parent
        return parent

    def find(self, x: int) -> int:
        return int(self.solve()[x])

    def reason(self, i: int) -> Optional[str]:
        return self.blocked.get(self.find(i))


def _core(s: Tensor, keep: Sequence[int] = ()) -> Tensor:
    """Narrow a canonical shadow to one position along every constant (stride-0) dim.

    ``keep``: dims left whole. Exact for union purposes: a 1x64x112x112 layer-output
    shadow becomes 1x64x1x1 without reading any element.
    """
    for d in range(s.dim()):
        if s.shape[d] > 1 and s.stride(d) == 0 and d not in keep:
            s = s.narrow(d, 0, 1)
    return s


def _canonical_core(s: Tensor) -> Tensor:
    """:func:`_canonical`'s core: size 1 along every constant dim."""
    r = _core(s)
    for d in range(r.dim()):
        if r.shape[d] > 1 and bool((r == r.narrow(d, 0, 1)).all()):
            r = r.narrow(d, 0, 1)
    return r


def _canonical(s: Tensor) -> Tensor:
    """The same labels as a view whose stride is 0 along exactly the dims where they are constant.

    Every stored shadow is canonical, so "which dims vary" is read from strides and
    every later rule works on the small core. Only non-stride-0 dims are checked, on
    the already narrowed core.
    """
    r = _canonical_core(s)
    return r.expand(s.shape) if r.shape != s.shape else s


def _squeeze_constant(*shadows: Tensor) -> List[Tensor]:
    """Narrow (same-shape, canonical) shadows to one position along every dim where all are constant."""
    out = list(shadows)
    for d in range(out[0].dim()):
        if out[0].shape[d] > 1 and all(s.stride(d) == 0 for s in out):
            out = [s.narrow(d, 0, 1) for s in out]
    return out


def _varying_dims(s: Tensor) -> List[int]:
    """Dimensions along which a canonical shadow's labels change."""
    return [d for d in range(s.dim()) if s.shape[d] > 1 and s.stride(d) != 0]


def _is_fixed(s: Tensor) -> bool:
    """True for a shadow without any id (all -1); stored shadows always hold one."""
    if s.numel() == 0:
        return True
    return s.stride() == (0,) * s.dim() and int(s.reshape(-1)[0]) < 0


def _fixed(shape: Sequence[int]) -> Tensor:
    """The shadow of a tensor without channel ids: -1 everywhere, as a zero-copy view."""
    return torch.full((), -1, dtype=torch.long).expand(tuple(shape))


# ------------------------------------------------------------------ tracer
class Tracer:
    """Runs the model once and builds the union-find of coupled channels.

    Handlers talk to it through :meth:`slot`, :meth:`bind`, :meth:`emit`,
    :meth:`tie`, :meth:`block` and :meth:`shadow`.
    """

    def __init__(self, model: nn.Module, registry: Any, exact: bool = True) -> None:
        self.model = model
        self.registry = registry
        self.exact = exact
        self.uf = _UnionFind()
        self.shadows: Dict[int, Tuple[Tensor, Tensor]] = {}
        self.slots: Dict[Tuple[str, str], SlotInfo] = {}
        self.handlers: Dict[str, Any] = {}
        self.named: List[Tuple[str, nn.Module]] = list(model.named_modules())
        self.names: Dict[int, str] = {id(m): n for n, m in self.named}
        self.by_name: Dict[str, nn.Module] = dict(self.named)
        self._slot_ids: Dict[Tuple[str, str], Tensor] = {}
        self._specs: Dict[str, Dict[str, Any]] = {}
        self.stack: List[str] = []
        self.leaf_depth = 0
        self.last_op = ""
        self.order: List[str] = []

    # ---- handler API
    @property
    def where(self) -> str:
        return (self.stack[-1] or "<model>") if self.stack else "<model>"

    def slot(self, module_name: str, slot_name: str) -> Tensor:
        """Element ids of one slot (allocated on first use)."""
        key = (module_name, slot_name)
        info = self.slots.get(key)
        if info is None:
            specs = self._specs.get(module_name)
            if specs is None:  # one handler.slots() call per module
                specs = self._specs[module_name] = self.handlers[module_name].slots(self.by_name[module_name])
            spec = specs[slot_name]
            info = SlotInfo(module_name, slot_name, self.uf.add(spec.size), spec)
            self.slots[key] = info
            if spec.tie > 1:  # heads / norm groups: consecutive blocks move together
                ids = torch.arange(info.start, info.start + spec.size).view(-1, spec.tie)
                self.tie(ids)
        ids = self._slot_ids.get(key)
        if ids is None:
            ids = self._slot_ids[key] = torch.arange(info.start, info.start + info.spec.size)
        return ids

    def shadow(self, t: Any) -> Optional[Tensor]:
        """The shadow of ``t`` (canonical: stride 0 exactly along its constant dims), or None."""
        if not isinstance(t, Tensor):
            return None
        entry = self.shadows.get(id(t))
        if entry is None or entry[0]() is not t:
            return None
        return entry[1]

    def _entry(self, t: Tensor) -> Optional[Tuple[Any, Tensor, Tensor]]:
        """(weak ref, shadow, core) of ``t``; the core is the shadow narrowed along its constant dims."""
        entry = self.shadows.get(id(t))
        if entry is None or entry[0]() is not t:
            return None
        return entry

    def set_shadow(
        self, t: Tensor, s: Optional[Tensor], canonical: bool = False, labeled: bool = False, core: Optional[Tensor] = None
    ) -> None:
        """Record ``s`` as the shadow of ``t`` (None or all -1: no channel ids).

        ``canonical``: ``s`` is already canonical; ``labeled``: it has an id >= 0;
        ``core``: its core, if known (implies canonical).
        """
        key = id(t)
        if s is None:
            self.shadows.pop(key, None)
            return
        if s.shape != t.shape:
            raise RuntimeError(f"internal: shadow shape {tuple(s.shape)} != tensor shape {tuple(t.shape)}")
        if core is None:
            if canonical:
                core = _core(s)
            else:
                core = _canonical_core(s)
                if core.shape != s.shape:
                    s = core.expand(s.shape)
        if not labeled and not bool((core >= 0).any()):
            self.shadows.pop(key, None)
            return
        # A weak reference: activations are freed as the model runs (as without tracing);
        # the entry goes with its tensor (an id can be reused by a later tensor).
        shadows = self.shadows

        def _gone(ref: Any, key: int = key) -> None:
            e = shadows.get(key)
            if e is not None and e[0] is ref:
                del shadows[key]

        self.shadows[key] = (weakref.ref(t, _gone), s, core)

    def tie(self, ids: Tensor) -> None:
        """Union each row of a 2-D id tensor into one unit."""
        ids = ids.reshape(ids.shape[0], -1)
        first = ids[:, :1].expand_as(ids)
        self.uf.union_pairs(torch.stack([first.reshape(-1), ids.reshape(-1)], dim=1))

    def union(self, a: Tensor, b: Tensor) -> None:
        self.uf.union_pairs(torch.stack([a.reshape(-1), b.reshape(-1)], dim=1))

    def block(self, ids: Any, reason: str) -> None:
        if isinstance(ids, Tensor):
            ids = _core(ids) if ids.dim() else ids
        else:
            ids = torch.tensor(list(ids), dtype=torch.long)
        self.uf.block(ids, reason)

    def bind(self, x: Any, dim: int, ids: Tensor, what: str = "") -> None:
        """Couple dimension ``dim`` of input ``x`` with a consumer slot's ids."""
        if not isinstance(x, Tensor):
            return
        dim = dim % x.dim()
        if x.shape[dim] != ids.numel():
            self.block(ids, f"input of module '{self.where}' has {x.shape[dim]} channels, expected {ids.numel()}")
            return
        entry = self._entry(x)
        if entry is None:
            self.block(ids, f"input of module '{self.where}' does not come from a prunable layer")
            return
        s = entry[2]
        if s.shape[dim] != x.shape[dim]:  # the same ids along the channel dim: spell them out
            s = s.expand(tuple(x.shape[dim] if i == dim else n for i, n in enumerate(s.shape)))
        if s.numel() == ids.numel():  # labels vary along the channel dim only (the usual case)
            s = s.reshape(-1)
            fixed = s
            self.uf.union_rows(s, ids)
        else:
            s = torch.unique(s.movedim(dim, -1).reshape(-1, ids.numel()), dim=0)
            pairs = torch.stack([s, ids.view(1, -1).expand_as(s)], dim=-1).reshape(-1, 2)
            fixed = pairs[:, 0]
            ids = pairs[:, 1]
            self.uf.union_pairs(pairs)
        # channels fed by a fixed (unlabeled) value cannot go
        self.uf.block(ids, f"input of module '{self.where}' mixes prunable and fixed channels", where_negative=fixed)

    def emit(self, out: Any, dim: int, ids: Tensor) -> None:
        """Label dimension ``dim`` of output ``out`` with a producer slot's ids."""
        if not isinstance(out, Tensor):
            return
        dim = dim % out.dim()
        shape = [1] * out.dim()
        shape[dim] = ids.numel()
        core = ids.view(shape)
        # shadows are never mutated: a zero-copy view; slot ids are distinct, so it is canonical
        if ids.numel() > 1:
            self.set_shadow(out, core.expand(out.shape), core=core, labeled=True)
        else:
            self.set_shadow(out, core.expand(out.shape))

    # ---- hooks
    def _pre(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        self.stack.append(self.names.get(id(module), "?"))
        if id(module) in self._leaves:
            self.leaf_depth += 1

    def _post(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        name = self.stack.pop() if self.stack else "?"
        if id(module) in self._leaves:
            self.leaf_depth -= 1
            if self.leaf_depth == 0:
                self.order.append(name)
                self.stack.append(name)
                try:
                    with torch._C.DisableTorchFunction():  # the handler's own tensor work is not traced
                        self.handlers[name].trace(module, name, self, args, kwargs, output)
                finally:
                    self.stack.pop()

    # ---- ops between leaves
    def on_op(self, func: Any, args: tuple, kwargs: dict, out: Any, name: Optional[str] = None) -> None:
        if name is None:
            name = _op_name(func)
        self.last_op = name
        if (
            len(args) == 1 and not kwargs and name in _SAME_LABELS and isinstance(out, Tensor) and isinstance(args[0], Tensor)
        ):  # relu(x), x.float(), ...: the output has the input's labels (the common case)
            x = args[0]
            entry = self.shadows.get(id(x))
            if entry is None or entry[0]() is not x:
                return  # not a channel tensor: nothing to record
            if out.shape == x.shape:
                self.set_shadow(out, entry[1], core=entry[2], labeled=True)
                return
        ins = [t for t in _tensors((args, kwargs)) if self.shadow(t) is not None]
        if not ins:
            return
        base = name[:-1] if name.endswith("_") and not name.endswith("__") else name
        outs = _tensors(out)
        try:
            if base in POINTWISE:
                self._pointwise(name, args, kwargs, out)
            elif base in SAME:
                entry = self._entry(args[0]) if isinstance(args[0], Tensor) else None
                if isinstance(out, Tensor) and entry is not None and out.shape == args[0].shape:
                    self.set_shadow(out, entry[1], core=entry[2], labeled=True)
            elif base in SHAPE:
                self._shape(func, args, kwargs, out)
            elif base in MULTI:
                res = func(self.shadow(args[0]), *args[1:], **kwargs)
                for o, s in zip(out, res):
                    self.set_shadow(o, s)
            elif base in CAT:
                self._cat(func, args, kwargs, out)
            elif base in SOFTMAX:
                self._softmax(name, args, kwargs, out)
            elif base in REDUCE:
                self._reduce(name, args, kwargs, out)
            elif base in POOL:
                self._pool(name, args, out)
            elif base in MATMUL:
                self._matmul(name, args[0], args[1], out)
            elif base == "scaled_dot_product_attention":
                self._sdpa(args, kwargs, out)
            elif not outs and base not in HARMLESS_MUTATORS and not name.endswith("_") and name not in (
                "__setitem__",
                "copy_",
            ):
                return  # a query (size, dim, item, ...) on a channel tensor: harmless
            else:
                self._unknown(name, ins, outs)
        except TraceError:
            raise
        except Exception as exc:  # a rule failed on an unusual call: be conservative
            logger.debug("shadow rule for %s failed: %s", name, exc)
            self._unknown(name, ins, outs)

    def _unknown(self, name: str, ins: List[Tensor], outs: List[Tensor]) -> None:
        reason = f"op '{name}' in module '{self.where}' is not understood by the channel tracer"
        for t in ins:
            self.block(self.shadow(t), reason)
        for o in outs:
            self.set_shadow(o, None)

    def _operand(self, a: Any, shape: torch.Size) -> Tuple[Optional[Tensor], Optional[torch.Size]]:
        if isinstance(a, Tensor):
            s = self.shadow(a)
            if s is None:
                s = _fixed(a.shape)
            return s, a.shape
        return None, None

    def _pointwise(self, name: str, args: tuple, kwargs: dict, out: Any) -> None:
        if not isinstance(out, Tensor):
            return
        shape = out.shape
        tensors = [a for a in args if isinstance(a, Tensor)] + [a for a in kwargs.values() if isinstance(a, Tensor)]
        if len(tensors) == 1 and tensors[0].shape == shape:  # relu(x), x * 2.0, ...: same labels
            entry = self._entry(tensors[0])
            if entry is None:
                self.set_shadow(out, None)
            else:
                self.set_shadow(out, entry[1], core=entry[2], labeled=True)
            return
        operands = [self._operand(a, shape) for a in list(args) + list(kwargs.values())]
        operands = [(s, sh) for s, sh in operands if s is not None]
        # stored shadows always hold an id >= 0; tensors without one got the all -1 _fixed()
        labeled = [(s, sh) for s, sh in operands if not _is_fixed(s)]
        if not labeled:
            self.set_shadow(out, None)
            return
        full = [s.expand(shape) if s.shape != shape else s for s, _ in labeled]
        # varying dims of each labeled operand (in output coordinates)
        for s, sh in operands:
            if any(s is ls for ls, _ in labeled):
                continue
            # a fixed operand: fine if it is constant along every channel dimension
            nd = len(shape)
            padded = [1] * (nd - len(sh)) + list(sh)
            for ls in full:
                for d in _varying_dims(ls):
                    if padded[d] > 1:
                        self.block(ls, f"op '{name}' in module '{self.where}' combines channels with a fixed tensor that varies along them")
                        break
        full = _squeeze_constant(*full)
        base = full[0]
        for other in full[1:]:
            self.union(base, other)
            base = torch.where(base >= 0, base, other)
            # positions labeled on one side only: the unlabeled side is an activation
            # without channel ids that varies along the channel -> not removable
            one_sided = (full[0] >= 0) != (other >= 0)
            if bool(one_sided.any()):
                self.block(base[one_sided], f"op '{name}' in module '{self.where}' adds channels to fixed values")
        self.set_shadow(out, base.expand(shape))

    def _shape(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        if not isinstance(out, Tensor):
            return
        s_in = self.shadow(args[0])
        if s_in is None:
            self.set_shadow(out, None)
            return
        try:
            res = func(s_in, *args[1:], **kwargs)
        except RuntimeError:  # e.g. view() of an expanded shadow
            res = func(s_in.contiguous(), *args[1:], **kwargs)
        if not isinstance(res, Tensor) or res.shape != out.shape:
            raise RuntimeError("shape rule mismatch")
        name = _op_name(func)
        if name in ("view", "reshape", "unflatten", "view_as", "reshape_as") and len(_varying_dims(res)) > len(
            _varying_dims(s_in)
        ):
            self.block(
                s_in,
                f"op '{name}' in module '{self.where}' splits a channel dimension (e.g. into heads); "
                "register a handler for this module to prune it",
            )
            self.set_shadow(out, None)
            return
        self.set_shadow(out, res)

    def _cat(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        seq = args[0]
        shadows = []
        for t in seq:
            s = self.shadow(t)
            shadows.append(s if s is not None else _fixed(t.shape))
        # positions that came from a fixed tensor stay -1; consumers block them
        if _op_name(func) in ("cat", "concat", "concatenate") and isinstance(out, Tensor) and len(
            {s.dim() for s in shadows}
        ) == 1 and shadows[0].dim():
            cdim = kwargs.get("dim", args[1] if len(args) > 1 else 0) % shadows[0].dim()
            # narrow the dims constant in every piece (not the cat dim): the result is the same view
            narrow = [
                d for d in range(shadows[0].dim()) if d != cdim and all(s.shape[d] > 1 and s.stride(d) == 0 for s in shadows)
            ]
            small = [s for s in shadows]
            for d in narrow:
                small = [s.narrow(d, 0, 1) for s in small]
            res = torch.cat(small, dim=cdim).expand(out.shape)
        else:
            res = func(shadows, *args[1:], **kwargs)
        self.set_shadow(out, res)

    def _softmax(self, name: str, args: tuple, kwargs: dict, out: Any) -> None:
        s = self.shadow(args[0])
        dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
        if dim is None or not isinstance(out, Tensor):
            raise RuntimeError("softmax without dim")
        if (dim % s.dim()) in _varying_dims(s):
            self.block(s, f"op '{name}' in module '{self.where}' normalizes across channels")
            self.set_shadow(out, None)
        else:
            self.set_shadow(out, s, canonical=True)

    def _reduce(self, name: str, args: tuple, kwargs: dict, out: Any) -> None:
        s = self.shadow(args[0])
        dim = kwargs.get("dim", args[1] if len(args) > 1 and not isinstance(args[1], bool) else None)
        keepdim = kwargs.get("keepdim", args[2] if len(args) > 2 and isinstance(args[2], bool) else False)
        value = out[0] if isinstance(out, tuple) else out
        if not isinstance(value, Tensor):
            return
        if name in ("norm",) and dim is None and len(args) > 2:
            dim = args[2]
        dims = list(range(s.dim())) if dim is None else ([dim] if isinstance(dim, int) else list(dim))
        dims = sorted({d % s.dim() for d in dims})
        varying = _varying_dims(s)
        if any(d in varying for d in dims):
            self.block(s, f"op '{name}' in module '{self.where}' reduces across channels")
            self.set_shadow(value, None)
            return
        r = s
        for d in reversed(dims):
            r = r.narrow(d, 0, 1)
            if not keepdim:
                r = r.squeeze(d)
        r = r.reshape(value.shape)
        self.set_shadow(value, r)
        if isinstance(out, tuple):
            for o in out[1:]:
                self.set_shadow(o, None)

    def _pool(self, name: str, args: tuple, out: Any) -> None:
        s = self.shadow(args[0])
        value = out[0] if isinstance(out, tuple) else out
        if s.dim() < 2:
            raise RuntimeError("pool on 1-d")
        # channel-wise ops over trailing spatial dims: labels must not vary spatially
        lead = 2 if value.dim() == s.dim() and s.dim() >= 3 else 1
        if torch.Size(s.shape[lead:]).numel() and any(d >= lead for d in _varying_dims(s)):
            self.block(s, f"op '{name}' in module '{self.where}' pools across channels")
            self.set_shadow(value, None)
            return
        r = s
        for _ in range(lead, s.dim()):
            r = r.select(lead, 0)
        r = r.reshape(r.shape + (1,) * (value.dim() - r.dim())).expand(value.shape)
        self.set_shadow(value, r)
        if isinstance(out, tuple):
            for o in out[1:]:
                self.set_shadow(o, None)

    def _contract(self, name: str, a: Tensor, b: Tensor) -> Tuple[Tensor, Tensor, bool, bool]:
        """Union the contracted dims of a @ b; returns broadcast shadows and whether each varies."""
        sa = self.shadow(a)
        sb = self.shadow(b)
        sa = sa if sa is not None else _fixed(a.shape)
        sb = sb if sb is not None else _fixed(b.shape)
        if sa.dim() < 2 or sb.dim() < 2:
            raise RuntimeError("1-d matmul")
        va = (sa.dim() - 1) in _varying_dims(sa)
        vb = (sb.dim() - 2) in _varying_dims(sb)
        if va or vb:
            # rows of a (..., n, k) against columns of b (..., k, m), per contracted index
            ca = _core(sa, keep=(sa.dim() - 1,))  # constant dims add no new columns
            cb = _core(sb, keep=(sb.dim() - 2,))
            ra = torch.unique(ca.movedim(-1, 0).reshape(ca.shape[-1], -1), dim=1)  # (k, ra)
            rb = torch.unique(cb.movedim(-2, 0).reshape(cb.shape[-2], -1), dim=1)  # (k, rb)
            pa = ra.unsqueeze(2).expand(-1, -1, rb.shape[1])
            pb = rb.unsqueeze(1).expand(-1, ra.shape[1], -1)
            pairs = torch.stack([pa.reshape(-1), pb.reshape(-1)], dim=1)
            one_sided = (pairs[:, 0] >= 0) != (pairs[:, 1] >= 0)
            if bool(one_sided.any()):
                self.block(pairs[one_sided].max(dim=1).values, f"op '{name}' in module '{self.where}' contracts channels with fixed values")
            self.uf.union_pairs(pairs)
        return sa, sb, va, vb

    def _matmul(self, name: str, a: Any, b: Any, out: Any) -> None:
        if name == "__rmatmul__":
            a, b = b, a
        if not (isinstance(a, Tensor) and isinstance(b, Tensor) and isinstance(out, Tensor)):
            raise RuntimeError("matmul operands")
        sa, sb, va, vb = self._contract(name, a, b)
        rows = None if va else sa.narrow(-1, 0, 1)  # (..., n, 1)
        cols = None if vb else sb.narrow(-2, 0, 1)  # (..., 1, m)
        res = self._free_labels(name, rows, cols, out)
        self.set_shadow(out, res)

    def _free_labels(self, name: str, rows: Optional[Tensor], cols: Optional[Tensor], out: Tensor) -> Optional[Tensor]:
        rl = rows is not None and bool((rows >= 0).any())
        cl = cols is not None and bool((cols >= 0).any())
        if rl and cl:
            self.block(rows, f"op '{name}' in module '{self.where}' forms an outer product of channels")
            self.block(cols, f"op '{name}' in module '{self.where}' forms an outer product of channels")
            return None
        if rl:
            return rows.expand(out.shape)
        if cl:
            return cols.expand(out.shape)
        return None

    def _sdpa(self, args: tuple, kwargs: dict, out: Any) -> None:
        names = ["query", "key", "value", "attn_mask"]
        vals = dict(zip(names, args))
        vals.update({k: v for k, v in kwargs.items() if k in names})
        q, k, v = vals["query"], vals["key"], vals["value"]
        self._contract("scaled_dot_product_attention", q, k.transpose(-2, -1))  # q . k over the last dims
        sv = self.shadow(v)
        if sv is None:
            self.set_shadow(out, None)
            return
        if (sv.dim() - 2) in _varying_dims(sv):
            self.block(sv, f"op 'scaled_dot_product_attention' in module '{self.where}' mixes value channels across tokens")
            self.set_shadow(out, None)
            return
        cols = sv.narrow(-2, 0, 1)
        self.set_shadow(out, cols.expand(out.shape))

    # ---- run
    def run(self, example_inputs: Any, ignored: Sequence[str]) -> Any:
        for name, module in self.named:
            h = self.registry.lookup(module)
            # a module inside a handled module is part of it (named_modules lists parents first)
            parts = name.split(".")
            if h is not None and not any(".".join(parts[:i]) in self.handlers for i in range(1, len(parts))):
                self.handlers[name] = h
        self._leaves = {id(self.by_name[n]) for n in self.handlers}
        hooks = []
        for _, module in self.named:
            hooks.append(module.register_forward_pre_hook(self._pre, with_kwargs=True))
            hooks.append(module.register_forward_hook(self._post, with_kwargs=True))
        tracer = self
        op_names: Dict[Any, str] = {}

        class _Mode(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                try:
                    name = op_names[func]
                except (KeyError, TypeError):  # first call of this function (or unhashable)
                    name = _op_name(func)
                    try:
                        op_names[func] = name
                    except TypeError:
                        pass
                try:
                    out = func(*args, **kwargs)
                except Exception as exc:
                    if not hasattr(exc, "_prunekit_op"):
                        exc._prunekit_op = name  # the innermost failing op names the error
                    raise
                tracer.last_op = name
                if tracer.leaf_depth == 0:
                    tracer.on_op(func, args, kwargs, out, name)
                return out

        was_training = [(m, m.training) for _, m in self.named]
        if any(t for _, t in was_training):
            self.model.eval()
        args, kwargs = _split_inputs(example_inputs)
        # No autograd: nothing here needs gradients, and recording them costs about a
        # quarter of the forward pass. Fused inference fast paths (nn.MultiheadAttention,
        # nn.TransformerEncoder[Layer]) stay off: they are skipped whenever a torch function
        # mode is active, and the fast-path switch is turned off as well while tracing.
        fastpath = torch.backends.mha.get_fastpath_enabled()
        try:
            torch.backends.mha.set_fastpath_enabled(False)
            with torch.no_grad(), _Mode():
                output = self.model(*args, **kwargs)
        except TraceError:
            raise
        except Exception as exc:
            failed = getattr(exc, "_prunekit_op", self.last_op)
            raise TraceError(
                f"the model's forward pass failed while prunekit traced it, at op '{failed}' in module "
                f"'{self.where}': {type(exc).__name__}: {exc}. Check that example_inputs are what "
                "model(*example_inputs) accepts."
            ) from exc
        finally:
            torch.backends.mha.set_fastpath_enabled(fastpath)
            for h in hooks:
                h.remove()
            for m, t in was_training:
                if m.training != t:
                    m.training = t
            self.stack.clear()
            self.leaf_depth = 0
        for t in _tensors(_flatten_output(output)):
            s = self.shadow(t)
            if s is not None:
                self.block(s, _OUTPUT_REASON)
        for name in ignored:
            for (mname, sname), info in list(self.slots.items()):
                if mname == name or mname.startswith(name + "."):
                    self.block(self.slot(mname, sname), f"module '{mname}' is in ignored_layers")
            if name in self.handlers:
                for sname in self.handlers[name].slots(self.by_name[name]):
                    self.block(self.slot(name, sname), f"module '{name}' is in ignored_layers")
        self.shadows.clear()
        return output


def _split_inputs(example_inputs: Any) -> Tuple[tuple, dict]:
    if isinstance(example_inputs, dict):
        return (), dict(example_inputs)
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs), {}
    return (example_inputs,), {}


def _flatten_output(output: Any) -> Any:
    if isinstance(output, dict):
        return list(output.values())
    if hasattr(output, "to_tuple"):
        return output.to_tuple()
    return output


def build_dependency_graph(
    model: nn.Module,
    example_inputs: Any,
    *,
    ignored_layers: Optional[Sequence[Any]] = None,
    exact: bool = True,
    registry: Any = None,
) -> DependencyGraph:
    """Trace ``model`` once and return its groups of coupled channels.

    Args:
        model: any ``nn.Module`` (pruned or not).
        example_inputs: a tensor, a tuple of positional inputs, or a dict of keyword inputs.
        ignored_layers: modules (or their names) left exactly as they are; every group
            touching them is blocked. ``None`` (default) means the final classifier: its
            outputs are model outputs and are never pruned, while its input columns follow
            the layer before it (pass ``[model.fc]`` to freeze those too).
        exact: if True (default), groups whose removal would change the masked model's
            output (e.g. features normalized by a LayerNorm) are blocked.
        registry: a :class:`~prunekit.compact.handlers.HandlerRegistry` (default: the global one).

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from prunekit.compact import build_dependency_graph
        >>> m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        >>> g = build_dependency_graph(m, torch.randn(2, 8))
        >>> [len(grp.units) for grp in g.prunable_groups()]
        [16]
    """
    from .handlers import REGISTRY

    if not isinstance(model, nn.Module):
        raise TypeError(f"build_dependency_graph expects an nn.Module, got {type(model).__name__}")
    registry = registry or REGISTRY
    tracer = Tracer(model, registry, exact=exact)
    names = tracer.names
    explicit: List[str] = []
    for layer in ignored_layers or ():
        if isinstance(layer, str):
            try:
                model.get_submodule(layer)
            except AttributeError:
                raise ValueError(f"ignored_layers: the model has no module named {layer!r}") from None
            explicit.append(layer)
        elif isinstance(layer, nn.Module):
            if id(layer) not in names:
                raise ValueError(f"ignored_layers: {type(layer).__name__} module is not part of this model")
            explicit.append(names[id(layer)])
        else:
            raise TypeError(f"ignored_layers must hold modules or module names, got {type(layer).__name__}")
    # The build allocates many short-lived objects and frees them in order; the cyclic
    # collector would only rescan them (about a tenth of the build), so it is paused.
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        tracer.run(example_inputs, explicit)
        ignored = list(explicit)
        if ignored_layers is None:
            # The final classifier keeps its outputs (they are the model's outputs and were
            # blocked above); its input columns follow the layer before it.
            ignored = _default_final_layers(tracer)
        return _collect(tracer, tuple(ignored))
    finally:
        if gc_was_enabled:
            gc.enable()


def check_graph(graph: Any, model: nn.Module, ignored_layers: Optional[Sequence[Any]] = None) -> None:
    """Raise unless ``graph`` was built for ``model`` as it is now (same module shapes).

    ``ignored_layers`` must be None: a graph already fixes which layers are ignored.
    """
    if not isinstance(graph, DependencyGraph):
        raise TypeError(f"graph must be a DependencyGraph from build_dependency_graph, got {type(graph).__name__}")
    if graph.model is not model:
        raise ValueError(
            f"graph was built for another model ({type(graph.model).__name__} object at {id(graph.model):#x}); "
            "build it for this one: build_dependency_graph(model, example_inputs)"
        )
    if ignored_layers is not None:
        raise ValueError(
            "pass ignored_layers to build_dependency_graph(model, x, ignored_layers=...), not together with graph=: "
            f"the graph already ignores {list(graph.ignored)}"
        )
    sizes: Dict[str, Dict[str, Any]] = {}
    for (mname, sname), info in graph.slots.items():
        try:
            if mname not in sizes:
                sizes[mname] = graph.handlers[mname].slots(graph.module(mname))
            now = sizes[mname][sname].size
        except (AttributeError, KeyError):
            now = None
        if now != info.spec.size:
            raise ValueError(
                f"graph is stale: slot {sname!r} of module {mname!r} had {info.spec.size} channels when the graph "
                f"was built and has {now} now (the model was compacted or edited since); rebuild it with "
                "build_dependency_graph(model, example_inputs)"
            )


def _collect(tracer: Tracer, ignored: Tuple[str, ...]) -> DependencyGraph:
    """Units (components of slot ids) grouped by the slots they span and their blocked reason.

    Units are ordered by their smallest id and groups by their first unit, i.e. by the
    order in which the slots were first seen.
    """
    uf = tracer.uf
    roots = uf.solve()
    keys = list(tracer.slots)
    if not keys:
        return DependencyGraph(tracer.model, [], tracer.slots, tracer.handlers, ignored)
    infos = [tracer.slots[k] for k in keys]
    starts = torch.tensor([i.start for i in infos])
    sizes = torch.tensor([i.spec.size for i in infos])
    if [i.start for i in infos] == list(itertools.accumulate([0] + [i.spec.size for i in infos[:-1]])):
        ids = torch.arange(int(sizes.sum()))  # slots own consecutive id ranges, in the order seen
    else:
        ids = torch.cat([torch.arange(i.start, i.start + i.spec.size) for i in infos])
    slot_no = torch.repeat_interleave(torch.arange(len(keys)), sizes)
    index = ids - torch.repeat_interleave(starts, sizes)  # position inside its slot
    r = roots[ids]
    # sort by (root, slot, index): consecutive runs are one unit's members
    order = torch.argsort((r * len(keys) + slot_no) * (int(sizes.max()) + 1) + index)
    r, slot_no, index = r[order], slot_no[order], index[order]
    # runs of equal (root, slot): one member tensor each
    run_key = r * len(keys) + slot_no
    run_start = torch.ones_like(run_key, dtype=torch.bool)
    run_start[1:] = run_key[1:] != run_key[:-1]
    starts_at = run_start.nonzero().view(-1)
    run_len = torch.diff(torch.cat([starts_at, torch.tensor([run_key.numel()])])).tolist()
    run_root = r[starts_at]
    # runs of equal root: one unit each
    unit_start = torch.ones_like(run_root, dtype=torch.bool)
    unit_start[1:] = run_root[1:] != run_root[:-1]
    first_run = unit_start.nonzero().view(-1)
    n_units = int(first_run.numel())
    unit_of_run = torch.cumsum(unit_start, 0) - 1
    # A unit's signature: its set of slots and its blocked reason. Units are grouped by a
    # random 63-bit hash of the slot set, then every group is checked exactly (no reliance
    # on the hash being collision-free).
    run_slot_t = slot_no[starts_at]
    weights = torch.randint(1, 2**62, (len(keys),), generator=torch.Generator().manual_seed(0))
    h = torch.zeros(n_units, dtype=torch.long).index_add_(0, unit_of_run, weights[run_slot_t])
    reasons = list(dict.fromkeys(uf.blocked.values()))
    reason_of_root = torch.full((uf.n,), -1, dtype=torch.long)
    if uf.blocked:
        reason_no = {r: i for i, r in enumerate(reasons)}
        reason_of_root[torch.tensor(list(uf.blocked))] = torch.tensor([reason_no[r] for r in uf.blocked.values()])
    unit_root_t = run_root[first_run]
    _, h_id = torch.unique(h, return_inverse=True)
    _, sig_of_unit = torch.unique(h_id * (len(reasons) + 1) + reason_of_root[unit_root_t] + 1, return_inverse=True)
    # exact check: same run count and the same slot sequence as the group's first unit
    n_runs = torch.diff(torch.cat([first_run, torch.tensor([run_root.numel()])]))
    first_of_sig = torch.full((int(sig_of_unit.max()) + 1,), n_units, dtype=torch.long)
    first_of_sig.scatter_reduce_(0, sig_of_unit, torch.arange(n_units), reduce="amin")
    ref = first_of_sig[sig_of_unit]  # per unit: the first unit of its group
    exact = bool((n_runs == n_runs[ref]).all())
    if exact:
        pos = torch.arange(run_slot_t.numel()) - first_run[unit_of_run]
        exact = bool((run_slot_t == run_slot_t[first_run[ref[unit_of_run]] + pos]).all())
    if not exact:  # a hash collision: signatures as tuples instead
        run_slot = run_slot_t.tolist()
        sig_keys: Dict[Tuple[Any, ...], int] = {}
        ids_list = [
            sig_keys.setdefault((tuple(run_slot[lo:hi]), r), len(sig_keys))
            for lo, hi, r in zip(first_run.tolist(), first_run.tolist()[1:] + [run_root.numel()], reason_of_root[unit_root_t].tolist())
        ]
        sig_of_unit = torch.tensor(ids_list)
    # groups in the order of their first unit; units of a group in order
    n_sig = int(sig_of_unit.max()) + 1
    if not exact:
        first_of_sig = torch.full((n_sig,), n_units, dtype=torch.long)
        first_of_sig.scatter_reduce_(0, sig_of_unit, torch.arange(n_units), reduce="amin")
    sig_order = torch.argsort(first_of_sig)
    rank = torch.empty_like(sig_order)
    rank[sig_order] = torch.arange(n_sig)
    unit_rank = rank[sig_of_unit]
    unit_order = torch.argsort(unit_rank, stable=True)
    per_group = torch.bincount(unit_rank, minlength=n_sig).tolist()
    # the runs in group order (units of a group in order, a unit's runs in slot order), so
    # each group's members are one contiguous stretch of ``pieces``
    runs_sorted = n_runs[unit_order]
    run_perm = torch.repeat_interleave(first_run[unit_order] - (torch.cumsum(runs_sorted, 0) - runs_sorted), runs_sorted)
    run_perm += torch.arange(run_perm.numel())
    # one index tensor per (unit, slot); single indices share one tensor per value
    singles = torch.arange(int(sizes.max())).view(-1, 1).unbind()
    if max(run_len) == 1:  # every run is one id: runs and ids coincide
        pieces = list(map(singles.__getitem__, index[run_perm].tolist()))
    else:
        split = list(torch.split(index, run_len))
        for k in (torch.tensor(run_len) == 1).nonzero().view(-1).tolist():
            split[k] = singles[int(split[k])]
        pieces = list(map(split.__getitem__, run_perm.tolist()))
    run_slot = run_slot_t.tolist()
    first_units = first_of_sig[sig_order]
    unit_roots = unit_root_t[first_units].tolist()
    lo_of_first = first_run[first_units].tolist()
    runs_of_first = n_runs[first_units].tolist()
    groups: List[Group] = []
    pos = 0
    for gi, count in enumerate(per_group):
        lo0, k = lo_of_first[gi], runs_of_first[gi]
        # members in slot order, as the slots were first seen
        names = tuple(keys[i] for i in run_slot[lo0 : lo0 + k])
        # units are built on first access (Group.units): most callers need only member_index()
        groups.append(Group._lazy(tuple(sorted(names)), names, pieces[pos : pos + count * k], count, uf.blocked.get(unit_roots[gi])))
        pos += count * k
    return DependencyGraph(tracer.model, groups, tracer.slots, tracer.handlers, ignored)


def _default_final_layers(tracer: Tracer) -> List[str]:
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
        if info.spec.size and blocked.get(int(roots[info.start])) != _OUTPUT_REASON:
            continue  # cheap early reject: its first channel is not an output channel
        mine = roots[info.start : info.start + info.spec.size]
        uniq = set(mine.tolist())
        if len(uniq) != info.spec.size // max(info.spec.tie, 1):
            continue  # coupled with something else
        if not all(blocked.get(r) == _OUTPUT_REASON for r in uniq):
            continue
        # alone: no id of any other slot shares a component with these outputs
        mark = torch.zeros(roots.numel(), dtype=torch.bool)
        mark[mine] = True
        hits = mark[roots]
        hits[info.start : info.start + info.spec.size] = False
        if not bool(hits.any()):
            return [mname]
    return []


_OUTPUT_REASON = "these channels are part of the model's output"
