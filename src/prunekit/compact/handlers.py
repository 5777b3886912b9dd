"""One handler per layer type, behind a registry users can extend.

A handler tells the compaction machinery three things about a module type:

* :meth:`ModuleHandler.slots` -- its prunable dimensions ("slots"): a size and the
  parameter (or buffer) slices that index ``i`` of the slot owns, e.g. a Linear's
  ``"out"`` slot owns row ``i`` of ``weight`` and entry ``i`` of ``bias``;
* :meth:`ModuleHandler.trace` -- how its inputs and outputs relate to its slots
  (called once, after the module ran on the example inputs);
* :meth:`ModuleHandler.attrs` / :meth:`ModuleHandler.convert` -- how to update
  its attributes (``in_features``, ``num_heads``...) once its tensors are sliced,
  and, if needed, which module class replaces it.

Adding a layer type::

    from prunekit.compact import ModuleHandler, Slot, Entry, register_handler

    @register_handler(MyScale)
    class MyScaleHandler(ModuleHandler):
        def slots(self, m):
            return {"features": Slot(m.scale.numel(), [Entry("scale", 0, role="norm")], role="norm")}
        def trace(self, m, name, tracer, args, kwargs, output):
            ids = tracer.slot(name, "features")
            tracer.bind(args[0], -1, ids)
            tracer.emit(output, -1, ids)
        def attrs(self, m, sizes):
            return {}
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Type, Union

import torch
from torch import nn

__all__ = [
    "Entry",
    "HandlerRegistry",
    "ModuleHandler",
    "REGISTRY",
    "Slot",
    "register_handler",
]


@dataclass(frozen=True)
class Entry:
    """Index ``i`` of a slot is index ``offset + i`` along ``axis`` of tensor ``path``.

    ``role``: ``"in"`` for a consumer's input columns (reading the channel),
    ``"out"`` for a producer's rows and biases, ``"norm"`` for per-channel affine
    parameters, ``"buffer"`` for running statistics (sliced, never masked).
    """

    path: str
    axis: int
    offset: int = 0
    role: str = "out"


@dataclass
class Slot:
    """A prunable dimension of a module."""

    size: int
    entries: List[Entry] = field(default_factory=list)
    role: str = "out"  # "in" | "out" | "norm" | "heads"
    tie: int = 1  # consecutive blocks of this many indices are removed together (heads, norm groups)


class ModuleHandler:
    """Base class for layer handlers. See the module docstring for an example."""

    #: True for layers that can be a model's final classifier (Linear, Conv)
    classifier: bool = False

    def slots(self, module: nn.Module) -> Dict[str, Slot]:
        raise NotImplementedError

    def trace(self, module: nn.Module, name: str, tracer: Any, args: tuple, kwargs: dict, output: Any) -> None:
        raise NotImplementedError

    def attrs(self, module: nn.Module, sizes: Dict[str, int]) -> Dict[str, Any]:
        """New attribute values (dotted paths allowed) once slot sizes become ``sizes``."""
        return {}

    def convert(self, module: nn.Module, sizes: Dict[str, int]) -> Optional[nn.Module]:
        """Return a replacement module (sharing the same Parameters), or None to keep ``module``."""
        return None


class HandlerRegistry:
    """Maps module types (looked up along the MRO) or predicates to handlers."""

    def __init__(self) -> None:
        self._by_type: Dict[type, ModuleHandler] = {}
        self._predicates: List[Tuple[Callable[[nn.Module], bool], ModuleHandler]] = []

    def register(
        self, key: Union[type, Sequence[type], Callable[[nn.Module], bool]], handler: ModuleHandler
    ) -> ModuleHandler:
        if not isinstance(handler, ModuleHandler):
            raise TypeError(f"handler must be a ModuleHandler instance, got {type(handler).__name__}")
        if isinstance(key, type):
            self._by_type[key] = handler
        elif isinstance(key, (tuple, list)):
            for k in key:
                self.register(k, handler)
        elif callable(key):
            self._predicates.insert(0, (key, handler))
        else:
            raise TypeError(f"register a module type, a tuple of types or a predicate, got {key!r}")
        return handler

    def lookup(self, module: nn.Module) -> Optional[ModuleHandler]:
        for cls in type(module).__mro__:
            h = self._by_type.get(cls)
            if h is not None:
                return h
        for pred, h in self._predicates:
            try:
                if pred(module):
                    return h
            except Exception:  # a predicate must never break tracing
                continue
        return None


REGISTRY = HandlerRegistry()


def register_handler(*types: type, predicate: Optional[Callable[[nn.Module], bool]] = None, registry: Optional[HandlerRegistry] = None):
    """Class decorator: register a :class:`ModuleHandler` subclass for module types.

    Example:
        >>> from torch import nn
        >>> from prunekit.compact import ModuleHandler, register_handler, REGISTRY
        >>> class Scale(nn.Module):
        ...     def __init__(self): super().__init__(); self.s = nn.Parameter(torch.ones(4))
        ...     def forward(self, x): return x * self.s
        >>> @register_handler(Scale)
        ... class ScaleHandler(ModuleHandler):
        ...     pass
        >>> type(REGISTRY.lookup(Scale())).__name__
        'ScaleHandler'
    """
    reg = registry or REGISTRY
    if not types and predicate is None:
        raise TypeError("register_handler needs at least one module type or a predicate")

    def deco(cls: Type[ModuleHandler]) -> Type[ModuleHandler]:
        if not (isinstance(cls, type) and issubclass(cls, ModuleHandler)):
            raise TypeError(f"@register_handler decorates ModuleHandler subclasses, got {cls!r}")
        inst = cls()
        if types:
            reg.register(types, inst)
        if predicate is not None:
            reg.register(predicate, inst)
        return cls

    return deco


def _arg(args: tuple, kwargs: dict, i: int, name: str) -> Any:
    if len(args) > i:
        return args[i]
    return kwargs.get(name)


def _first(output: Any) -> Any:
    return output[0] if isinstance(output, (tuple, list)) else output


def _has(module: nn.Module, path: str) -> bool:
    owner, _, leaf = path.rpartition(".")
    mod = module.get_submodule(owner) if owner else module
    return getattr(mod, leaf, None) is not None or hasattr(mod, leaf + "_orig")


_ENTRIES: Dict[tuple, Tuple[Entry, ...]] = {}


def _entries(*spec: tuple) -> List[Entry]:
    """A fresh list of (shared, frozen) ``Entry(*args)`` for each args tuple in ``spec``.

    Entries are immutable, so one set per layout is built once and reused: the hot
    handlers' :meth:`~ModuleHandler.slots` run once per module and graph.
    """
    got = _ENTRIES.get(spec)
    if got is None:
        got = _ENTRIES[spec] = tuple(Entry(*args) for args in spec)
    return list(got)


# ------------------------------------------------------------------ built-ins
@register_handler(nn.Linear)
class LinearHandler(ModuleHandler):
    classifier = True

    def slots(self, m: nn.Module) -> Dict[str, Slot]:
        out = _entries(("weight", 0), ("bias", 0)) if _has(m, "bias") else _entries(("weight", 0))
        return {
            "in": Slot(m.in_features, _entries(("weight", 1, 0, "in")), role="in"),
            "out": Slot(m.out_features, out, role="out"),
        }

    def trace(self, m, name, tracer, args, kwargs, output):
        tracer.bind(_arg(args, kwargs, 0, "input"), -1, tracer.slot(name, "in"))
        tracer.emit(output, -1, tracer.slot(name, "out"))

    def attrs(self, m, sizes):
        return {"in_features": sizes["in"], "out_features": sizes["out"]}


@register_handler(nn.Conv1d, nn.Conv2d, nn.Conv3d)
class ConvHandler(ModuleHandler):
    """Conv1d/2d/3d. Grouped and depthwise convs are pruned by whole groups."""

    classifier = True

    def slots(self, m: nn.Module) -> Dict[str, Slot]:
        out = _entries(("weight", 0), ("bias", 0)) if _has(m, "bias") else _entries(("weight", 0))
        ins = _entries(("weight", 1, 0, "in")) if m.groups == 1 else []
        return {"in": Slot(m.in_channels, ins, role="in"), "out": Slot(m.out_channels, out, role="out")}

    def trace(self, m, name, tracer, args, kwargs, output):
        x = _arg(args, kwargs, 0, "input")
        cdim = x.dim() - len(m.kernel_size) - 1
        ins, outs = tracer.slot(name, "in"), tracer.slot(name, "out")
        tracer.bind(x, cdim, ins)
        if m.groups > 1:
            tracer.tie(torch.cat([ins.view(m.groups, -1), outs.view(m.groups, -1)], dim=1))
        tracer.emit(output, cdim, outs)

    def attrs(self, m, sizes):
        a = {"in_channels": sizes["in"], "out_channels": sizes["out"]}
        if m.groups > 1:
            a["groups"] = sizes["in"] // (m.in_channels // m.groups)
        return a


@register_handler(nn.modules.batchnorm._BatchNorm)
class BatchNormHandler(ModuleHandler):
    def slots(self, m: nn.Module) -> Dict[str, Slot]:
        affine = ("weight", 0, 0, "norm"), ("bias", 0, 0, "norm")
        stats = ("running_mean", 0, 0, "buffer"), ("running_var", 0, 0, "buffer")
        e = _entries(*(affine if m.affine else ()), *(stats if m.track_running_stats and m.running_mean is not None else ()))
        return {"features": Slot(m.num_features, e, role="norm")}

    def trace(self, m, name, tracer, args, kwargs, output):
        ids = tracer.slot(name, "features")
        tracer.bind(_arg(args, kwargs, 0, "input"), 1, ids)
        tracer.emit(output, 1, ids)

    def attrs(self, m, sizes):
        return {"num_features": sizes["features"]}


@register_handler(nn.GroupNorm)
class GroupNormHandler(ModuleHandler):
    """GroupNorm is pruned by whole groups, which leaves the other groups' statistics exact."""

    def slots(self, m: nn.Module) -> Dict[str, Slot]:
        e = [Entry("weight", 0, role="norm"), Entry("bias", 0, role="norm")] if m.affine else []
        return {"channels": Slot(m.num_channels, e, role="norm", tie=m.num_channels // m.num_groups)}

    def trace(self, m, name, tracer, args, kwargs, output):
        ids = tracer.slot(name, "channels")
        tracer.bind(_arg(args, kwargs, 0, "input"), 1, ids)
        tracer.emit(output, 1, ids)

    def attrs(self, m, sizes):
        per = m.num_channels // m.num_groups
        return {"num_channels": sizes["channels"], "num_groups": sizes["channels"] // per}


@register_handler(nn.LayerNorm)
class LayerNormHandler(ModuleHandler):
    """LayerNorm over the last dimension.

    Removing features changes the mean and variance it computes, so with
    ``exact=True`` (the default) its features are blocked; ``exact=False`` allows
    it (the compacted model then differs from the masked one).
    """

    def slots(self, m: nn.Module) -> Dict[str, Slot]:
        e = []
        if m.elementwise_affine:
            e.append(Entry("weight", 0, role="norm"))
            if _has(m, "bias"):
                e.append(Entry("bias", 0, role="norm"))
        return {"features": Slot(m.normalized_shape[-1], e, role="norm")}

    def trace(self, m, name, tracer, args, kwargs, output):
        ids = tracer.slot(name, "features")
        x = _arg(args, kwargs, 0, "input")
        tracer.bind(x, -1, ids)
        if len(m.normalized_shape) != 1:
            tracer.block(ids, f"LayerNorm '{name}' normalizes over several dimensions {tuple(m.normalized_shape)}")
            return
        if tracer.exact:
            tracer.block(
                ids,
                f"LayerNorm '{name}' normalizes over these features: removing some changes its statistics "
                "(pass exact=False to prune them anyway)",
            )
        tracer.emit(output, -1, ids)

    def attrs(self, m, sizes):
        return {"normalized_shape": (sizes["features"],)}


@register_handler(nn.Embedding)
class EmbeddingHandler(ModuleHandler):
    def slots(self, m: nn.Module) -> Dict[str, Slot]:
        return {"dim": Slot(m.embedding_dim, [Entry("weight", 1)], role="out")}

    def trace(self, m, name, tracer, args, kwargs, output):
        ids = tracer.slot(name, "dim")
        if m.max_norm is not None:
            tracer.block(ids, f"Embedding '{name}' renormalizes rows (max_norm)")
        tracer.emit(output, -1, ids)

    def attrs(self, m, sizes):
        return {"embedding_dim": sizes["dim"]}


@register_handler(nn.MultiheadAttention)
class MultiheadAttentionHandler(ModuleHandler):
    """``nn.MultiheadAttention`` with packed q/k/v weights: heads, input and output dims.

    A compacted attention layer becomes :class:`~prunekit.compact.modules.PrunedMultiheadAttention`
    (heads x head_dim may differ from embed_dim, which ``nn.MultiheadAttention`` cannot express).
    """

    @staticmethod
    def _inner(m: nn.Module) -> int:
        return m.num_heads * m.head_dim

    def slots(self, m: nn.Module) -> Dict[str, Slot]:
        inner = self._inner(m)
        heads = [Entry("in_proj_weight", 0, k * inner) for k in range(3)]
        if _has(m, "in_proj_bias"):
            heads += [Entry("in_proj_bias", 0, k * inner) for k in range(3)]
        heads.append(Entry("out_proj.weight", 1, role="in"))
        out = [Entry("out_proj.weight", 0)] + ([Entry("out_proj.bias", 0)] if _has(m, "out_proj.bias") else [])
        e_in = m.in_proj_weight.shape[1] if m.in_proj_weight is not None else m.embed_dim
        return {
            "in": Slot(e_in, [Entry("in_proj_weight", 1, role="in")], role="in"),
            "heads": Slot(inner, heads, role="heads", tie=m.head_dim),
            "out": Slot(m.out_proj.out_features, out, role="out"),
        }

    def trace(self, m, name, tracer, args, kwargs, output):
        ids_in, ids_h, ids_out = (tracer.slot(name, s) for s in ("in", "heads", "out"))
        from .modules import PrunedMultiheadAttention

        supported = (isinstance(m, PrunedMultiheadAttention) or m._qkv_same_embed_dim) and m.bias_k is None and not m.add_zero_attn
        if not supported:
            reason = f"nn.MultiheadAttention '{name}' with separate kdim/vdim, bias_k/bias_v or add_zero_attn is not supported"
            for ids in (ids_in, ids_h, ids_out):
                tracer.block(ids, reason)
            return
        for i, key in enumerate(("query", "key", "value")):
            tracer.bind(_arg(args, kwargs, i, key), -1, ids_in)
        tracer.emit(_first(output), -1, ids_out)

    def attrs(self, m, sizes):
        return {}

    def convert(self, m, sizes):
        from .modules import PrunedMultiheadAttention

        return PrunedMultiheadAttention.from_module(m, num_heads=sizes["heads"] // m.head_dim, embed_in=sizes["in"], embed_out=sizes["out"])


def _is_bert_self_attention(m: nn.Module) -> bool:
    return (
        all(isinstance(getattr(m, k, None), nn.Linear) for k in ("query", "key", "value"))
        and isinstance(getattr(m, "num_attention_heads", None), int)
        and isinstance(getattr(m, "attention_head_size", None), int)
        and isinstance(getattr(m, "all_head_size", None), int)
    )


@register_handler(predicate=_is_bert_self_attention)
class BertSelfAttentionHandler(ModuleHandler):
    """Hugging Face BERT-style self-attention (``query``/``key``/``value`` Linears,
    ``num_attention_heads``, ``attention_head_size``, ``all_head_size``): whole heads.

    The head's output columns live in the next layer (``BertSelfOutput.dense``), which
    the tracer couples automatically.
    """

    def slots(self, m: nn.Module) -> Dict[str, Slot]:
        heads = []
        ins = []
        for k in ("query", "key", "value"):
            heads.append(Entry(f"{k}.weight", 0))
            if _has(m, f"{k}.bias"):
                heads.append(Entry(f"{k}.bias", 0))
            ins.append(Entry(f"{k}.weight", 1, role="in"))
        return {
            "in": Slot(m.query.in_features, ins, role="in"),
            "heads": Slot(m.all_head_size, heads, role="heads", tie=m.attention_head_size),
        }

    def trace(self, m, name, tracer, args, kwargs, output):
        ids_in, ids_h = tracer.slot(name, "in"), tracer.slot(name, "heads")
        tracer.bind(_arg(args, kwargs, 0, "hidden_states"), -1, ids_in)
        if kwargs.get("encoder_hidden_states") is not None or kwargs.get("past_key_value") is not None:
            tracer.block(ids_h, f"cross-attention or cached keys in '{name}' are not supported")
        tracer.emit(_first(output), -1, ids_h)

    def attrs(self, m, sizes):
        n_in, n_h = sizes["in"], sizes["heads"]
        a: Dict[str, Any] = {"all_head_size": n_h, "num_attention_heads": n_h // m.attention_head_size}
        for k in ("query", "key", "value"):
            a[f"{k}.in_features"] = n_in
            a[f"{k}.out_features"] = n_h
        return a
