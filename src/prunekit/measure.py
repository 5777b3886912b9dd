"""Measuring sparsity: the effective tensors of a model or state dict, how they are counted, and the report.

One place for what every report counts, so reports cannot disagree:
:func:`model_report` (re-exported as :func:`prunekit.model_report`, shown by
``prunekit inspect``) and :func:`prunekit.training.sparsity_report` (a view of
the same :class:`ModelReport`) measure through these helpers.

* :func:`effective_tensors` -- every parameter once (tied ones under their
  first name), a pruned ``x_orig`` replaced by ``x = x_orig * x_mask`` with
  masked entries exactly zero, as :func:`prunekit.remove` bakes them;
* :func:`count` / :func:`totals` -- elements and non-zero elements (NaN counts
  as non-zero);
* :func:`block_counts` -- units and all-zero units under a pruning pattern;
* :func:`fraction` -- the one rounding rule (``0.0`` for an empty whole);
* :class:`ModelReport` / :class:`LayerReport` -- the report: per weight
  tensor and in total, from :func:`model_report` (every weight of a model or
  state dict) or :func:`report_layers` (chosen tensors).

Definitions of a layer's figures (``W`` seen as ``(out, in, *kernel)``):

* ``sparsity`` -- zero elements / elements;
* ``channel_sparsity`` -- output channels (rows of ``W``) whose every weight is zero;
* ``fits_2_4`` -- share of the groups of 4 consecutive input channels (at one
  kernel position) holding at most 2 non-zeros; ``1.0`` means the tensor
  already has the 2:4 pattern. ``None`` when ``in`` is not a multiple of 4;
* ``block_4x1_sparsity`` -- share of 4x1 blocks (4 output channels x 1 input
  channel at one kernel position) that are all zero. ``None`` when ``out``
  is not a multiple of 4.

The layout is the one :mod:`prunekit.kernels.patterns` prunes with, so a
model pruned with pattern ``"2:4"`` reports ``fits_2_4 == 1.0`` and one
pruned with ``"4x1"`` reports its block sparsity here. A tensor with fewer
than two dimensions has no channels (``channels == 0``) and no blocks.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from typing import AbstractSet, Any, Dict, List, Mapping, Optional, Set, Tuple, Union

from torch import Tensor, nn

from . import _sharded, reparam
from ._backend import is_module, is_tensor
from .kernels.patterns import get_pattern, to_2d
from .state_dict import dense_state_dict

__all__ = [
    "LayerReport",
    "ModelReport",
    "block_counts",
    "count",
    "effective_tensors",
    "fraction",
    "masked_names",
    "model_report",
    "report_layers",
    "totals",
]

logger = logging.getLogger(__name__)


def count(t: Tensor) -> Tuple[int, int]:
    """``(elements, non-zero elements)`` of ``t`` (NaN counts as non-zero; DTensor shards: over all ranks).

    Examples:
        >>> import torch
        >>> count(torch.tensor([[0.0, 1.0], [float("nan"), 0.0]]))
        (4, 2)
    """
    return t.numel(), _sharded.count_nonzero(t)


def fraction(part: int, whole: int) -> float:
    """``part / whole``, ``0.0`` for an empty whole (the one rounding every report uses).

    Examples:
        >>> fraction(3, 4), fraction(0, 0)
        (0.75, 0.0)
    """
    return part / whole if whole else 0.0


def block_counts(nz: Tensor, pattern: Any) -> Optional[Tuple[int, int]]:
    """``(units, all-zero units)`` of the non-zero map ``nz`` cut into ``pattern``'s units.

    ``pattern`` is a :class:`prunekit.kernels.patterns.Pattern`; ``None`` when
    ``nz``'s shape does not fit it (a DTensor shard is measured whole). The
    units are those pattern pruning removes, so a tensor pruned with a pattern
    reports its blocks exactly.

    Examples:
        >>> import torch
        >>> from prunekit.kernels.patterns import get_pattern
        >>> block_counts(torch.tensor([[True, True, False, False]]), get_pattern("1x2"))
        (2, 1)
    """
    if pattern.check(tuple(nz.shape)) is not None:
        return None
    units = pattern.to_units(_sharded.whole(nz)).any(dim=1)
    return units.numel(), int((~units).sum())


def masked_names(sd: Mapping[str, Any]) -> Set[str]:
    """Names ``x`` whose ``x_orig`` and ``x_mask`` are both in the state dict ``sd``.

    Examples:
        >>> sorted(masked_names({"w_orig": 0, "w_mask": 0, "b": 0, "v_mask": 0}))
        ['w']
    """
    return {k[: -len("_mask")] for k in sd if k.endswith("_mask") and k[: -len("_mask")] + "_orig" in sd}


def effective_tensors(source: Union[nn.Module, Mapping[str, Tensor]]
                      ) -> Tuple["OrderedDict[str, Tensor]", Set[str], str]:
    """(name -> effective tensor, names that carried a mask, kind of source: ``"model"`` or ``"state_dict"``).

    For a model (PyTorch or TensorPlay): every parameter once (tied ones under
    their first name), a pruned ``x_orig`` replaced by ``x = x_orig * x_mask``
    with masked entries exactly zero, as :func:`prunekit.remove` bakes them.
    For a state dict: every floating-point entry, ``x_orig``/``x_mask`` pairs baked.

    Examples:
        >>> import torch, prunekit
        >>> m = torch.nn.Linear(2, 2)
        >>> _ = prunekit.l1_unstructured(m, "weight", amount=1)
        >>> tensors, masked, kind = effective_tensors(m)
        >>> list(tensors), sorted(masked), kind
        (['bias', 'weight'], ['weight'], 'model')
    """
    if is_module(source):
        sd = source.state_dict()
        masked = masked_names(sd)
        baked = dense_state_dict(sd)
        wanted = []
        for pname, _ in source.named_parameters():
            base = pname[: -len("_orig")] if pname.endswith("_orig") else pname
            wanted.append(base if base in masked else pname)
        out = OrderedDict((k, baked[k].detach()) for k in wanted if k in baked)
        return out, masked, "model"
    if isinstance(source, Mapping):
        for k, v in source.items():
            if not isinstance(k, str) or not is_tensor(v):
                raise TypeError(
                    f"model_report: entry {k!r} of the state dict is a {type(v).__name__}, not a tensor; "
                    "pass a model or a mapping of names to tensors"
                )
        masked = masked_names(source)
        baked = dense_state_dict(source)
        out = OrderedDict((k, v.detach()) for k, v in baked.items() if v.is_floating_point() or v.is_complex())
        return out, masked, "state_dict"
    raise TypeError(
        f"model_report: expected an nn.Module or a state dict (a mapping of names to tensors), got "
        f"{type(source).__name__}; for a file use model_report(read_checkpoint(path)[0])"
    )


def totals(tensors: Mapping[str, Tensor]) -> Tuple[int, int]:
    """``(elements, non-zero elements)`` over every tensor of ``tensors``.

    Examples:
        >>> import torch
        >>> totals({"a": torch.zeros(3), "b": torch.ones(2)})
        (5, 2)
    """
    numel = nonzero = 0
    for t in tensors.values():
        n, nz = count(t)
        numel += n
        nonzero += nz
    return numel, nonzero


# ----------------------------------------------------------------------------- the report
@dataclass
class LayerReport:
    """One weight tensor of a model or checkpoint (see the module docstring for each figure)."""

    name: str
    shape: Tuple[int, ...]
    numel: int
    nonzero: int
    sparsity: float
    channels: int
    zero_channels: int
    channel_sparsity: float
    fits_2_4: Optional[float]
    block_4x1_sparsity: Optional[float]
    masked: bool = False


@dataclass
class ModelReport:
    """Per-layer figures plus totals.

    ``*_layers`` totals are over the reported weights; ``*_all`` totals are
    over every floating-point tensor considered (a model's parameters, or
    every floating-point entry of a checkpoint, buffers included).
    """

    layers: List[LayerReport] = field(default_factory=list)
    numel_layers: int = 0
    nonzero_layers: int = 0
    sparsity_layers: float = 0.0
    numel_all: int = 0
    nonzero_all: int = 0
    sparsity_all: float = 0.0
    channels: int = 0
    zero_channels: int = 0
    channel_sparsity: float = 0.0
    fits_2_4: Optional[float] = None
    block_4x1_sparsity: Optional[float] = None
    source: str = "model"

    def to_dict(self) -> Dict[str, Any]:
        """Plain, JSON-ready dict (shapes become lists).

        Examples:
            >>> import json, torch
            >>> from prunekit.report import model_report
            >>> d = model_report({"fc.weight": torch.eye(4)}).to_dict()
            >>> d["layers"][0]["shape"], d["sparsity_layers"], d["source"]
            ([4, 4], 0.75, 'state_dict')
            >>> json.loads(json.dumps(d)) == d
            True
        """
        d = asdict(self)
        for layer in d["layers"]:
            layer["shape"] = list(layer["shape"])
        return d

    def layer(self, name: str) -> LayerReport:
        """The entry of the weight called ``name`` (``KeyError`` naming the known ones otherwise).

        Examples:
            >>> import torch
            >>> from prunekit.report import model_report
            >>> r = model_report({"fc.weight": torch.eye(4), "fc.bias": torch.ones(4)})
            >>> r.layer("fc.weight").nonzero
            4
            >>> r.layer("fc.bias")
            Traceback (most recent call last):
            ...
            KeyError: "no weight named 'fc.bias' in this report; known: ['fc.weight']"
        """
        for entry in self.layers:
            if entry.name == name:
                return entry
        raise KeyError(f"no weight named {name!r} in this report; known: {[e.name for e in self.layers]}")


def inputs_first(model: nn.Module) -> Set[str]:
    """The weights of ``model`` stored ``(in, out)``: Hugging Face's ``Conv1D`` (GPT-2's linear layers).
    Their channels, 2:4 groups and blocks are measured on the transpose, as for an ``nn.Linear``.

    Examples:
        >>> import torch
        >>> from transformers.pytorch_utils import Conv1D
        >>> sorted(inputs_first(torch.nn.Sequential(Conv1D(nf=4, nx=8), torch.nn.Linear(4, 2))))
        ['0.weight']
    """
    out = set()
    for name, m in model.named_modules():
        if reparam.base_class(m).__name__ == "Conv1D" and hasattr(m, "nf"):
            out.add(f"{name}.weight" if name else "weight")
    return out


def _measure(name: str, t: Tensor, masked: bool, transposed: bool = False) -> Tuple[LayerReport, int, int, int, int]:
    """The layer entry plus (2:4 groups, fitting groups, 4x1 blocks, zero blocks).

    The groups and blocks are those :mod:`prunekit.kernels.patterns` prunes
    with (its ``to_2d`` layout and ``"4x1"`` units), so the figures cannot
    drift from what pattern pruning produces.
    """
    t = _sharded.whole(t)  # a DTensor shard: measured whole (gathered, one tensor at a time)
    shape = tuple(int(s) for s in t.shape)
    if transposed:  # stored (in, out): measured as (out, in)
        t = t.transpose(0, 1)
    nz = t != 0
    numel, nonzero = count(t)
    out_ch = zero_channels = 0
    if t.dim() >= 2:
        out_ch = int(t.shape[0])
        rows = nz.flatten(1).any(dim=1)  # flatten, not reshape(out, -1): a (0, n) weight has no rows to infer from
        zero_channels = int((~rows).sum())
    groups = fit = blocks = zero_blocks = 0
    fits = block = None
    if numel and get_pattern("2:4").check(t.shape) is None:
        per_group = to_2d(nz).reshape(-1, 4).sum(dim=1)  # 4 consecutive input channels at one kernel position
        groups = per_group.numel()
        fit = int((per_group <= 2).sum())
        fits = fit / groups
    counted = block_counts(nz, get_pattern("4x1")) if numel else None
    if counted is not None:
        blocks, zero_blocks = counted
        block = zero_blocks / blocks
    entry = LayerReport(
        name=name,
        shape=shape,
        numel=numel,
        nonzero=nonzero,
        sparsity=fraction(numel - nonzero, numel),
        channels=out_ch,
        zero_channels=zero_channels,
        channel_sparsity=zero_channels / out_ch if out_ch else 0.0,
        fits_2_4=fits,
        block_4x1_sparsity=block,
        masked=masked,
    )
    return entry, groups, fit, blocks, zero_blocks


def model_report(source: Union[nn.Module, Mapping[str, Tensor]]) -> ModelReport:
    """Measure the sparsity of a model or state dict, per weight tensor and in total.

    Works on the weights the model actually uses: a pruned module's
    ``weight_orig * weight_mask`` (float or boolean masks; masked entries
    count as zero), a state dict with ``x_orig``/``x_mask`` pairs, or plain
    tensors. Every tensor with two or more dimensions is a reported layer; the
    others (biases, norms) count in the ``*_all`` totals only. Each parameter
    counts once, tied ones under their first name. The figures are the ones
    :func:`prunekit.training.sparsity_report` gives for the same tensors.

    Examples:
        >>> import torch, prunekit
        >>> from prunekit.report import model_report
        >>> m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
        >>> _ = prunekit.l1_unstructured(m[0], "weight", amount=48)
        >>> r = model_report(m)
        >>> [(e.name, e.shape, e.sparsity, e.masked) for e in r.layers]
        [('0.weight', (8, 8), 0.75, True), ('2.weight', (4, 8), 0.0, False)]
        >>> r.nonzero_layers, r.numel_all
        (48, 108)
    """
    tensors, masked, kind = effective_tensors(source)
    transposed = inputs_first(source) if is_module(source) and isinstance(source, nn.Module) else set()
    return report_layers({n: t for n, t in tensors.items() if t.dim() >= 2}, tensors, masked, kind, transposed)


def report_layers(layers: Mapping[str, Tensor], tensors: Mapping[str, Tensor], masked: AbstractSet[str] = frozenset(),
                  source: str = "model", transposed: AbstractSet[str] = frozenset()) -> ModelReport:
    """A :class:`ModelReport` with one entry per tensor of ``layers`` (in order) and ``*_all`` totals over ``tensors``.

    ``masked`` names the entries that carried a pruning mask; ``source`` is the
    report's ``source``; ``transposed`` names the weights stored ``(in, out)`` (:func:`inputs_first`). :func:`model_report` reports every weight this way;
    :func:`prunekit.training.sparsity_report` reports the weights of chosen modules.

    Examples:
        >>> import torch
        >>> w, b = torch.tensor([[0.0, 1.0], [0.0, 0.0]]), torch.ones(2)
        >>> r = report_layers({"fc.weight": w}, {"fc.weight": w, "fc.bias": b})
        >>> r.layers[0].zero_channels, r.sparsity_layers, r.numel_all, r.nonzero_all
        (1, 0.75, 6, 3)
    """
    rep = ModelReport(source=source)
    rep.numel_all, rep.nonzero_all = totals(tensors)
    groups = fit = blocks = zero_blocks = 0
    for name, t in layers.items():
        entry, g, f, b, zb = _measure(name, t, name in masked, name in transposed)
        rep.layers.append(entry)
        rep.numel_layers += entry.numel
        rep.nonzero_layers += entry.nonzero
        rep.channels += entry.channels
        rep.zero_channels += entry.zero_channels
        groups += g
        fit += f
        blocks += b
        zero_blocks += zb
    rep.sparsity_layers = fraction(rep.numel_layers - rep.nonzero_layers, rep.numel_layers)
    rep.sparsity_all = fraction(rep.numel_all - rep.nonzero_all, rep.numel_all)
    rep.channel_sparsity = rep.zero_channels / rep.channels if rep.channels else 0.0
    rep.fits_2_4 = fit / groups if groups else None  # None when no weight has the 2:4 layout
    rep.block_4x1_sparsity = zero_blocks / blocks if blocks else None
    logger.debug("report: %d layers, %.4f sparse", len(rep.layers), rep.sparsity_layers)
    return rep
