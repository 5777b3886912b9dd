"""Sparsity reports as data, and the plots drawn from them.

:func:`model_report` measures a model or a checkpoint: for every weight (a
tensor with two or more dimensions) its shape, element-wise sparsity, the
share of its output channels that are entirely zero, how much of it already
fits the 2:4 pattern, and the share of all-zero 4x1 blocks; plus totals. The
result is plain data (``to_dict()`` is JSON-ready), so a notebook can render
the same tables and plots as the ``prunekit`` command.

Definitions (``W`` seen as ``(out, in, *kernel)``):

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
pruned with ``"4x1"`` reports its block sparsity here.

:func:`read_checkpoint` (from :mod:`prunekit.io`, re-exported here) reads what
``prunekit inspect`` accepts: a plain state dict, a ``torch.nn.utils.prune``-style
state dict (``x_orig``/``x_mask``), a plain safetensors file or a prunekit
compressed checkpoint -- never unpickling arbitrary objects unless asked to.
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

from torch import Tensor, nn

from . import _sharded
from .measure import block_counts, count, effective_tensors, fraction, totals
from .io import UnsafeCheckpointError, read_checkpoint
from .io.writer import atomic_path

__all__ = [
    "LayerReport",
    "ModelReport",
    "UnsafeCheckpointError",
    "model_report",
    "read_checkpoint",
    "plot_layer_sparsity",
    "plot_accuracy_vs_sparsity",
    "plot_grouped_bars",
]

logger = logging.getLogger(__name__)

PathLike = Union[str, "os.PathLike[str]"]




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


# ----------------------------------------------------------------------------- measuring
# What a tensor holds and how it is counted: prunekit.measure, shared with
# prunekit.training.sparsity_report, so the two reports cannot disagree.
def _measure(name: str, t: Tensor, masked: bool) -> Tuple[LayerReport, int, int, int, int]:
    """The layer entry plus (2:4 groups, fitting groups, 4x1 blocks, zero blocks).

    The groups and blocks are those :mod:`prunekit.kernels.patterns` prunes
    with (its ``to_2d`` layout and ``"4x1"`` units), so the figures cannot
    drift from what pattern pruning produces.
    """
    from .kernels.patterns import get_pattern, to_2d

    t = _sharded.whole(t)  # a DTensor shard: measured whole (gathered, one tensor at a time)
    nz = t != 0
    numel, nonzero = count(t)
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
        shape=tuple(int(s) for s in t.shape),
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
    rep = ModelReport(source=kind)
    rep.numel_all, rep.nonzero_all = totals(tensors)
    groups = fit = blocks = zero_blocks = 0
    for name, t in tensors.items():
        if t.dim() < 2:
            continue
        entry, g, f, b, zb = _measure(name, t, name in masked)
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
    logger.debug("model_report: %d layers, %.4f sparse", len(rep.layers), rep.sparsity_layers)
    return rep


# ----------------------------------------------------------------------------- plots
def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("plots need matplotlib: pip install 'prunekit[plot]'") from e
    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    return plt


def _save_figure(fig: Any, path: PathLike) -> str:
    """Lay out ``fig``, write it to ``path`` through the atomic writer (format from the suffix, PNG
    without one) and close it, also on failure. Returns the path as a string."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path = os.fspath(path)
    try:
        with atomic_path(path) as tmp:
            fig.savefig(tmp, dpi=120, format=os.path.splitext(path)[1][1:] or "png")
    finally:
        plt.close(fig)
    return path


def plot_layer_sparsity(report: ModelReport, path: PathLike, *, title: Optional[str] = None) -> str:
    """Write a PNG bar chart of each layer's element-wise and channel sparsity; returns the path.

    Examples:
        >>> import os, tempfile, torch, prunekit
        >>> from prunekit.report import model_report, plot_layer_sparsity
        >>> m = prunekit.l1_unstructured(torch.nn.Linear(8, 8), "weight", amount=0.5)
        >>> p = plot_layer_sparsity(model_report(m), os.path.join(tempfile.mkdtemp(), "layers.png"))
        >>> os.path.getsize(p) > 0
        True
    """
    plt = _pyplot()
    names = [e.name for e in report.layers]
    elem = [100 * e.sparsity for e in report.layers]
    chan = [100 * e.channel_sparsity for e in report.layers]
    fig, ax = plt.subplots(figsize=(7.5, 0.45 * max(len(names), 2) + 1.6))
    y = list(range(len(names)))
    ax.barh([i - 0.2 for i in y], elem, height=0.4, label="element-wise", color="#3b6ea5")
    ax.barh([i + 0.2 for i in y], chan, height=0.4, label="whole output channels", color="#e39c3b")
    for i, e in enumerate(report.layers):
        ax.text(min(elem[i] + 1, 101), i - 0.2, f"{elem[i]:.1f}%  {list(e.shape)}", va="center", fontsize=7)
    ax.set_yticks(y)
    ax.set_yticklabels(names, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, 125)
    ax.set_xlabel("sparsity (%)")
    ax.set_title(title or f"per-layer sparsity (total {100 * report.sparsity_layers:.1f}% of weights)")
    ax.legend(loc="lower right", fontsize=8)
    return _save_figure(fig, path)


def plot_accuracy_vs_sparsity(
    results: Sequence[Mapping[str, Any]],
    path: PathLike,
    *,
    dense_accuracy: Optional[float] = None,
    title: Optional[str] = None,
) -> str:
    """Write a PNG of accuracy against sparsity, one line per ``method``; returns the path.

    ``results`` are mappings with ``method``, ``sparsity`` and ``accuracy``
    (fractions in [0, 1]); ``dense_accuracy`` draws the unpruned baseline.

    Examples:
        >>> import os, tempfile
        >>> from prunekit.report import plot_accuracy_vs_sparsity
        >>> rows = [{"method": "magnitude", "sparsity": s, "accuracy": a} for s, a in [(0.5, 0.98), (0.9, 0.95)]]
        >>> p = plot_accuracy_vs_sparsity(rows, os.path.join(tempfile.mkdtemp(), "acc.png"), dense_accuracy=0.99)
        >>> os.path.getsize(p) > 0
        True
    """
    plt = _pyplot()
    by_method: "OrderedDict[str, List[Tuple[float, float]]]" = OrderedDict()
    for r in results:
        for key in ("method", "sparsity", "accuracy"):
            if key not in r:
                raise ValueError(
                    f"plot_accuracy_vs_sparsity: result {dict(r)!r} has no {key!r}; give every result "
                    "'method', 'sparsity' and 'accuracy', e.g. {'method': 'magnitude', 'sparsity': 0.9, "
                    "'accuracy': 0.97}"
                )
        by_method.setdefault(str(r["method"]), []).append((float(r["sparsity"]), float(r["accuracy"])))
    all_acc = [a for pts in by_method.values() for _, a in pts]
    # a second, zoomed panel when some points (e.g. one-shot without fine-tuning) squash the interesting top
    zoom = dense_accuracy is not None and bool(all_acc) and min(all_acc) < dense_accuracy - 0.05
    fig, axes = plt.subplots(1, 2 if zoom else 1, figsize=(12.5 if zoom else 7.5, 4.8), squeeze=False)
    markers = "osD^vP*X"
    for ai, ax in enumerate(axes[0]):
        for i, (method, pts) in enumerate(by_method.items()):
            pts.sort()
            xs = [100 * s for s, _ in pts]
            ys = [100 * a for _, a in pts]
            ax.plot(xs, ys, marker=markers[i % len(markers)], linestyle="-" if len(pts) > 1 else "none",
                    label=method, markersize=7, alpha=0.85)
        if dense_accuracy is not None:
            ax.axhline(100 * dense_accuracy, color="black", linestyle="--", linewidth=1,
                       label=f"dense ({100 * dense_accuracy:.1f}%)")
            ax.axhline(100 * dense_accuracy - 1, color="grey", linestyle=":", linewidth=1, label="dense - 1 point")
        ax.set_xlabel("sparsity of the pruned weights (%)")
        ax.set_ylabel("test accuracy (%)")
        ax.grid(True, alpha=0.3)
        if ai == 0:
            ax.set_title(title or "accuracy against sparsity")
            ax.legend(fontsize=8, loc="lower left")
        else:
            top = 100 * dense_accuracy
            ax.set_ylim(top - 4, min(100.5, top + 1.5))
            ax.set_title("zoom: within 4 points of dense")
    return _save_figure(fig, path)


def plot_grouped_bars(
    rows: Sequence[Mapping[str, Any]],
    path: PathLike,
    *,
    group: str,
    series: str,
    value: str,
    ylabel: str,
    title: Optional[str] = None,
    reference: Optional[float] = None,
) -> str:
    """Write a PNG bar chart of ``row[value]``: one group of bars per ``row[group]``, one bar per ``row[series]``.

    For comparisons where the x axis is not a number (the demo's MiniLM-L6 figures: mean cosine per method,
    grouped by pattern, 50% and 2:4). ``reference`` draws a dashed line (e.g. ``1.0``, the dense model).
    Returns the path.

    Examples:
        >>> import os, tempfile
        >>> from prunekit.report import plot_grouped_bars
        >>> rows = [{"pattern": p, "method": m, "cosine": c} for p, m, c in
        ...         [("50%", "magnitude", 0.73), ("50%", "prunekit", 0.92), ("2:4", "magnitude", 0.61)]]
        >>> p = plot_grouped_bars(rows, os.path.join(tempfile.mkdtemp(), "bars.png"), group="pattern",
        ...                       series="method", value="cosine", ylabel="mean cosine", reference=1.0)
        >>> os.path.getsize(p) > 0
        True
    """
    for r in rows:
        for key in (group, series, value):
            if key not in r:
                raise ValueError(f"plot_grouped_bars: row {dict(r)!r} has no {key!r}; give every row "
                                 f"{group!r}, {series!r} and {value!r}")
    plt = _pyplot()
    groups = list(OrderedDict.fromkeys(str(r[group]) for r in rows))
    names = list(OrderedDict.fromkeys(str(r[series]) for r in rows))
    width = 0.8 / max(len(names), 1)
    fig, ax = plt.subplots(figsize=(max(5.0, 1.6 + 1.1 * len(groups) * max(len(names), 1) * 0.6), 4.2))
    for i, name in enumerate(names):
        xs, ys = [], []
        for r in rows:
            if str(r[series]) == name:
                xs.append(groups.index(str(r[group])) + (i - (len(names) - 1) / 2) * width)
                ys.append(float(r[value]))
        bars = ax.bar(xs, ys, width=width * 0.95, label=name)
        for b, y in zip(bars, ys):
            ax.annotate(f"{y:.3f}", (b.get_x() + b.get_width() / 2, y), ha="center", va="bottom", fontsize=7)
    if reference is not None:
        ax.axhline(reference, color="black", linestyle="--", linewidth=1)
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels(groups)
    ax.set_xlabel(group)
    ax.set_ylabel(ylabel)
    ax.set_title(title or f"{value} by {group}")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8, loc="lower left")
    return _save_figure(fig, path)
