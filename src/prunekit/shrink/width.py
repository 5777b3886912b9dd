"""Width: the hidden size, attention heads (key/value groups) and FFN neurons of a model's blocks.

The axes come from the model's dependency graph (:func:`prunekit.compact.build_dependency_graph`,
traced with ``exact=False`` so that the residual stream is prunable through its norms):

* ``"hidden"`` -- the one group that spans every block: the residual stream (embeddings, every
  norm, every reader and writer of the stream, the LM head);
* ``"heads"`` -- each block's attention heads (key/value groups with their query heads);
* ``"ffn"`` -- each block's feed-forward neurons; other per-block groups (e.g. a shared expert's
  neurons) are axes named by their path inside the block (``"mlp.shared_expert"``).

Importance is measured on calibration activations, as Minitron does: a hidden channel by the
L2 norm of its values after every norm of the stream, a head or neuron by the L2 norm of its
activations where its reader (``o_proj``, ``down_proj``) takes them in; padding is left out.

:meth:`Width.emulated` runs the model as if units were removed, without changing a weight (the
search scores candidates this way): removed heads and neurons are zeroed where their readers take
them in, and every norm of the stream computes on the kept channels only, which is what the
smaller model computes. Removing hidden channels cannot be exact through RMSNorm/LayerNorm (the
norm's statistics change): the smaller model is an approximation by design, and the emulation
reproduces that approximation, not the dense model. :meth:`Width.apply` removes the units for real.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..compact import build_dependency_graph
from ..compact.hf_config import FAMILIES as CONFIG_FAMILIES
from ..compact.hf_config import apply_config, scaled_embeddings
from ..compact.surgery.journal import Journal
from ..compact.selection.prune import GroupDecision
from ..compact.removal import remove_units
from ..compact.trace.results import DependencyGraph, Group
from ..transaction import run_then_clean
from ..kernels.lstsq import obs_removal_order
from .calibration import forward, input_moments, token_mask
from .families import family_of, layer_list

logger = logging.getLogger(__name__)

__all__ = ["Width", "WidthAxis"]

HIDDEN, HEADS, FFN = "hidden", "heads", "ffn"
#: "auto" importance uses OBS for a reader when units x inputs^2 (its float64 work) is at most this
OBS_BUDGET = 4e9
# A layer that reads a width axis: an nn.Linear, or a transformers Conv1D (GPT-2's; weight (in, out)), which
# has no class to name here, so readers are used by their weight and bias
Reader = Any


@dataclass
class WidthAxis:
    """One width axis: a group per block (or the one hidden group), all of the same size."""

    name: str
    groups: List[Group]
    units: int  # units per group
    unit_width: int  # channels per unit
    scores: List[Tensor] = field(default_factory=list)  # importance of each unit, one tensor per group

    def removed(self, keep: int) -> List[List[int]]:
        """Per group, the ``units - keep`` least important units (ties: the lower index stays)."""
        if not 1 <= keep <= self.units:
            raise ValueError(f"prunekit.shrink: {self.name} keeps {keep} of {self.units} units; keep between 1 and "
                             f"{self.units}")
        if not self.scores:
            raise ValueError(f"prunekit.shrink: the {self.name} axis has no importance yet; call Width.score first")
        out = []
        for s in self.scores:
            order = torch.argsort(-s.double(), stable=True)  # most important first
            out.append(sorted(order[keep:].tolist()))
        return out


def _block_of(name: str, prefix: str) -> Optional[Tuple[int, str]]:
    """``(block index, path inside the block)`` of a module name under ``prefix.<i>.``, or None."""
    if not name.startswith(prefix + "."):
        return None
    head, _, rest = name[len(prefix) + 1:].partition(".")
    return (int(head), rest) if head.isdigit() else None


def _axis_name(model_type: str, slots: List[Tuple[str, str]], inner: List[str]) -> str:
    if any(s == "heads" for _, s in slots):
        return HEADS
    family = CONFIG_FAMILIES.get(model_type)
    if family is not None and any(re.search(p, "." + path) for p in family.ffn_modules for path in inner):
        return FFN
    prefix = os.path.commonprefix([p + "." for p in inner]).rpartition(".")[0]
    return prefix or inner[0]


class Width:
    """The width axes of a Hugging Face model, their importance, emulation and removal.

    Examples:
        >>> import transformers
        >>> cfg = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
        ...                                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
        >>> model = transformers.LlamaForCausalLM(cfg).eval()
        >>> batch = {"input_ids": torch.arange(8).view(1, 8)}
        >>> width = Width(model, batch)
        >>> {name: (a.units, a.unit_width, len(a.groups)) for name, a in width.axes.items()}
        {'hidden': (16, 1, 1), 'heads': (2, 8, 2), 'ffn': (32, 1, 2)}
    """

    def __init__(self, model: nn.Module, example: Any, *, gqa: str = "groups") -> None:
        self.model = model
        self.model_type, self.family = family_of(model)
        self.blocks_name, self.blocks = layer_list(model)
        self.graph: DependencyGraph = build_dependency_graph(model, example, exact=False, gqa=gqa)
        found: Dict[str, List[Group]] = {}
        for g in self.graph.prunable_groups():
            where = [_block_of(m, self.blocks_name) for m, _ in g.slots]
            blocks = {w[0] for w in where if w is not None}
            if len(blocks) > 1:
                found.setdefault(HIDDEN, []).append(g)
            elif len(blocks) == 1 and None not in where:
                found.setdefault(_axis_name(self.model_type, list(g.slots), [w[1] for w in where if w]), []).append(g)
        self.axes: Dict[str, WidthAxis] = {}
        for name, groups in found.items():
            sizes = {(g.n_units, g.unit_width) for g in groups}
            if name == HIDDEN and len(groups) > 1:
                logger.info("shrink: %d groups span several blocks; the hidden size is not an axis", len(groups))
                continue
            if len(sizes) > 1:
                logger.info("shrink: the %s groups differ in size between blocks (%s); not an axis", name, sorted(sizes))
                continue
            (units, width), = sizes
            self.axes[name] = WidthAxis(name, groups, units, width)

    # ------------------------------------------------------------------ what is where
    def _readers(self, g: Group) -> List[Tuple[Reader, Tensor, Tensor]]:
        """``(reader module, input features, unit of each)`` of a per-block group: where its units are read."""
        out = []
        for mname, e, idx, unit_of in self.graph.entries(g):
            if e.role != "in" or not e.path.endswith("weight"):
                continue
            owner = self.graph.module(mname)
            prefix = e.path.rpartition(".")[0]
            reader = owner.get_submodule(prefix) if prefix else owner
            in_axis = 1 if isinstance(reader, nn.Linear) else 0 if type(reader).__name__ == "Conv1D" else None
            if in_axis is None or e.axis != in_axis:
                raise ValueError(f"prunekit.shrink: {mname}.{e.path} reads {g!r} but is not a Linear or Conv1D layer; "
                                 "its width axis cannot be measured (leave it out of axes)")
            out.append((reader, idx, unit_of))
        return out

    def _norms(self, g: Group) -> List[Tuple[nn.Module, Tensor, Tensor]]:
        """``(norm module, channels, unit of each)`` of every norm the hidden group spans."""
        seen, out = set(), []
        for mname, e, idx, unit_of in self.graph.entries(g):
            if e.role == "norm" and mname not in seen:
                seen.add(mname)
                out.append((self.graph.module(mname), idx, unit_of))
        return out

    def _places(self, name: str, g: Group) -> List[Tuple[nn.Module, Tensor, Tensor]]:
        return self._norms(g) if name == HIDDEN else self._readers(g)

    # ------------------------------------------------------------------ importance
    def score(self, batches: List[Any], importance: str = "auto") -> None:
        """Measure every axis's unit importance on the calibration batches.

        ``importance``: ``"activation"`` -- the L2 norm of each unit's activations (Minitron; one
        pass); ``"obs"`` -- for heads and neurons, the order in which greedy structured OBS would
        remove them from their reader when the rest are refitted (ZipLM; one pass per block and
        ``units x inputs^2`` work per reader); ``"auto"`` -- OBS where that work is at most
        :data:`OBS_BUDGET`, activations elsewhere. The hidden size is always ranked by activations.
        """
        if importance not in ("auto", "activation", "obs"):
            raise ValueError(f"prunekit.shrink: importance must be 'auto', 'activation' or 'obs', got {importance!r}")
        self._activation_scores(batches)
        for axis in self.axes.values():
            if axis.name != HIDDEN and importance != "activation":
                self._obs_scores(axis, batches, force=importance == "obs")

    def _obs_scores(self, axis: WidthAxis, batches: List[Any], force: bool) -> None:
        """Replace ``axis``'s scores by its units' OBS removal order, reader by reader (one block at a time)."""
        for gi, g in enumerate(axis.groups):
            readers = self._readers(g)
            if len(readers) != 1:
                continue
            reader, idx, unit_of = readers[0]
            n_in = reader.weight.shape[1] if isinstance(reader, nn.Linear) else reader.weight.shape[0]
            if not force and axis.units * n_in * n_in > OBS_BUDGET:
                continue
            xtx, rows = input_moments(self.model, batches, [reader])[id(reader)]
            if xtx is None or rows == 0:
                continue
            w = reader.weight.detach() if isinstance(reader, nn.Linear) else reader.weight.detach().T
            units = torch.full((n_in + 1,), -1, dtype=torch.long)
            units[idx] = unit_of
            a = w.double()
            if reader.bias is not None:  # the bias takes up what the removed inputs' means carried
                a = torch.cat([a, reader.bias.detach().double()[:, None]], 1)
            else:
                units, xtx = units[:n_in], xtx[:n_in, :n_in]
            order = obs_removal_order(a, xtx / rows, units)
            scores = torch.zeros(axis.units, dtype=torch.float64)
            scores[torch.tensor(order)] = torch.arange(1, len(order) + 1, dtype=torch.float64)
            axis.scores[gi] = scores

    def _activation_scores(self, batches: List[Any]) -> None:
        sums: List[Tuple[WidthAxis, int, Tensor, Tensor, Tensor]] = []
        by_module: Dict[int, List[Tuple[Tensor, Tensor]]] = {}
        hooks: List[Tuple[nn.Module, bool]] = []
        for axis in self.axes.values():
            for gi, g in enumerate(axis.groups):
                for module, idx, unit_of in self._places(axis.name, g):
                    acc = torch.zeros(idx.numel(), dtype=torch.float64)
                    sums.append((axis, gi, acc, idx, unit_of))
                    if id(module) not in by_module:
                        hooks.append((module, axis.name == HIDDEN))
                    by_module.setdefault(id(module), []).append((acc, idx))
        current: List[Optional[Tensor]] = [None]

        def add(module: nn.Module, x: Tensor) -> None:
            x = x.detach()
            mask = current[0]
            if mask is not None and x.dim() == 3 and tuple(x.shape[:2]) == tuple(mask.shape):
                x = x[mask.to(x.device)]
            sq = x.reshape(-1, x.shape[-1]).double().pow(2).sum(0).cpu()
            for acc, idx in by_module[id(module)]:
                acc += sq.index_select(0, idx)

        handles: List[Any] = []

        def body() -> None:
            for module, after in hooks:
                if after:
                    handles.append(module.register_forward_hook(lambda m, a, out: add(m, out)))
                else:
                    handles.append(module.register_forward_pre_hook(lambda m, a: add(m, a[0])))
            for batch in batches:
                current[0] = token_mask(batch)
                forward(self.model, batch)

        run_then_clean(body, lambda: [handles.pop().remove() for _ in list(handles)])
        for axis in self.axes.values():
            axis.scores = [torch.zeros(axis.units, dtype=torch.float64) for _ in axis.groups]
        for axis, gi, acc, idx, unit_of in sums:
            axis.scores[gi].index_add_(0, unit_of, acc)
        for axis in self.axes.values():
            axis.scores = [s.sqrt() for s in axis.scores]

    # ------------------------------------------------------------------ emulation
    @contextlib.contextmanager
    def emulated(self, keep: Dict[str, int]) -> Iterator[None]:
        """Within the block the model computes as if only ``keep[axis]`` units of each axis were left.

        Nothing is changed but forward hooks, which are removed on exit.
        """
        handles: List[Any] = []
        try:
            for name, n in keep.items():
                axis = self._axis(name)
                if n == axis.units:
                    continue
                for g, removed in zip(axis.groups, axis.removed(n)):
                    gone = torch.zeros(axis.units, dtype=torch.bool)
                    gone[removed] = True
                    for module, idx, unit_of in self._places(name, g):
                        cut = idx[gone[unit_of]]
                        if name == HIDDEN:
                            handles.append(module.register_forward_hook(_norm_on_kept(module, cut)))
                        else:
                            handles.append(module.register_forward_pre_hook(_zero_inputs(cut)))
                if name == HIDDEN:
                    ratio = math.sqrt((axis.units - len(axis.removed(n)[0])) * axis.unit_width
                                      / (axis.units * axis.unit_width))
                    for module in scaled_embeddings(self.model):
                        handles.append(module.register_forward_hook(lambda m, a, out, r=ratio: out * r))
            yield
        finally:
            while handles:
                handles.pop().remove()

    def _axis(self, name: str) -> WidthAxis:
        axis = self.axes.get(name)
        if axis is None:
            raise ValueError(f"prunekit.shrink: {type(self.model).__name__} has no width axis {name!r}; its axes are "
                             f"{sorted(self.axes)}")
        return axis

    # ------------------------------------------------------------------ removal
    def decisions(self, keep: Dict[str, int]) -> List[GroupDecision]:
        """The units each group loses when ``keep[axis]`` units of each axis stay."""
        out: List[GroupDecision] = []
        for name, n in keep.items():
            axis = self._axis(name)
            out.extend(GroupDecision(g, r, axis.units) for g, r in zip(axis.groups, axis.removed(n)))
        return out

    def apply(self, keep: Dict[str, int], journal: Journal) -> int:
        """Remove the units for real, in place, and update the config (recorded in ``journal``).

        Returns how many units went; ``ValueError`` when the config cannot say the new shapes.
        """
        n = remove_units(self.model, self.graph, self.decisions(keep), journal)
        reason = apply_config(self.model, journal)
        if reason:
            raise ValueError(f"prunekit.shrink: the shrunk {self.model_type} model's config cannot say its new shapes "
                             f"({reason}); choose other axes")
        return n


def _zero_inputs(features: Tensor) -> Callable[..., Any]:
    def hook(module: nn.Module, args: Tuple[Any, ...]) -> Tuple[Any, ...]:
        x = args[0].index_fill(-1, features.to(args[0].device), 0)
        return (x,) + tuple(args[1:])
    return hook


def _norm_on_kept(norm: nn.Module, cut: Tensor) -> Callable[..., Any]:
    """A forward hook making ``norm`` compute on the channels not in ``cut`` only (zeros elsewhere)."""
    inside = [False]

    def hook(module: nn.Module, args: Tuple[Any, ...], output: Tensor) -> Tensor:
        if inside[0]:  # the call below, on the kept channels
            return output
        x = args[0]
        size = x.shape[-1]
        gone = torch.zeros(size, dtype=torch.bool, device=x.device)
        gone[cut.to(x.device)] = True
        kept = (~gone).nonzero().flatten()
        xk = x.index_select(-1, kept)
        if isinstance(module, nn.LayerNorm):
            w = None if module.weight is None else module.weight.index_select(0, kept)
            b = None if module.bias is None else module.bias.index_select(0, kept)
            yk = F.layer_norm(xk, (kept.numel(),), w, b, module.eps)
        else:
            params = {n: p.index_select(0, kept) for n, p in module.named_parameters(recurse=False)
                      if p.dim() == 1 and p.shape[0] == size}
            inside[0] = True
            try:
                yk = torch.func.functional_call(module, params, (xk,))
            finally:
                inside[0] = False
        out = torch.zeros_like(output)
        return out.index_copy(-1, kept, yk.to(out.dtype))
    return hook
