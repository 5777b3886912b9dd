"""Sparse-kernel inference: swap pruned layers for sparse ones where it pays.

:func:`sparsify_for_inference` walks a model and, for each pruned ``Linear``
(and ``Conv2d``), decides whether a sparse kernel beats the dense one:

1. it reads the layer's effective weight (``module.weight``; a layer still
   carrying a pruning reparameterization works as is) and its sparsity;
2. below ``min_sparsity`` it keeps the layer dense without measuring;
3. otherwise it builds the sparse module, checks its output against the dense
   layer on the same input, and times both, interleaved, for a short budget;
   the layer is converted only when the sparse median is at least
   ``min_speedup`` times faster. The timing is cached by (format, layer kind
   and shape, sparsity, input rows, dtype, device, thread count), so the next
   layer of the same kind is decided without measuring again.

Formats: CSR (CPU through MKL, CUDA through cuSPARSE) and 2:4 semi-structured
(``torch.sparse.to_sparse_semi_structured``, CUDA only). On a machine without
CUDA, asking for 2:4 validates the pattern of every layer and explains why
nothing was converted.

The result is a :class:`SparsifyReport` listing every candidate layer with the
decision and its reason; :func:`restore_dense` converts back.
"""

from __future__ import annotations

import logging
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from .._backend import require_torch
from .modules import CSRConv2d, CSRLinear, SemiStructuredLinear, SparseInferenceModule, conv2d_unsupported_reason

__all__ = [
    "sparsify_for_inference",
    "restore_dense",
    "SparsifyReport",
    "LayerDecision",
    "clear_decision_cache",
    "check_n_m_pattern",
]

logger = logging.getLogger(__name__)

_FORMATS = ("auto", "csr", "2:4")
# (format, kind, shape, conv stride/padding/dilation, sparsity, input shape, dtype, device, threads)
# -> (dense_s, sparse_s); see the key built in _decide
_DECISION_CACHE: Dict[Tuple[Any, ...], Tuple[float, float]] = {}


def clear_decision_cache() -> None:
    """Forget every cached timing, so the next call measures again.

    Example:
        >>> from prunekit.sparse import clear_decision_cache
        >>> clear_decision_cache()
    """
    _DECISION_CACHE.clear()


@dataclass
class LayerDecision:
    """What :func:`sparsify_for_inference` decided for one layer, and why."""

    name: str
    kind: str
    shape: Tuple[int, ...]
    sparsity: float
    converted: bool
    reason: str
    format: Optional[str] = None
    rows: Optional[int] = None
    dense_ms: Optional[float] = None
    sparse_ms: Optional[float] = None
    cached: bool = False

    @property
    def speedup(self) -> Optional[float]:
        """Dense time over sparse time (``None`` when not measured)."""
        if self.dense_ms is None or not self.sparse_ms:
            return None
        return self.dense_ms / self.sparse_ms


@dataclass
class SparsifyReport:
    """The outcome of :func:`sparsify_for_inference`: one :class:`LayerDecision` per candidate layer."""

    layers: List[LayerDecision] = field(default_factory=list)
    format: str = "auto"
    device_note: str = ""

    @property
    def converted(self) -> List[LayerDecision]:
        return [d for d in self.layers if d.converted]

    @property
    def skipped(self) -> List[LayerDecision]:
        return [d for d in self.layers if not d.converted]

    def __getitem__(self, name: str) -> LayerDecision:
        for d in self.layers:
            if d.name == name:
                return d
        raise KeyError(f"no layer named {name!r} in this report; layers: {[d.name for d in self.layers]}")

    def summary(self) -> str:
        """A plain-text table of every decision."""
        lines = [f"sparsify_for_inference (format={self.format}): "
                 f"{len(self.converted)} of {len(self.layers)} candidate layers converted"]
        if self.device_note:
            lines.append(self.device_note)
        for d in self.layers:
            timing = ""
            if d.speedup is not None:
                timing = f" dense {d.dense_ms:.3f} ms, sparse {d.sparse_ms:.3f} ms ({d.speedup:.2f}x)"
                timing += " [cached]" if d.cached else ""
            verdict = f"-> {d.format}" if d.converted else "kept dense"
            lines.append(f"  {d.name or '<root>'} {d.kind}{list(d.shape)} sparsity {d.sparsity:.1%}: "
                         f"{verdict}; {d.reason}{timing}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()


# --------------------------------------------------------------------------- #
# pattern checks (pure)
# --------------------------------------------------------------------------- #
def check_n_m_pattern(weight: torch.Tensor, n: int = 2, m: int = 4) -> Tuple[bool, str]:
    """Whether every group of ``m`` consecutive inputs holds at most ``n`` non-zeros.

    Groups run along the last (input) dimension of ``weight`` viewed as 2-D
    ``(out, in)``, which is what semi-structured kernels require.

    Example:
        >>> import torch
        >>> from prunekit.sparse import check_n_m_pattern
        >>> check_n_m_pattern(torch.tensor([[1., 0., 2., 0., 0., 3., 0., 4.]]))
        (True, 'every group of 4 inputs holds at most 2 non-zeros')
        >>> check_n_m_pattern(torch.tensor([[1., 1., 1., 0.]]))[0]
        False
    """
    if not (isinstance(n, int) and isinstance(m, int) and 0 <= n <= m and m > 0):
        raise ValueError(f"check_n_m_pattern: need integers 0 <= n <= m, m > 0; got n={n!r}, m={m!r}")
    w = weight.detach()
    if w.dim() < 2:
        return False, f"weight has {w.dim()} dimension(s); an N:M pattern needs a 2-D (out, in) weight"
    w2 = w.reshape(w.shape[0], -1)
    cols = w2.shape[1]
    if cols % m:
        return False, f"the input dimension ({cols}) is not a multiple of {m}"
    counts = (w2 != 0).reshape(w2.shape[0], cols // m, m).sum(dim=-1)
    bad = int((counts > n).sum())
    if bad:
        return False, (f"{bad} of {counts.numel()} groups of {m} inputs hold more than {n} non-zeros "
                       f"(prune with a {n}:{m} pattern first)")
    return True, f"every group of {m} inputs holds at most {n} non-zeros"


def _semi_structured_backend() -> Any:
    """The ``SparseSemiStructuredTensor`` subclass ``to_sparse_semi_structured`` would use."""
    from torch.sparse import SparseSemiStructuredTensor, SparseSemiStructuredTensorCUSPARSELT

    cusparselt = getattr(torch.backends, "cusparselt", None)
    has_cslt = bool(cusparselt is not None and cusparselt.is_available())
    if SparseSemiStructuredTensor._FORCE_CUTLASS or not has_cslt:
        return torch.sparse.SparseSemiStructuredTensorCUTLASS
    return SparseSemiStructuredTensorCUSPARSELT


def _semi_structured_unsupported(weight: torch.Tensor, backend: Any) -> str:
    """Why the 2:4 kernels cannot take this weight ('' when they can), per PyTorch's documented limits."""
    if weight.device.type != "cuda":
        return (f"semi-structured (2:4) sparse kernels run only on CUDA devices; this layer is on "
                f"{weight.device.type}")
    limits = getattr(backend, "_DTYPE_SHAPE_CONSTRAINTS", {})
    if weight.dtype not in limits:
        names = ", ".join(str(d).replace("torch.", "") for d in limits)
        return f"dtype {weight.dtype} is not supported by the {backend.__name__} kernels ({names})"
    rows, cols = weight.shape
    c = limits[weight.dtype]
    if rows < c.sparse_min_rows or rows % c.sparse_min_rows or cols < c.sparse_min_cols or cols % c.sparse_min_cols:
        return (f"shape {tuple(weight.shape)} is not a multiple of ({c.sparse_min_rows}, {c.sparse_min_cols}) "
                f"as the {weight.dtype} kernels require")
    return ""


# --------------------------------------------------------------------------- #
# measurement
# --------------------------------------------------------------------------- #
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_pair(dense: Callable[[], Any], sparse: Callable[[], Any], device: torch.device,
               budget_s: float, max_reps: int = 25) -> Tuple[float, float]:
    """Median seconds of ``dense`` and ``sparse``, run interleaved after one warm-up each."""
    dense(), sparse()
    _sync(device)
    d_times: List[float] = []
    s_times: List[float] = []
    start = time.perf_counter()
    while len(d_times) < max_reps and (len(d_times) < 3 or time.perf_counter() - start < budget_s):
        for fn, bucket in ((dense, d_times), (sparse, s_times)):
            t0 = time.perf_counter()
            fn()
            _sync(device)
            bucket.append(time.perf_counter() - t0)
    return statistics.median(d_times), statistics.median(s_times)


def _tolerance(dtype: torch.dtype) -> float:
    return {torch.float64: 1e-8, torch.float32: 1e-4}.get(dtype, 1e-2)


def _outputs_match(sparse_out: torch.Tensor, dense_out: torch.Tensor) -> bool:
    if sparse_out.shape != dense_out.shape:
        return False
    tol = _tolerance(dense_out.dtype)
    scale = float(dense_out.abs().max()) if dense_out.numel() else 0.0
    return bool(torch.allclose(sparse_out.float(), dense_out.float(), rtol=tol, atol=tol * max(scale, 1.0)))


# --------------------------------------------------------------------------- #
# the walk
# --------------------------------------------------------------------------- #
def _kind(module: nn.Module) -> Optional[str]:
    if isinstance(module, SparseInferenceModule):
        return None
    if isinstance(module, nn.Linear):
        return "linear"
    if isinstance(module, nn.Conv2d):
        return "conv2d"
    return None


def _capture_inputs(model: nn.Module, candidates: Dict[str, nn.Module], example_inputs: Any) -> Dict[str, torch.Tensor]:
    seen: Dict[str, torch.Tensor] = {}
    handles = []
    for name, mod in candidates.items():
        def hook(_m: nn.Module, args: Tuple[Any, ...], _name: str = name) -> None:
            if _name not in seen and args and isinstance(args[0], torch.Tensor):
                seen[_name] = args[0].detach()
        handles.append(mod.register_forward_pre_hook(hook))
    try:
        with torch.no_grad():
            if isinstance(example_inputs, dict):
                model(**example_inputs)
            elif isinstance(example_inputs, (tuple, list)):
                model(*example_inputs)
            else:
                model(example_inputs)
    finally:
        for h in handles:
            h.remove()
    return seen


def _parents(model: nn.Module) -> Dict[int, List[Tuple[nn.Module, str]]]:
    """id(child) -> every (parent, attribute) that holds it (shared modules included)."""
    out: Dict[int, List[Tuple[nn.Module, str]]] = {}
    for _, parent in model.named_modules(remove_duplicate=False):
        for attr, child in parent._modules.items():
            if child is not None:
                out.setdefault(id(child), []).append((parent, attr))
    return out


def _build(kind: str, fmt: str, module: nn.Module, weight: torch.Tensor, keep_original: bool) -> nn.Module:
    if fmt == "2:4":
        return SemiStructuredLinear(module, weight, _semi_structured_backend(), keep_original)
    if kind == "linear":
        return CSRLinear(weight, module.bias, module if keep_original else None)
    return CSRConv2d(module, weight, keep_original)


def sparsify_for_inference(
    model: nn.Module,
    *,
    example_inputs: Any = None,
    batch_size: int = 8,
    format: str = "auto",
    min_sparsity: float = 0.5,
    min_speedup: float = 1.2,
    measure: bool = True,
    budget_ms: float = 30.0,
    keep_original: bool = True,
    layer_types: Sequence[str] = ("linear", "conv2d"),
) -> SparsifyReport:
    """Replace pruned ``Linear``/``Conv2d`` layers by sparse-kernel modules where that is faster.

    The model is changed in place (and also left as it was if the call
    fails). Each replaced layer computes the same output as the masked dense
    layer within float tolerance; :func:`restore_dense` swaps the originals
    back. The converted layers are for inference: their weights are buffers.

    Args:
        model: the model; pruned layers may still carry their
            reparameterization (``weight_orig``/``weight_mask``) or have had it
            removed.
        example_inputs: an input (a tensor, a tuple of positional arguments or
            a dict of keyword arguments) the model is run on once to learn each
            layer's real input; needed to consider convolutions, and makes the
            measurement match the real workload. Without it a ``Linear`` is
            measured on ``batch_size`` rows.
        batch_size: rows used to measure a ``Linear`` when no example is given.
        format: ``"csr"``, ``"2:4"`` (semi-structured, CUDA only; on CPU the
            call validates the pattern and explains why nothing was converted)
            or ``"auto"`` (2:4 where a CUDA layer is eligible, otherwise CSR).
        min_sparsity: layers sparser than this are candidates; the others are
            kept dense without measuring.
        min_speedup: how many times faster the sparse kernel must be.
        measure: ``False`` converts every candidate that passes the output
            check, without timing (for when you already know it pays).
        budget_ms: time spent measuring one layer (dense and sparse together).
        keep_original: keep a reference to each replaced module, so that
            :func:`restore_dense` returns the very same objects (dense weights
            stay in memory). ``False`` frees them; restoring then builds plain
            dense layers holding the masked weights.
        layer_types: which kinds to consider, out of ``"linear"``, ``"conv2d"``.

    Returns:
        A :class:`SparsifyReport` with one entry per candidate layer.

    Example:
        >>> import torch, prunekit
        >>> from prunekit.sparse import sparsify_for_inference, restore_dense
        >>> model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
        >>> _ = prunekit.l1_unstructured(model[0], "weight", amount=0.95)
        >>> x = torch.randn(4, 256)
        >>> expected = model(x)
        >>> report = sparsify_for_inference(model, measure=False)
        >>> [d.name for d in report.converted], type(model[0]).__name__
        (['0'], 'CSRLinear')
        >>> torch.allclose(model(x), expected, atol=1e-5)
        True
        >>> _ = restore_dense(model)
        >>> type(model[0]).__name__
        'Linear'
    """
    require_torch(model, "prunekit.sparse (sparsify_for_inference)")
    if not isinstance(model, nn.Module):
        raise TypeError(f"sparsify_for_inference: expected an nn.Module, got {type(model).__name__}")
    if format not in _FORMATS:
        raise ValueError(f"sparsify_for_inference: format={format!r}; use one of {_FORMATS}")
    if not 0.0 <= float(min_sparsity) <= 1.0:
        raise ValueError(f"sparsify_for_inference: min_sparsity={min_sparsity!r} must lie in [0, 1]")
    if not float(min_speedup) > 0:
        raise ValueError(f"sparsify_for_inference: min_speedup={min_speedup!r} must be positive")
    if not (isinstance(batch_size, int) and batch_size >= 1):
        raise ValueError(f"sparsify_for_inference: batch_size={batch_size!r} must be a positive int")
    unknown = set(layer_types) - {"linear", "conv2d"}
    if unknown:
        raise ValueError(f"sparsify_for_inference: unknown layer_types {sorted(unknown)}; use 'linear', 'conv2d'")

    report = SparsifyReport(format=format)
    if format == "2:4" and not torch.cuda.is_available():
        report.device_note = ("no CUDA device: 2:4 semi-structured kernels need one, so the pattern is only "
                              "validated and no layer is converted")

    # Candidates, named by their first path; layers inside MultiheadAttention are
    # read directly by their parent's forward and cannot be swapped.
    candidates: Dict[str, nn.Module] = {}
    mha_children = set()
    for _, mod in model.named_modules():
        if isinstance(mod, nn.MultiheadAttention):
            mha_children.update(id(c) for c in mod.modules() if c is not mod)
    for name, mod in model.named_modules():
        kind = _kind(mod)
        if kind is None or kind not in layer_types:
            continue
        if id(mod) in mha_children:
            report.layers.append(LayerDecision(name, kind, tuple(mod.weight.shape), _sparsity(mod.weight), False,
                                               "read directly by its parent nn.MultiheadAttention; cannot be swapped"))
            continue
        if mod is model:
            report.layers.append(LayerDecision(name, kind, tuple(mod.weight.shape), _sparsity(mod.weight), False,
                                               "the model itself is this layer and cannot be replaced in place; "
                                               "wrap it (nn.Sequential(layer)) or use CSRLinear.from_dense"))
            continue
        if isinstance(mod, nn.modules.lazy.LazyModuleMixin) and mod.has_uninitialized_params():
            report.layers.append(LayerDecision(name, kind, (), 0.0, False, "lazy layer not initialized yet"))
            continue
        candidates[name] = mod

    inputs: Dict[str, torch.Tensor] = {}
    if example_inputs is not None and candidates:
        inputs = _capture_inputs(model, candidates, example_inputs)

    replacements: Dict[int, nn.Module] = {}
    with torch.no_grad():
        for name, mod in candidates.items():
            decision, new = _decide(name, mod, inputs.get(name), example_inputs is not None, batch_size, format,
                                    float(min_sparsity), float(min_speedup), measure, budget_ms / 1e3,
                                    keep_original)
            report.layers.append(decision)
            if new is not None:
                replacements[id(mod)] = new

    # All decisions made without touching the model; now swap in one go.
    parents = _parents(model)
    for mod_id, new in replacements.items():
        for parent, attr in parents.get(mod_id, []):
            setattr(parent, attr, new)
    order = {n: i for i, (n, _) in enumerate(model.named_modules())}
    report.layers.sort(key=lambda d: order.get(d.name, len(order)))
    for d in report.layers:
        logger.info("sparsify_for_inference: %s %s%s sparsity %.1f%%: %s (%s)", d.name, d.kind, list(d.shape),
                    100 * d.sparsity, f"converted to {d.format}" if d.converted else "kept dense", d.reason)
    return report


def _sparsity(weight: torch.Tensor) -> float:
    n = weight.numel()
    return float((weight == 0).sum()) / n if n else 0.0


def _decide(name: str, mod: nn.Module, captured: Optional[torch.Tensor], had_example: bool, batch_size: int,
            fmt_req: str, min_sparsity: float, min_speedup: float, measure: bool, budget_s: float,
            keep_original: bool) -> Tuple[LayerDecision, Optional[nn.Module]]:
    kind = _kind(mod) or "linear"
    weight = mod.weight.detach()  # the effective (masked) weight, reparameterization or not
    shape = tuple(weight.shape)
    sparsity = _sparsity(weight)

    def no(reason: str, fmt: Optional[str] = None, **kw: Any) -> Tuple[LayerDecision, None]:
        return LayerDecision(name, kind, shape, sparsity, False, reason, fmt, **kw), None

    # Which format to try.
    fmt = fmt_req
    pattern_note = ""
    if fmt_req in ("2:4", "auto") and kind == "linear":
        ok, why = check_n_m_pattern(weight, 2, 4)
        blocked = _semi_structured_unsupported(weight, _semi_structured_backend()) if ok else ""
        if fmt_req == "2:4":
            if not ok:
                return no(f"not a 2:4 pattern: {why}", "2:4")
            if blocked:
                return no(f"2:4 pattern valid ({why}), not converted: {blocked}", "2:4")
        else:
            fmt = "2:4" if ok and not blocked else "csr"
            pattern_note = f"2:4 pattern valid ({why}); " if fmt == "2:4" else ""
    elif fmt_req == "2:4":
        return no("2:4 semi-structured kernels exist only for Linear layers", "2:4")
    elif fmt_req == "auto":
        fmt = "csr"

    if fmt == "csr" and sparsity < min_sparsity:
        return no(f"sparsity {sparsity:.1%} is below min_sparsity {min_sparsity:.0%}", fmt)
    if kind == "conv2d":
        bad = conv2d_unsupported_reason(mod)
        if bad:
            return no(f"convolution not supported by CSRConv2d: {bad}", fmt)

    # The input to measure on.
    if captured is not None:
        x = captured
    elif had_example:
        return no("not reached when the model ran on example_inputs", fmt)
    elif kind == "conv2d":
        return no("a convolution needs example_inputs to know its input size", fmt)
    else:
        x = torch.randn(batch_size, shape[1], dtype=weight.dtype, device=weight.device)
    if kind == "linear":
        rows = int(x.numel() // max(x.shape[-1], 1))
    else:
        rows = int(x.shape[0]) if x.dim() == 4 else 1

    try:
        new = _build(kind, fmt, mod, weight, keep_original)
        sparse_out = new(x)
    except Exception as exc:  # an unsupported dtype/device combination of the sparse kernels
        return no(f"{fmt} kernel unavailable here: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}", fmt)
    dense_out = mod(x)
    if not _outputs_match(sparse_out, dense_out):
        return no(f"{fmt} output differs from the dense layer beyond tolerance; kept dense", fmt)
    if not measure:
        return LayerDecision(name, kind, shape, sparsity, True, pattern_note + "converted without measuring "
                             "(measure=False)", fmt, rows), new

    key = (fmt, kind, shape, _conv_key(mod) if kind == "conv2d" else None, round(sparsity, 2),
           tuple(x.shape), weight.dtype, str(weight.device), torch.get_num_threads())
    cached = key in _DECISION_CACHE
    if not cached:
        _DECISION_CACHE[key] = _time_pair(lambda: mod(x), lambda: new(x), weight.device, budget_s)
    dense_s, sparse_s = _DECISION_CACHE[key]
    timing = dict(rows=rows, dense_ms=dense_s * 1e3, sparse_ms=sparse_s * 1e3, cached=cached)
    speedup = dense_s / sparse_s if sparse_s > 0 else float("inf")
    if speedup >= min_speedup:
        return LayerDecision(name, kind, shape, sparsity, True,
                             pattern_note + f"{fmt} is {speedup:.2f}x faster than dense on {rows} rows",
                             fmt, **timing), new
    return no(f"{fmt} is only {speedup:.2f}x as fast as dense on {rows} rows (needs {min_speedup:.2f}x)",
              fmt, **timing)


def _conv_key(mod: nn.Module) -> Tuple[Any, ...]:
    return (tuple(mod.stride), tuple(mod.padding), tuple(mod.dilation))


def restore_dense(model: nn.Module) -> nn.Module:
    """Undo :func:`sparsify_for_inference`: put dense layers back, in place.

    Each sparse module is replaced by the module it replaced when that was
    kept (``keep_original=True``, the default: the very same object, with its
    pruning reparameterization if it had one), or else by a plain dense layer
    holding the masked weights. Returns ``model`` (or the restored module when
    ``model`` itself is a sparse module).

    Example:
        >>> import torch
        >>> from prunekit.sparse import sparsify_for_inference, restore_dense
        >>> model = torch.nn.Sequential(torch.nn.Linear(64, 64))
        >>> with torch.no_grad():
        ...     model[0].weight[:, 8:] = 0
        >>> original = model[0]
        >>> _ = sparsify_for_inference(model, measure=False)
        >>> restore_dense(model)[0] is original
        True
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"restore_dense: expected an nn.Module, got {type(model).__name__}")
    if isinstance(model, SparseInferenceModule):
        return model.original if model.original is not None else model.to_dense_module()
    parents = _parents(model)
    done: Dict[int, nn.Module] = {}
    for _, mod in list(model.named_modules()):
        if isinstance(mod, SparseInferenceModule) and id(mod) not in done:
            done[id(mod)] = mod.original if mod.original is not None else mod.to_dense_module()
    for mod_id, dense in done.items():
        for parent, attr in parents.get(mod_id, []):
            setattr(parent, attr, dense)
    logger.info("restore_dense: %d sparse layer(s) restored", len(done))
    return model

