"""Compaction: structured pruning that makes a model smaller and faster (PyTorch only).

* :func:`build_dependency_graph` -- groups of coupled channels from one traced run;
* :func:`prune_groups` -- mask whole groups by importance (local or global budget);
* :func:`compact` -- rebuild the masked model with smaller dense layers;
* :func:`save_compacted` / :func:`load_compacted` -- a plain state dict plus a JSON-able
  description that rebuilds the compacted model from the original model class;
* :func:`register_handler` -- teach it a new layer type.

Sub-packages by concept, each importing only from those below it: :mod:`.selection`
(choosing units and writing masks), :mod:`.surgery` (changing modules, undoably),
:mod:`.trace` (the traced run and its groups), :mod:`.handlers` (one per layer type),
:mod:`.proofs` (proved constants and dead units).

Examples:
    >>> import torch
    >>> from torch import nn
    >>> from prunekit.compact import prune_groups, compact, count_params
    >>> m = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))
    >>> x = torch.randn(4, 32)
    >>> _ = prune_groups(m, x, 0.5)
    >>> small = compact(m, x)
    >>> count_params(m), count_params(small)
    (2762, 1386)
"""

from .compact import (
    compact,
    compaction_description,
    load_compacted,
    rebuild_from_description,
    save_compacted,
    zero_units,
)
from .errors import CompactionError, TraceError
from .handlers import REGISTRY, Entry, HandlerRegistry, ModuleHandler, Slot, TracerAPI, register_handler
from .macs import count_macs, count_params
from .modules import PrunedMultiheadAttention
from .reconstruct import CalibrationReport, prune_with_calibration
from .selection.importance import group_importance
from .selection.prune import GroupDecision, prune_groups
from .trace.graph import DependencyGraph, Group, Unit, build_dependency_graph

__all__ = [
    "CalibrationReport",
    "CompactionError",
    "DependencyGraph",
    "Entry",
    "Group",
    "GroupDecision",
    "HandlerRegistry",
    "ModuleHandler",
    "PrunedMultiheadAttention",
    "REGISTRY",
    "Slot",
    "TraceError",
    "TracerAPI",
    "Unit",
    "build_dependency_graph",
    "compact",
    "compaction_description",
    "count_macs",
    "count_params",
    "group_importance",
    "load_compacted",
    "prune_groups",
    "prune_with_calibration",
    "rebuild_from_description",
    "register_handler",
    "save_compacted",
    "zero_units",
]
