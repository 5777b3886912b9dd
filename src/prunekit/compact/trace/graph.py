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

Where each part lives
---------------------
:mod:`~prunekit.compact.trace.ops` (op tables), :mod:`~prunekit.compact.trace.shadows` (label
tensors), :mod:`~prunekit.compact.trace.rules` (how each op moves labels),
:mod:`~prunekit.compact.trace.unionfind`, :mod:`~prunekit.compact.trace.tracer` (the run and the
handler API), :mod:`~prunekit.compact.trace.grouping` (units and groups from the components),
:mod:`~prunekit.compact.trace.results` (what is returned); this module is the entry point.

Anything the tracer does not understand is never guessed: the channels that
flow into an unknown operation are *blocked* (not prunable) and the reason
names the operation and the module, e.g. ``"op 'einsum' in module
'blocks.0.attn'"``. Channels that reach the model's outputs are blocked too
(removing them would change the output's shape).
"""

from __future__ import annotations

import gc
from typing import Any, Dict, List, Optional, Sequence, Tuple

from torch import nn

from ..errors import TraceError
from .grouping import collect, default_final_layers, read_values
from ..handlers import REGISTRY, HandlerRegistry
from ..handlers.projection_attention import GQA_MODES
from .results import DependencyGraph, Group, SlotInfo, Unit
from .tracer import Tracer

__all__ = [
    "DependencyGraph",
    "Group",
    "SlotInfo",
    "TraceError",
    "Unit",
    "build_dependency_graph",
    "check_graph",
]


def build_dependency_graph(
    model: nn.Module,
    example_inputs: Any,
    *,
    ignored_layers: Optional[Sequence[Any]] = None,
    exact: bool = True,
    registry: Optional[HandlerRegistry] = None,
    gqa: str = "groups",
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
        gqa: units of grouped-query attention (more query heads than key/value heads):
            ``"groups"`` -- a key/value group with its query heads; ``"query_heads"`` --
            the j-th query head of every group (query heads removed evenly, keys and
            values kept). Plain multi-head attention is pruned by heads either way.

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> from prunekit.compact import build_dependency_graph
        >>> m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        >>> g = build_dependency_graph(m, torch.randn(2, 8))
        >>> [len(grp.units) for grp in g.prunable_groups()]
        [16]
    """
    return traced_dependency_graph(model, example_inputs, ignored_layers=ignored_layers, exact=exact,
                                   registry=registry, gqa=gqa)[0]


def traced_dependency_graph(
    model: nn.Module,
    example_inputs: Any,
    *,
    ignored_layers: Optional[Sequence[Any]] = None,
    exact: bool = True,
    registry: Optional[HandlerRegistry] = None,
    gqa: str = "groups",
) -> Tuple[DependencyGraph, Any]:
    """:func:`build_dependency_graph`, and the model's output on ``example_inputs`` from the
    traced forward pass (in eval mode, without gradients, fused attention fast paths off)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"build_dependency_graph expects an nn.Module, got {type(model).__name__}")
    if gqa not in GQA_MODES:
        raise ValueError(f"gqa must be one of {GQA_MODES}, got {gqa!r}")
    registry = registry or REGISTRY
    tracer = Tracer(model, registry, exact=exact, options={"gqa": gqa})
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
        output = tracer.run(example_inputs, explicit)
        ignored = list(explicit)
        if ignored_layers is None:
            # The final classifier keeps its outputs (they are the model's outputs and were
            # blocked above); its input columns follow the layer before it.
            ignored = default_final_layers(tracer)
        graph = collect(tracer, tuple(ignored))
        graph.options = {**tracer.options, "exact": exact}
        graph.read_values = read_values(tracer.reads, tracer.uf.n)
        graph.order = list(tracer.order)
        return graph, output
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
