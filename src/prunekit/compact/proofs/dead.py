"""Which units are dead: removing them cannot change the masked model's output.

One propagation decides it (the constants of :mod:`prunekit.compact.proofs.constants`, recorded
while the model was traced). A unit -- a channel, a head, a group of a grouped conv,
coupled across every layer it spans -- can go when, at every layer that *reads* it:

* the reader's input columns are zero there (masked), or
* the value it reads is provably zero (its producer's rows and bias are masked, or a
  normalization's scale and shift, and every operation on the way keeps zero at zero), or
* the value is provably a constant that the reader folds exactly into its bias (a
  Linear; a convolution whose padding cannot make the constant position-dependent).

A unit nothing reads (the query/key dims of a head) must be zero in every tensor it
spans. Every unit that is masked somewhere but stays gets a reason.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple, Union

import torch
from torch import Tensor

from .. import weights

if TYPE_CHECKING:  # pragma: no cover - the graph is handed in; proofs sit below the tracer that builds it
    from ..trace.results import DependencyGraph, Group

__all__ = ["Fold", "NonZero", "Verdict", "dead_units", "zero_units"]

_NAN = float("nan")


class NonZero:
    """Cache: for (module, tensor path, axis), which indices have any non-zero value."""

    def __init__(self, graph: DependencyGraph) -> None:
        self.graph = graph
        self.cache: Dict[Tuple[Any, ...], Tensor] = {}  # (module, path, axis) or ("mask", module, path, axis)
        self._folds: Dict[Tuple[str, str], Union[str, list]] = {}
        self._axes_of: Optional[Dict[Tuple[str, str], set]] = None

    def _axes(self) -> Dict[Tuple[str, str], set]:
        """Per (module, tensor path), the axes :func:`dead_units` may ask about."""
        if self._axes_of is None:
            self._axes_of = {}
            for (mname, _), info in self.graph.slots.items():
                for e in info.spec.entries:
                    if e.role != "buffer":
                        self._axes_of.setdefault((mname, e.path), set()).add(e.axis)
        return self._axes_of

    def __call__(self, mname: str, path: str, axis: int) -> Tensor:
        key = (mname, path, axis)
        if key not in self.cache:
            # the effective value is computed once for every axis the graph's slots index
            # (one group reads a weight's rows, the next its columns)
            nonzero = weights.read_only(self.graph.module(mname), path) != 0
            axis %= max(nonzero.dim(), 1)
            for a in {axis} | {a % max(nonzero.dim(), 1) for a in self._axes().get((mname, path), ())}:
                self.cache[(mname, path, a)] = _any_along(nonzero, a)
            self.cache[key] = self.cache[(mname, path, axis)]
        return self.cache[key]

    def masked(self, mname: str, path: str, axis: int) -> Tensor:
        """Per index along ``axis``: whether the tensor's mask is zero at every entry there (all False
        for a tensor without a mask). A zero that no mask put there (a bias initialised to 0) is not masked."""
        key = ("mask", mname, path, axis)
        if key not in self.cache:
            mask = weights.mask_of(self.graph.module(mname), path)
            if mask is None:
                self.cache[key] = torch.zeros_like(self(mname, path, axis))
            else:
                self.cache[key] = ~_any_along(mask != 0, axis % max(mask.dim(), 1))
        return self.cache[key]

    def fold(self, mname: str, sname: str) -> Union[str, list]:
        """The reader's fold rules for a constant input (a list), or why it cannot (a string)."""
        key = (mname, sname)
        if key not in self._folds:
            module = self.graph.module(mname)
            rule = self.graph.handlers[mname].fold_constant(module, sname)
            if isinstance(rule, list):
                masked = [b for _, _, _, b in rule if weights.is_masked(module, b)]
                if masked:
                    rule = f"'{mname}.{masked[0]}' is masked, so a constant folded into it would be lost"
            self._folds[key] = rule
        return self._folds[key]


@dataclass
class Fold:
    """Constants removed units leave behind at one reader: ``values[i]`` at slot index ``index[i]``."""

    module: str
    slot: str
    index: Tensor
    values: Tensor
    rules: list


@dataclass
class Verdict:
    """What the propagation decided for one group's units."""

    removable: Tensor  # bool per unit
    partial: Tensor  # bool per unit: masked in some tensor it spans, or read as a constant its masks make
    folds: List[Fold] = field(default_factory=list)  # for the removable units
    reasons: Dict[int, str] = field(default_factory=dict)  # kept units that are partly masked: why


def _any_along(nonzero: Tensor, axis: int) -> Tensor:
    """``nonzero.movedim(axis, 0).reshape(n, -1).any(1)`` without the copy ``movedim`` forces."""
    shape = nonzero.shape
    pre = 1
    for d in shape[:axis]:
        pre *= d
    return nonzero.reshape(pre, shape[axis], -1).any(dim=2).any(dim=0)


def _per_unit_all(ok: Tensor, unit_of: Tensor, n: int) -> Tensor:
    bad = torch.zeros(n, dtype=torch.long).index_add_(0, unit_of, (~ok).long())
    return bad == 0


def _per_unit_any(hit: Tensor, unit_of: Tensor, n: int) -> Tensor:
    return torch.zeros(n, dtype=torch.long).index_add_(0, unit_of, hit.long()) > 0


def dead_units(graph: DependencyGraph, group: Group, nz: Optional[NonZero] = None, explain: bool = True) -> Verdict:
    """The :class:`Verdict` for ``group`` (see the module docstring).

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> from prunekit.compact import build_dependency_graph
        >>> m = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
        >>> with torch.no_grad():
        ...     m[2].weight[:, 0] = 0
        >>> g = build_dependency_graph(m, torch.randn(1, 4))
        >>> dead_units(g, g.prunable_groups()[0]).removable.tolist()
        [True, False, False]
    """
    nz = nz or NonZero(graph)
    n = group.n_units
    readers_ok = torch.ones(n, dtype=torch.bool)
    others_zero = torch.ones(n, dtype=torch.bool)
    partial = torch.zeros(n, dtype=torch.bool)
    has_readers = has_others = False
    readers: List[Tuple[str, str, Tensor, Tensor, Tensor, Tensor, Union[str, list], Tensor]] = []
    for (mname, sname), (idx, unit_of) in group.member_index().items():
        spec = graph.slots[(mname, sname)].spec
        reads = [e for e in spec.entries if e.role == "in"]
        for e in spec.entries:
            if e.role in ("in", "buffer"):
                continue
            others_zero &= _per_unit_all(~nz(mname, e.path, e.axis)[idx + e.offset], unit_of, n)
            partial |= _per_unit_all(nz.masked(mname, e.path, e.axis)[idx + e.offset], unit_of, n)
            has_others = True
        if not reads:
            continue
        has_readers = True
        colzero = torch.ones(idx.numel(), dtype=torch.bool)
        for e in reads:
            colzero &= ~nz(mname, e.path, e.axis)[idx + e.offset]
        vals = graph.reads(mname, sname, idx)
        if vals is None:
            ok = colzero
            rule: Union[str, list] = ""
            vals = torch.full((idx.numel(),), _NAN, dtype=torch.float64)
        else:
            known = ~torch.isnan(vals)
            need = known & (vals != 0) & ~colzero
            rule = nz.fold(mname, sname) if bool(need.any()) else []
            ok = colzero | (known & (vals == 0)) | (need & isinstance(rule, list))
            partial |= _per_unit_any(known, unit_of, n)
        colmasked = torch.zeros(idx.numel(), dtype=torch.bool)
        for e in reads:
            colmasked |= nz.masked(mname, e.path, e.axis)[idx + e.offset]
        partial |= _per_unit_any(colmasked, unit_of, n)
        readers_ok &= _per_unit_all(ok, unit_of, n)
        readers.append((mname, sname, idx, unit_of, colzero, vals, rule, ok))
    removable = readers_ok if has_readers else (others_zero & has_others)
    verdict = Verdict(removable, partial)
    for mname, sname, idx, unit_of, colzero, vals, rule, ok in readers:
        need = removable[unit_of] & ~colzero & ~torch.isnan(vals) & (vals != 0)
        if bool(need.any()) and isinstance(rule, list):
            verdict.folds.append(Fold(mname, sname, idx[need], vals[need], rule))
    if explain:
        verdict.reasons = _why_kept((partial & ~removable).nonzero().view(-1).tolist(), readers, has_readers)
    return verdict


def _why_kept(units: List[int], readers: List[Any], has_readers: bool) -> Dict[int, str]:
    """Why each of ``units`` stays: the first reader (in order) that reads it with a value not
    proved zero or foldable, at the first such index -- for all units in one pass per reader."""
    if not has_readers:
        return {u: "nothing reads it, but it is not zero in every tensor it spans (mask all of it)" for u in units}
    todo = set(units)
    why: Dict[int, str] = {}
    for mname, sname, idx, unit_of, colzero, vals, rule, ok in readers:
        if not todo:
            break
        bad = (~ok).nonzero().view(-1)
        first: Dict[int, int] = {}
        for i, u in zip(bad.tolist(), unit_of[bad].tolist()):
            if u in todo and u not in first:
                first[u] = i
        if not first:
            continue
        at, value = idx[list(first.values())].tolist(), vals[list(first.values())].tolist()
        for (u, _), j, v in zip(first.items(), at, value):
            where = f"'{mname}' ({sname} index {int(j)})"
            if v != v:  # NaN: unknown
                why[u] = (f"{where} reads it with weights that are not masked, and nothing proves its value there "
                          "constant (mask the producer's rows and bias, or these input columns)")
            else:
                why[u] = f"it holds the constant {v:.6g} where {where} reads it, but {rule}"
        todo -= first.keys()
    return {u: why.get(u, "kept") for u in units}


def zero_units(graph: DependencyGraph) -> Dict[int, List[int]]:
    """For each group index, the indices of its units that :func:`compact` would remove.

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> from prunekit.compact import build_dependency_graph, prune_groups, zero_units
        >>> m = nn.Sequential(nn.Linear(8, 4), nn.ReLU(), nn.Linear(4, 2))
        >>> with torch.no_grad():
        ...     m[2].weight[:, 1] = 0
        >>> zero_units(build_dependency_graph(m, torch.randn(1, 8)))
        {1: [1]}
    """
    nz = NonZero(graph)
    out: Dict[int, List[int]] = {}
    for gi, g in enumerate(graph.groups):
        if not g.prunable:
            continue
        idx = dead_units(graph, g, nz, explain=False).removable.nonzero().view(-1).tolist()
        if idx:
            out[gi] = idx
    return out
