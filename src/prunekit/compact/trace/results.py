"""What dependency analysis returns: units, groups and the graph that holds them."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Dict, Iterator, List, Optional, Tuple

import torch
from torch import Tensor, nn

if TYPE_CHECKING:  # pragma: no cover
    from ..handlers.base import Entry, ModuleHandler, Slot

__all__ = ["DependencyGraph", "Group", "SlotInfo", "Unit"]


@dataclass(slots=True)  # no per-instance __dict__: a graph holds thousands of units
class Unit:
    """One removable piece: a channel, a head or a group of a grouped conv.

    ``members`` maps ``(module_name, slot_name)`` to the indices of that slot in this unit.
    """

    members: Dict[Tuple[str, str], Tensor]  # read-only: units may share index tensors

    def width(self) -> int:
        """Channels per unit in its widest slot (32 for a 32-dim head)."""
        return max(int(v.numel()) for v in self.members.values())


class _Runs:
    """Every group's unit members of one graph in one flat tensor (built by ``grouping.collect``).

    Runs are (unit, slot) pieces in group order -- the units of a group in order, a unit's
    runs in the group's slot order -- so group ``g`` owns runs ``[start, start + count * k)``
    with ``k`` slots; run ``r`` holds ``flat[off[r] : off[r] + lens[r]]`` (slot-local indices).
    """

    __slots__ = ("flat", "off", "lens", "ones", "_singles")

    def __init__(self, flat: Tensor, off: Tensor, lens: Tensor, ones: bool) -> None:
        self.flat, self.off, self.lens, self.ones = flat, off, lens, ones  # ones: every run is one index
        self._singles: Optional[Tuple[Tensor, ...]] = None

    def pieces(self, lo: int, hi: int) -> List[Tensor]:
        """Runs ``lo..hi-1`` as index tensors (single indices share one tensor per value)."""
        if self.ones:
            values = self.flat[lo:hi].tolist()
            if self._singles is None or len(self._singles) <= max(values, default=0):
                self._singles = torch.arange(int(self.flat.max()) + 1 if self.flat.numel() else 1).view(-1, 1).unbind()
            return list(map(self._singles.__getitem__, values))
        off, lens = self.off[lo:hi].tolist(), self.lens[lo:hi].tolist()
        return [self.flat[o : o + n] for o, n in zip(off, lens)]

    def member(self, runs: Tensor) -> Tuple[Tensor, Tensor]:
        """The indices of ``runs`` concatenated, and the position (in ``runs``) of each."""
        if self.ones:
            return self.flat.index_select(0, runs), torch.arange(runs.numel())
        lens = self.lens.index_select(0, runs)
        before = torch.cumsum(lens, 0) - lens
        pos = torch.arange(int(lens.sum())) - torch.repeat_interleave(before - self.off.index_select(0, runs), lens)
        return self.flat.index_select(0, pos), torch.repeat_interleave(torch.arange(runs.numel()), lens)


class Group:
    """Units that span the same layer dimensions (e.g. conv1.out + bn1 + conv2.in).

    ``units`` is built on first access (a graph can hold thousands); ``member_index()``,
    ``n_units``, ``unit_width`` and ``slots`` never need it.
    """

    __hash__ = None  # type: ignore[assignment]  # mutable, compared by value

    def __init__(
        self, slots: Tuple[Tuple[str, str], ...], units: Optional[List[Unit]], blocked: Optional[str] = None
    ) -> None:
        self.slots = slots
        self.blocked = blocked  # reason this group cannot be pruned, or None
        self._units = units
        # deferred units: (member keys in order, the graph's runs, first run, units) -- see grouping.collect
        self._deferred: Optional[Tuple[Tuple[Tuple[str, str], ...], _Runs, int, int]] = None
        self._index: Optional[Dict[Tuple[str, str], Tuple[Tensor, Tensor]]] = None

    @classmethod
    def _lazy(
        cls, slots: Tuple[Tuple[str, str], ...], names: Tuple[Tuple[str, str], ...], runs: _Runs, start: int,
        count: int, blocked: Optional[str],
    ) -> "Group":
        g = cls(slots, None, blocked)
        g._deferred = (names, runs, start, count)
        return g

    @property
    def units(self) -> List[Unit]:
        if self._units is None:
            names, runs, start, count = self._deferred  # type: ignore[misc]
            pieces = runs.pieces(start, start + count * len(names))
            rows = zip(*[iter(pieces)] * len(names))  # one unit's pieces per row
            self._units = list(map(Unit, map(dict, map(zip, itertools.repeat(names, count), rows))))
            self._deferred = None
        return self._units

    @units.setter
    def units(self, value: List[Unit]) -> None:
        self._units, self._deferred, self._index = value, None, None

    @property
    def n_units(self) -> int:
        """``len(group.units)``, without building the units."""
        return self._deferred[3] if self._deferred is not None else len(self._units or ())

    @property
    def unit_width(self) -> int:
        """``group.units[0].width()`` (0 without units), without building the units."""
        if self._deferred is not None:
            names, runs, start, count = self._deferred
            if not count:
                return 0
            return 1 if runs.ones else int(runs.lens[start : start + len(names)].max())
        return self._units[0].width() if self._units else 0

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
                names, runs, start, count = self._deferred
                k = len(names)
                for j, key in enumerate(names):
                    index[key] = runs.member(torch.arange(start + j, start + count * k, k))
            else:
                units = self._units or []
                keys = units[0].members if units else ()
                for key in keys:
                    parts = [u.members[key] for u in units]
                    counts = torch.tensor([int(p.numel()) for p in parts])
                    index[key] = (torch.cat(parts), torch.repeat_interleave(torch.arange(len(parts)), counts))
            self._index = index
        return self._index

    def __eq__(self, other: object) -> bool:
        if other.__class__ is not self.__class__:
            return NotImplemented
        return (self.slots, self.units, self.blocked) == (other.slots, other.units, other.blocked)

    def __repr__(self) -> str:
        names = ", ".join(f"{m}.{s}" for m, s in self.slots[:6])
        more = f", +{len(self.slots) - 6}" if len(self.slots) > 6 else ""
        state = "prunable" if self.blocked is None else f"blocked: {self.blocked}"
        return f"Group({self.n_units} units x{self.unit_width} [{names}{more}]; {state})"


@dataclass
class SlotInfo:
    """Where one slot of one module lives among the tracer's channel ids."""

    module_name: str
    slot_name: str
    start: int
    spec: "Slot"


@dataclass
class DependencyGraph:
    """The result of :func:`build_dependency_graph`."""

    model: nn.Module
    groups: List[Group]
    slots: Dict[Tuple[str, str], SlotInfo]
    handlers: Dict[str, "ModuleHandler"]  # module name -> handler
    ignored: Tuple[str, ...] = ()
    options: Dict[str, Any] = field(default_factory=dict)  # build_dependency_graph's choices (gqa)
    #: per channel id: the constant its reader sees (NaN: unknown); None when masks made nothing constant
    read_values: Optional[Tensor] = None
    #: handled modules in the order they ran
    order: List[str] = field(default_factory=list)

    def reads(self, mname: str, sname: str, idx: Tensor) -> Optional[Tensor]:
        """The constants reader slot ``(mname, sname)`` sees at indices ``idx`` (NaN: unknown), or None."""
        if self.read_values is None:
            return None
        return self.read_values[self.slots[(mname, sname)].start + idx]

    def prunable_groups(self) -> List[Group]:
        return [g for g in self.groups if g.prunable]

    def module(self, name: str) -> nn.Module:
        return self.model.get_submodule(name) if name else self.model

    def entries(self, group: Group) -> Iterator[Tuple[str, "Entry", Tensor, Tensor]]:
        """``(module name, Entry, tensor indices, unit number of each index)`` for every
        weight/bias/norm tensor ``group`` spans (running-stat buffers are skipped)."""
        for (mname, sname), (idx, unit_of) in group.member_index().items():
            for e in self.slots[(mname, sname)].spec.entries:
                if e.role != "buffer":
                    yield mname, e, idx + e.offset if e.offset else idx, unit_of
