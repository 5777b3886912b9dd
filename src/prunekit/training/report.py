"""Sparsity of the modules a pruning run drives: a view of :class:`prunekit.ModelReport`.

:func:`sparsity_report` measures the chosen modules' weights with
:func:`prunekit.measure.report_layers`, the machinery of
:func:`prunekit.model_report` (the same effective tensors, the same counting),
and presents that report by module name: every element-wise figure of a
:class:`SparsityReport` is the :class:`~prunekit.ModelReport`'s. What the view
adds is block-wise sparsity under each module's pruning pattern.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Mapping, Optional

from torch import Tensor, nn

from .. import reparam
from ..kernels.patterns import Pattern, get_pattern
from ..measure import LayerReport, block_counts, effective_tensors, fraction, report_layers

__all__ = ["LayerSparsity", "SparsityReport", "sparsity_report"]


@dataclass
class LayerSparsity:
    """One tensor: ``zeros``/``numel`` element-wise, ``zero_blocks``/``blocks`` under ``pattern``."""

    name: str
    shape: tuple
    numel: int
    zeros: int
    sparsity: float
    pattern: Optional[str] = None
    blocks: Optional[int] = None
    zero_blocks: Optional[int] = None
    block_sparsity: Optional[float] = None


@dataclass
class SparsityReport:
    """``layers`` plus totals: over the reported layers and over every parameter of the model."""

    layers: List[LayerSparsity] = field(default_factory=list)
    elementwise_over_layers: float = 0.0
    elementwise_over_all: float = 0.0
    blockwise_over_layers: Optional[float] = None
    numel_layers: int = 0
    zeros_layers: int = 0
    numel_all: int = 0
    zeros_all: int = 0

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)


def _layer_tensor(module: nn.Module, module_name: str, weight_name: str,
                  tensors: Mapping[str, Tensor]) -> Tensor:
    """The effective ``weight_name`` of ``module``, taken from the model's effective tensors.

    A tensor missing there (a parameter tied to one met earlier under another
    name, or a buffer) is read from the module, a pruned one baked by the same
    :func:`prunekit.reparam.masked` (what ``dense_state_dict`` uses).
    """
    t = tensors.get(f"{module_name}.{weight_name}" if module_name else weight_name)
    if t is not None:
        return t
    return reparam.effective(module, weight_name)  # AttributeError naming the module when it has none


def _layer_view(module_name: str, entry: LayerReport, w: Tensor, pattern: Optional[Pattern]) -> LayerSparsity:
    """The report's entry of one module's weight, by module name, with its blocks under ``pattern``."""
    view = LayerSparsity(module_name, entry.shape, entry.numel, entry.numel - entry.nonzero, entry.sparsity)
    if pattern is not None:
        counted = block_counts(w != 0, pattern)
        if counted is not None:
            view.pattern = pattern.name
            view.blocks, view.zero_blocks = counted
            view.block_sparsity = fraction(view.zero_blocks, view.blocks)
    return view


def sparsity_report(model: nn.Module, layers: Optional[Mapping[str, Optional[Any]]] = None,
                    weight_name: str = "weight") -> SparsityReport:
    """Measure sparsity from the weights the model actually uses (``orig * mask``).

    ``layers`` maps module names to a pattern (string, :class:`Pattern` or
    ``None``) to report block-wise sparsity as well; by default every module
    with a pruning mask is reported element-wise only. Masked entries count
    as zero, and the ``*_all`` totals count every parameter once (tied ones
    too), exactly as :func:`prunekit.report.model_report` counts them.

    Examples:
        >>> import torch, torch.nn as nn, prunekit
        >>> from prunekit.training import sparsity_report
        >>> m = nn.Sequential(nn.Linear(4, 4))
        >>> with torch.no_grad(): m[0].weight[:, :2] = 0
        >>> r = sparsity_report(m, {"0": "1x2"})
        >>> r.layers[0].sparsity, r.layers[0].block_sparsity
        (0.5, 0.5)
        >>> r.elementwise_over_all == prunekit.model_report(m).sparsity_all
        True
    """
    named = dict(model.named_modules())
    tensors, masked, _ = effective_tensors(model)
    if layers is None:
        layers = {n: None for n in named if (f"{n}.{weight_name}" if n else weight_name) in masked}
    weights: Dict[str, Tensor] = {}
    patterns: Dict[str, Optional[Pattern]] = {}
    for name, pat in layers.items():
        if name not in named:
            raise ValueError(f"sparsity_report: the model has no module named {name!r}")
        weights[name] = _layer_tensor(named[name], name, weight_name, tensors)
        patterns[name] = get_pattern(pat) if pat is not None else None
    full = report_layers({f"{n}.{weight_name}" if n else weight_name: w for n, w in weights.items()}, tensors, masked)
    rep = SparsityReport(
        layers=[_layer_view(n, e, weights[n], patterns[n]) for n, e in zip(weights, full.layers)],
        elementwise_over_layers=full.sparsity_layers,
        elementwise_over_all=full.sparsity_all,
        numel_layers=full.numel_layers,
        zeros_layers=full.numel_layers - full.nonzero_layers,
        numel_all=full.numel_all,
        zeros_all=full.numel_all - full.nonzero_all,
    )
    blocked = [(e.zero_blocks, e.blocks) for e in rep.layers if e.zero_blocks is not None and e.blocks is not None]
    if blocked:
        rep.blockwise_over_layers = fraction(sum(z for z, _ in blocked), sum(n for _, n in blocked))
    return rep
