"""Sparsity of a model as data: overall, per layer, element-wise and block-wise.

The figures are measured with :mod:`prunekit.measure`, the machinery of
:func:`prunekit.model_report` (the same effective tensors, the same counting), so the two reports agree on
every tensor they both cover; this one adds block-wise sparsity under any
pruning pattern and selects layers by module name.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Mapping, Optional

from torch import Tensor, nn

from .. import reparam
from ..measure import block_counts, count, effective_tensors, fraction, totals
from ..kernels.patterns import get_pattern

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
    rep = SparsityReport()
    block_total = block_zero = 0
    any_blocks = False
    for name, pat in layers.items():
        if name not in named:
            raise ValueError(f"sparsity_report: the model has no module named {name!r}")
        w = _layer_tensor(named[name], name, weight_name, tensors)
        numel, nonzero = count(w)
        zeros = numel - nonzero
        entry = LayerSparsity(name, tuple(w.shape), numel, zeros, fraction(zeros, numel))
        if pat is not None:
            p = get_pattern(pat)
            counted = block_counts(w != 0, p)
            if counted is not None:
                entry.pattern = p.name
                entry.blocks, entry.zero_blocks = counted
                entry.block_sparsity = fraction(entry.zero_blocks, entry.blocks)
                block_total += entry.blocks
                block_zero += entry.zero_blocks
                any_blocks = True
        rep.layers.append(entry)
        rep.numel_layers += numel
        rep.zeros_layers += zeros
    rep.numel_all, nonzero_all = totals(tensors)
    rep.zeros_all = rep.numel_all - nonzero_all
    rep.elementwise_over_layers = fraction(rep.zeros_layers, rep.numel_layers)
    rep.elementwise_over_all = fraction(rep.zeros_all, rep.numel_all)
    if any_blocks:
        rep.blockwise_over_layers = fraction(block_zero, block_total)
    return rep
