"""Sparsity reports as data, and the plots drawn from them.

:func:`model_report` measures a model or a checkpoint: for every weight (a
tensor with two or more dimensions) its shape, element-wise sparsity, the
share of its output channels that are entirely zero, how much of it already
fits the 2:4 pattern, and the share of all-zero 4x1 blocks; plus totals. The
result is plain data (``to_dict()`` is JSON-ready), so a notebook can render
the same tables and plots as the ``prunekit`` command. The report type, its
measuring and the definition of every figure live in :mod:`prunekit.measure`
(re-exported here); this module adds the plots.

:func:`read_checkpoint` (from :mod:`prunekit.io`, re-exported here) reads what
``prunekit inspect`` accepts: a plain state dict, a ``torch.nn.utils.prune``-style
state dict (``x_orig``/``x_mask``), a plain safetensors file or a prunekit
compressed checkpoint -- never unpickling arbitrary objects unless asked to.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from typing import Any, List, Mapping, Optional, Sequence, Tuple, Union

from .measure import LayerReport, ModelReport, model_report
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

PathLike = Union[str, "os.PathLike[str]"]


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
        elif dense_accuracy is not None:  # the zoomed panel: drawn only with a dense accuracy
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
