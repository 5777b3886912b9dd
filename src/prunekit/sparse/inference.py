"""Sparse-kernel inference: swap pruned layers for sparse ones where it pays.

:func:`sparsify_for_inference` walks a model and, for each pruned ``Linear``
(and ``Conv2d``), decides how to run it:

1. it reads the layer's effective weight (``module.weight``; a layer still
   carrying a pruning reparameterization works as is) and its sparsity;
2. below ``min_sparsity`` it keeps the layer dense without measuring;
3. otherwise it lists every execution policy that can run the layer
   (:mod:`prunekit.sparse.policies`: prunekit's compiled CSR and 4x1/1x4
   block kernels, torch's CSR kernel, each on torch's thread count and on one
   thread, a smaller dense product for whole zero channels, 2:4 on CUDA),
   checks each one's output against the dense layer on the layer's real
   input, and times them all in context -- each call right after a call of
   the dense layer, as inside a model -- for a short budget. The fastest is
   kept when it beats dense by ``min_speedup``; otherwise the layer stays
   dense, so a converted model is never slower than the dense one by the
   measurement. Timings are cached by layer kind and shape, sparsity, block
   structure, input shape, dtype, device and thread count, so the next layer
   of the same kind is decided without measuring again.

The result is a :class:`SparsifyReport` listing every candidate layer with its
decision, the reason, and the figure of every policy measured;
:func:`restore_dense` converts back. Both change the model all at once or not
at all: on any exception, ``KeyboardInterrupt`` included, the model is left
as it was.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Dict, List, Mapping, Optional, Sequence, Set, Tuple, Union

import torch
from torch import nn

from .._backend import require_torch
from . import native
from .modules import SemiStructuredLinear, SparseInferenceModule, conv2d_unsupported_reason
from .modules.semi_structured import _semi_structured_backend, _semi_structured_unsupported, check_n_m_pattern
from .policies import POLICIES, candidates, measure_in_context, policies_for_format, preferred

__all__ = [
    "sparsify_for_inference",
    "restore_dense",
    "SparsifyReport",
    "LayerDecision",
    "clear_decision_cache",
    "check_n_m_pattern",
]

logger = logging.getLogger(__name__)
Layer = Union[nn.Linear, nn.Conv2d]  # the layers it converts

_FORMATS = ("auto", "csr", "bsr", "channels", "2:4")
# key built in _decide -> (dense_s, {policy: seconds})
_DECISION_CACHE: Dict[Tuple[Any, ...], Tuple[float, Dict[str, float]]] = {}


def clear_decision_cache() -> None:
    """Forget every cached timing, so the next call measures again.

    Examples:
        >>> from prunekit.sparse import clear_decision_cache
        >>> clear_decision_cache()
    """
    _DECISION_CACHE.clear()


@dataclass
class LayerDecision:
    """What :func:`sparsify_for_inference` decided for one layer, and why.

    ``policy`` is the execution policy the layer runs with when converted
    (else the fastest one measured, or ``None``); ``timings_ms`` holds the
    median of every policy measured (``"dense"`` included), ``not_tried`` the
    policies that could not run this layer and why.
    """

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
    policy: Optional[str] = None
    timings_ms: Dict[str, float] = field(default_factory=dict)
    not_tried: Dict[str, str] = field(default_factory=dict)

    @property
    def speedup(self) -> Optional[float]:
        """Dense time over the chosen (or fastest) policy's time (``None`` when not measured)."""
        if self.dense_ms is None or not self.sparse_ms:
            return None
        return self.dense_ms / self.sparse_ms

    def timings_line(self) -> str:
        """Every measured policy, fastest first: ``'csr 0.50 ms (9.1x), csr-1t ...'``."""
        if not self.timings_ms or "dense" not in self.timings_ms:
            return ""
        dense = self.timings_ms["dense"]
        parts = [f"{name} {ms:.3f} ms ({dense / ms:.2f}x)" if ms > 0 else f"{name} {ms:.3f} ms"
                 for name, ms in sorted(self.timings_ms.items(), key=lambda kv: kv[1]) if name != "dense"]
        return f"dense {dense:.3f} ms; " + ", ".join(parts)


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
        """A plain-text table of every decision, with every measured policy's figure."""
        lines = [f"sparsify_for_inference (format={self.format}): "
                 f"{len(self.converted)} of {len(self.layers)} candidate layers converted"]
        if self.device_note:
            lines.append(self.device_note)
        for d in self.layers:
            verdict = f"-> {d.policy}" if d.converted else "kept dense"
            lines.append(f"  {d.name or '<root>'} {d.kind}{list(d.shape)} sparsity {d.sparsity:.1%}: "
                         f"{verdict}; {d.reason}")
            timings = d.timings_line()
            if timings:
                lines.append(f"      {timings}" + (" [cached]" if d.cached else ""))
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()


# --------------------------------------------------------------------------- #
# output check
# --------------------------------------------------------------------------- #
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


def _capture_inputs(model: nn.Module, candidates_: Mapping[str, nn.Module], example_inputs: Any) -> Dict[str, torch.Tensor]:
    """Each candidate layer's first input, from one no-grad run in eval mode (training flags restored)."""
    seen: Dict[str, torch.Tensor] = {}
    handles = []
    modes = [(m, m.training) for m in model.modules()]
    try:
        for name, mod in candidates_.items():
            def hook(_m: nn.Module, args: Tuple[Any, ...], _name: str = name) -> None:
                if _name not in seen and args and isinstance(args[0], torch.Tensor):
                    seen[_name] = args[0].detach()
            handles.append(mod.register_forward_pre_hook(hook))
        model.eval()  # running statistics (BatchNorm) must not move
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
        for m, training in modes:
            m.training = training
    return seen


def _parents(model: nn.Module) -> Dict[int, List[Tuple[nn.Module, str]]]:
    """id(child) -> every (parent, attribute) that holds it (shared modules included)."""
    out: Dict[int, List[Tuple[nn.Module, str]]] = {}
    for _, parent in model.named_modules(remove_duplicate=False):
        for attr, child in parent._modules.items():
            if child is not None:
                out.setdefault(id(child), []).append((parent, attr))
    return out


def _swap(model: nn.Module, replacements: Dict[int, nn.Module], result: Any) -> Any:
    """Put each replacement wherever its module sits, all or nothing (any exception undoes the done ones);
    returns ``result``. The caller's last step: ``return _swap(...)``, so that no failure (an interrupt
    included) can land between a completed swap and the caller's return."""
    parents = _parents(model)
    done: List[Tuple[nn.Module, str, Optional[nn.Module]]] = []
    try:
        for mod_id, new in replacements.items():
            for parent, attr in parents.get(mod_id, []):
                # recorded before the swap: an interrupt right after setattr is undone too
                done.append((parent, attr, parent._modules[attr]))
                setattr(parent, attr, new)
        return result
    except BaseException:
        for parent, attr, old in reversed(done):
            parent._modules[attr] = old
        raise


def sparsify_for_inference(
    model: nn.Module, *, example_inputs: Any = None, batch_size: int = 8, format: str = "auto",
    min_sparsity: float = 0.5, min_speedup: float = 1.2, measure: bool = True, budget_ms: float = 100.0,
    keep_original: bool = True, layer_types: Sequence[str] = ("linear", "conv2d"),
    policies: Optional[Sequence[str]] = None,
) -> SparsifyReport:
    """Run pruned ``Linear``/``Conv2d`` layers on the fastest measured sparse kernel, where that beats dense.

    The model is changed in place, all at once: if the call fails (any
    exception, ``KeyboardInterrupt`` included) the model is left exactly as it
    was. Each replaced layer computes the same output as the masked dense
    layer within float tolerance; :func:`restore_dense` swaps the originals
    back. The converted layers are for inference: their weights are buffers.

    Args:
        model: the model; pruned layers may still carry their
            reparameterization (``weight_orig``/``weight_mask``) or have had it
            removed.
        example_inputs: an input (a tensor, a tuple of positional arguments or
            a dict of keyword arguments) the model is run on once, in eval
            mode, to learn each layer's real input; needed to consider
            convolutions, and makes the measurement match the real workload.
            Without it a ``Linear`` is measured on ``batch_size`` rows.
        batch_size: rows used to measure a ``Linear`` when no example is given.
        format: ``"auto"`` (every policy), ``"csr"``, ``"bsr"`` (4x1/1x4
            blocks), ``"channels"`` (whole zero rows/columns dropped) or
            ``"2:4"`` (semi-structured, CUDA only; on CPU the call validates
            the pattern and explains why nothing was converted).
        min_sparsity: layers sparser than this are candidates; the others are
            kept dense without measuring.
        min_speedup: how many times faster than dense the fastest policy must
            be: a margin against measurement noise (below 1 accepts a slower
            kernel, e.g. to save memory).
        measure: ``False`` converts every candidate that passes the output
            check to the first policy that can run it (blocked layouts, then
            prunekit's CSR, then torch's CSR on one thread), without timing.
        budget_ms: time spent measuring one layer (all policies together; at
            least 5 rounds are always run).
        keep_original: keep a reference to each replaced module, so that
            :func:`restore_dense` returns the very same objects (dense weights
            stay in memory). ``False`` frees them; restoring then builds plain
            dense layers holding the masked weights.
        layer_types: which kinds to consider, out of ``"linear"``, ``"conv2d"``.
        policies: restrict the policies tried (names in
            :data:`prunekit.sparse.policies.POLICIES`, e.g. ``["csr", "csr-1t"]``);
            without measuring, the first of them that can run a layer is used.

    Returns:
        A :class:`SparsifyReport` with one entry per candidate layer.

    Examples:
        >>> import torch, prunekit
        >>> from prunekit.sparse import sparsify_for_inference, restore_dense
        >>> model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
        >>> _ = prunekit.l1_unstructured(model[0], "weight", amount=0.95)
        >>> x = torch.randn(4, 256)
        >>> expected = model(x)
        >>> report = sparsify_for_inference(model, measure=False, policies=["csr-torch"])
        >>> [d.name for d in report.converted], type(model[0]).__name__, model[0].policy
        (['0'], 'CSRLinear', 'csr-torch')
        >>> torch.allclose(model(x), expected, atol=1e-5)
        True
        >>> _ = restore_dense(model)
        >>> type(model[0]).__name__
        'Linear'
    """
    require_torch(model, "prunekit.sparse (sparsify_for_inference)")
    wanted = _check_arguments(model, format, min_sparsity, min_speedup, batch_size, layer_types, policies)
    report = SparsifyReport(format=format, device_note=_device_note(format, wanted))
    layers = _candidates(model, layer_types, report)
    inputs = _capture_inputs(model, layers, example_inputs) if example_inputs is not None and layers else {}
    replacements: Dict[int, nn.Module] = {}
    with torch.no_grad():
        for name, mod in layers.items():
            decision, new = _decide(name, mod, inputs.get(name), example_inputs is not None, batch_size, format,
                                    wanted, float(min_sparsity), float(min_speedup), measure, budget_ms / 1e3,
                                    keep_original)
            report.layers.append(decision)
            if new is not None:
                replacements[id(mod)] = new
    _sort_and_log(model, report)
    # Every decision is made without touching the model; now swap, all or nothing, as the last step.
    return _swap(model, replacements, report)


def _check_arguments(model: Any, format: str, min_sparsity: float, min_speedup: float, batch_size: int,
                     layer_types: Sequence[str], policies: Optional[Sequence[str]]) -> List[str]:
    """Refuse bad arguments of :func:`sparsify_for_inference`; return the policies it may try, in order."""
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
    wanted = list(policies_for_format(format))
    if policies is None:
        return wanted
    if isinstance(policies, str):
        raise TypeError(f"sparsify_for_inference: policies={policies!r} must be a list of names, "
                        f"e.g. [{policies!r}]")
    bad = [p for p in policies if p not in POLICIES]
    if bad or not policies:
        raise ValueError(f"sparsify_for_inference: unknown policies {bad or list(policies)}; "
                         f"use names from {list(POLICIES)}")
    wanted = [p for p in policies if p in wanted]
    if not wanted:
        raise ValueError(f"sparsify_for_inference: none of policies={list(policies)} belongs to "
                         f"format={format!r} ({list(policies_for_format(format))})")
    return wanted


def _device_note(format: str, wanted: List[str]) -> str:
    """Why this process cannot run some of the ``wanted`` policies ('' when it can run them all)."""
    if format == "2:4" and not torch.cuda.is_available():
        return ("no CUDA device: 2:4 semi-structured kernels need one, so the pattern is only "
                "validated and no layer is converted")
    if not native.available() and any(not p.startswith(("2:4", "channels")) and "torch" not in p for p in wanted):
        return f"prunekit's compiled kernels: {native.unavailable_reason()}"
    return ""


def _candidates(model: nn.Module, layer_types: Sequence[str], report: SparsifyReport) -> Dict[str, Layer]:
    """The layers to decide on, named by their first path; those that cannot be swapped go to ``report``.

    Layers inside ``MultiheadAttention`` are read directly by their parent's
    forward, the model itself cannot be replaced in place, and a lazy layer
    has no weight yet.
    """
    layers: Dict[str, Layer] = {}
    mha_children: Set[int] = set()
    for _, mod in model.named_modules():
        if isinstance(mod, nn.MultiheadAttention):
            mha_children.update(id(c) for c in mod.modules() if c is not mod)
    for name, mod in model.named_modules():
        kind = _kind(mod)
        if kind is None or kind not in layer_types or not isinstance(mod, (nn.Linear, nn.Conv2d)):
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
        layers[name] = mod
    return layers


def _sort_and_log(model: nn.Module, report: SparsifyReport) -> None:
    """Put the report's decisions in the model's module order and log each one."""
    order = {n: i for i, (n, _) in enumerate(model.named_modules())}
    report.layers.sort(key=lambda d: order.get(d.name, len(order)))
    for d in report.layers:
        logger.info("sparsify_for_inference: %s %s%s sparsity %.1f%%: %s (%s) %s", d.name, d.kind, list(d.shape),
                    100 * d.sparsity, f"converted to {d.policy}" if d.converted else "kept dense", d.reason,
                    d.timings_line())


def _sparsity(weight: torch.Tensor) -> float:
    n = weight.numel()
    return float((weight == 0).sum()) / n if n else 0.0


def _layout(policy: str) -> str:
    return policy.split("-")[0]


def _decide(name: str, mod: Layer, captured: Optional[torch.Tensor], had_example: bool, batch_size: int,
            fmt_req: str, wanted: List[str], min_sparsity: float, min_speedup: float, measure: bool,
            budget_s: float, keep_original: bool) -> Tuple[LayerDecision, Optional[nn.Module]]:
    kind = _kind(mod) or "linear"
    weight = mod.weight.detach()  # the effective (masked) weight, reparameterization or not
    shape = tuple(weight.shape)
    sparsity = _sparsity(weight)

    def no(reason: str, fmt: Optional[str] = None, **kw: Any) -> Tuple[LayerDecision, None]:
        return LayerDecision(name, kind, shape, sparsity, False, reason, fmt, **kw), None

    # 2:4 semi-structured (CUDA): validate the pattern, say why it cannot run.
    semi_builder = None
    semi_reason = ""
    pattern_note = ""
    if "2:4" in wanted:
        if not isinstance(mod, nn.Linear):  # kind "conv2d"
            if fmt_req == "2:4":
                return no("2:4 semi-structured kernels exist only for Linear layers", "2:4")
            semi_reason = "2:4 kernels take only Linear layers"
        else:
            ok, why = check_n_m_pattern(weight, 2, 4)
            blocked = _semi_structured_unsupported(weight, _semi_structured_backend()) if ok else ""
            if fmt_req == "2:4":
                if not ok:
                    return no(f"not a 2:4 pattern: {why}", "2:4")
                if blocked:
                    return no(f"2:4 pattern valid ({why}), not converted: {blocked}", "2:4")
            if ok and not blocked:
                pattern_note = f"2:4 pattern valid ({why}); "
                semi_builder = partial(SemiStructuredLinear, mod, weight, _semi_structured_backend(), keep_original)
            else:
                semi_reason = f"not a 2:4 pattern: {why}" if not ok else blocked

    if sparsity < min_sparsity and semi_builder is None:
        return no(f"sparsity {sparsity:.1%} is below min_sparsity {min_sparsity:.0%}", _layout(wanted[0]))
    if isinstance(mod, nn.Conv2d):  # kind "conv2d"
        bad = conv2d_unsupported_reason(mod)
        if bad:
            return no(f"convolution not supported by CSRConv2d: {bad}", "csr")

    # The input to measure on.
    if captured is not None:
        x = captured
    elif had_example:
        return no("not reached when the model ran on example_inputs")
    elif kind == "conv2d":
        return no("a convolution needs example_inputs to know its input size", "csr")
    else:
        x = torch.randn(batch_size, shape[1], dtype=weight.dtype, device=weight.device)
    rows = int(x.numel() // max(x.shape[-1], 1)) if kind == "linear" else (int(x.shape[0]) if x.dim() == 4 else 1)

    builders, not_tried = candidates(kind, mod, weight, wanted, keep_original, semi_builder, semi_reason)
    dense_out = mod(x)
    built: Dict[str, nn.Module] = {}
    for policy in preferred(list(builders)):
        try:
            new = builders[policy]()
            out = new(x)
        except Exception as exc:  # an unsupported dtype/device combination of a sparse kernel
            not_tried[policy] = f"unavailable here: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
            continue
        if not _outputs_match(out, dense_out):
            not_tried[policy] = "output differs from the dense layer beyond tolerance"
            continue
        built[policy] = new
        if not measure:
            break  # the first that runs, in order of preference
    if not built:
        why = "; ".join(f"{p}: {r}" for p, r in not_tried.items()) or "no policy applies"
        return no(f"no sparse policy can run this layer ({why})", _layout(wanted[0]), not_tried=not_tried)
    if not measure:
        policy, new = next(iter(built.items()))
        return LayerDecision(name, kind, shape, sparsity, True, pattern_note + "converted without measuring "
                             "(measure=False)", _layout(policy), rows, policy=policy, not_tried=not_tried), new

    structure = tuple(sorted(built))  # which layouts fit this weight (block fill, zero channels) decides the set
    key = (kind, shape, _conv_key(mod) if isinstance(mod, nn.Conv2d) else None, round(sparsity, 2), structure,
           tuple(x.shape), weight.dtype, str(weight.device), torch.get_num_threads())
    cached = key in _DECISION_CACHE
    if not cached:
        fns = {policy: partial(m, x) for policy, m in built.items()}
        _DECISION_CACHE[key] = measure_in_context(lambda: mod(x), fns, weight.device, budget_s)
    dense_s, times = _DECISION_CACHE[key]
    best = min(times, key=lambda p: times[p])
    timings_ms = {"dense": dense_s * 1e3, **{p: t * 1e3 for p, t in times.items()}}
    speedup = dense_s / times[best] if times[best] > 0 else float("inf")
    info: Dict[str, Any] = dict(rows=rows, dense_ms=dense_s * 1e3, sparse_ms=times[best] * 1e3, cached=cached, policy=best,
                timings_ms=timings_ms, not_tried=not_tried)
    if speedup >= min_speedup:
        return LayerDecision(name, kind, shape, sparsity, True,
                             pattern_note + f"{best} is {speedup:.2f}x faster than dense on {rows} rows",
                             _layout(best), **info), built[best]
    return no(f"the fastest policy, {best}, is only {speedup:.2f}x as fast as dense on {rows} rows "
              f"(needs {min_speedup:.2f}x)", _layout(best), **info)


def _conv_key(mod: nn.Conv2d) -> Tuple[Any, ...]:
    return (tuple(mod.stride), tuple(mod.padding), tuple(mod.dilation))


def restore_dense(model: nn.Module) -> nn.Module:
    """Undo :func:`sparsify_for_inference`: put dense layers back, in place, all or nothing.

    Each sparse module is replaced by the module it replaced when that was
    kept (``keep_original=True``, the default: the very same object, with its
    pruning reparameterization if it had one), or else by a plain dense layer
    holding the masked weights. Returns ``model`` (or the restored module when
    ``model`` itself is a sparse module). On any exception,
    ``KeyboardInterrupt`` included, the model is left as it was.

    Examples:
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
    dense: Dict[int, nn.Module] = {}
    for _, mod in list(model.named_modules()):
        if isinstance(mod, SparseInferenceModule) and id(mod) not in dense:
            dense[id(mod)] = mod.original if mod.original is not None else mod.to_dense_module()
    logger.info("restore_dense: %d sparse layer(s) to restore", len(dense))
    return _swap(model, dense, model)  # the last step (see _swap)
