"""Sparsity of a model as data: overall, per layer, element-wise and block-wise."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Mapping, Optional

import torch
from torch import nn

from . import _masking as mk
from .patterns import Pattern, get_pattern

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


def _effective(module: nn.Module, name: str) -> torch.Tensor:
    if mk.is_reparametrized(module, name):
        return mk.effective_weight(module, name)
    return getattr(module, name).detach()


def sparsity_report(model: nn.Module, layers: Optional[Mapping[str, Optional[Any]]] = None,
                    weight_name: str = "weight") -> SparsityReport:
    """Measure sparsity from the weights the model actually uses (``orig * mask``).

    ``layers`` maps module names to a pattern (string, :class:`Pattern` or
    ``None``) to report block-wise sparsity as well; by default every module
    with a pruning mask is reported element-wise only.

    Example:
        >>> import torch, torch.nn as nn, prunekit
        >>> from prunekit.training import sparsity_report
        >>> m = nn.Sequential(nn.Linear(4, 4))
        >>> with torch.no_grad(): m[0].weight[:, :2] = 0
        >>> r = sparsity_report(m, {"0": "1x2"})
        >>> r.layers[0].sparsity, r.layers[0].block_sparsity
        (0.5, 0.5)
    """
    named = dict(model.named_modules())
    if layers is None:
        layers = {n: None for n, m in named.items() if mk.is_reparametrized(m, weight_name)}
    rep = SparsityReport()
    block_total = block_zero = 0
    any_blocks = False
    for name, pat in layers.items():
        if name not in named:
            raise ValueError(f"sparsity_report: the model has no module named {name!r}")
        w = _effective(named[name], weight_name)
        numel, zeros = w.numel(), int((w == 0).sum())
        entry = LayerSparsity(name, tuple(w.shape), numel, zeros, zeros / numel if numel else 0.0)
        if pat is not None:
            p: Pattern = get_pattern(pat)
            if p.check(tuple(w.shape)) is None:
                units = p.to_units(w != 0).any(dim=1)
                entry.pattern = p.name
                entry.blocks = int(units.numel())
                entry.zero_blocks = int((~units).sum())
                entry.block_sparsity = entry.zero_blocks / entry.blocks if entry.blocks else 0.0
                block_total += entry.blocks
                block_zero += entry.zero_blocks
                any_blocks = True
        rep.layers.append(entry)
        rep.numel_layers += numel
        rep.zeros_layers += zeros
    for mname, module in named.items():
        for pname, p in module.named_parameters(recurse=False):
            if pname.endswith("_orig") and mk.is_reparametrized(module, pname[:-5]):
                pname = pname[:-5]
            t = _effective(module, pname) if mk.is_reparametrized(module, pname) else p.detach()
            rep.numel_all += t.numel()
            rep.zeros_all += int((t == 0).sum())
    rep.elementwise_over_layers = rep.zeros_layers / rep.numel_layers if rep.numel_layers else 0.0
    rep.elementwise_over_all = rep.zeros_all / rep.numel_all if rep.numel_all else 0.0
    if any_blocks:
        rep.blockwise_over_layers = block_zero / block_total if block_total else 0.0
    return rep
