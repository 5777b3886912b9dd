"""Attention built from projection layers: Llama / Mistral / Qwen2 (grouped-query), OPT,
Phi-3 (fused ``qkv_proj``), ViT, DistilBERT, T5 (with its relative position bias), GPT-2
(fused ``Conv1D`` qkv), and cross-attention in any of them.

The attention module is one leaf: its handler knows where each head lives in the
projections (a :class:`Layout`, detected from the module's attributes, never from
imports) and never prunes inside a head, so rotary embeddings, per-head norms and
the attention computation stay exact.

Units
-----
``gqa="groups"`` (default): one unit per key/value group -- its key and value rows
and the query rows and output columns of the query heads that read it. With as
many key/value heads as query heads (plain multi-head attention) a unit is a head.
``gqa="query_heads"``: unit ``j`` is the ``j``-th query head of every group (the
query heads are removed evenly, the key/value projections are kept).

Every tensor indexed by heads is coupled to the heads: T5's relative position bias
(the embedding's columns, and the bias tensor the first layer hands to every later
layer, which ties head ``h`` of all layers together), GPT-OSS's attention sinks,
Cohere's per-head q/k LayerNorms (a row per head). A norm of one head's size shared by
all heads (Qwen3, Gemma 3) stays as it is; a parameter over several heads' channels at
once (OLMo-2's q/k RMSNorms over every head) blocks the heads, with a reason.

Phi-3's attention splits ``qkv_proj`` where the model's ``config.num_attention_heads``
says, so its compacted heads run once that config is updated: every layer keeps the same
number of heads (``prune_groups(..., uniform=True)``) and :mod:`prunekit.compact.hf_config`
updates the config; otherwise :func:`~prunekit.compact.compact`'s check fails and the
model is left as it was.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn

from ... import reparam
from .base import Entry, ModuleHandler, Slot, TracerAPI, arg, first, has_tensor, register_handler
from ..proofs.constants import affine_row_values

__all__ = ["Layout", "ProjectionAttentionHandler", "Proj", "cache_is_fresh", "layout_of"]

GQA_MODES = ("groups", "query_heads")


@dataclass(frozen=True)
class Proj:
    """A projection inside the attention module: ``path`` (a Linear, or a GPT-2 ``Conv1D``
    whose weight is ``in x out``), and the first output row of this projection's part
    when several share one fused layer."""

    path: str
    offset: int = 0
    transposed: bool = False

    @property
    def out_axis(self) -> int:
        return 1 if self.transposed else 0

    @property
    def in_axis(self) -> int:
        return 0 if self.transposed else 1


@dataclass(frozen=True)
class Layout:
    """Where the heads of one attention module live."""

    q: Proj
    k: Proj
    v: Proj
    o: Optional[Proj]  # None: the output projection is the next module (BERT-style)
    heads: int
    kv_heads: int
    qk_dim: int  # per head
    v_dim: int  # per head
    hidden_arg: Tuple[int, str] = (0, "hidden_states")
    kv_arg: Optional[Tuple[int, str]] = None  # the key/value input of cross-attention
    cross: bool = False  # keys/values always come from kv_arg
    position_bias: Optional[Tuple[int, str, int]] = None  # (arg position, kwarg name, output index)
    relative_bias: Optional[str] = None  # an Embedding(buckets, heads) inside the module
    cache_args: Tuple[str, ...] = ("past_key_values", "past_key_value", "cache", "layer_past")
    family: str = ""


def _linear(m: nn.Module, name: str) -> Optional[nn.Linear]:
    sub = getattr(m, name, None)
    return sub if isinstance(sub, nn.Linear) else None


def _conv1d(m: nn.Module, name: str) -> Optional[Any]:  # GPT-2's Conv1D (duck-typed: nf, nx)
    sub = getattr(m, name, None)
    if sub is None or type(sub).__name__ != "Conv1D" or not isinstance(getattr(sub, "nf", None), int):
        return None
    return sub


def _int(m: nn.Module, *names: str) -> Optional[int]:
    for n in names:
        v = getattr(m, n, None)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return None


def _split(q: nn.Linear, k: nn.Linear, v: nn.Linear, head_dim: int, v_dim: Optional[int] = None) -> Optional[Tuple[int, int, int]]:
    """(heads, kv_heads, v_dim) from the projections' output sizes, or None if they do not divide."""
    nq, nk, nv = q.out_features, k.out_features, v.out_features
    if nq % head_dim or nk % head_dim:
        return None
    heads, kv = nq // head_dim, nk // head_dim
    if kv == 0 or heads % kv or nv % kv:
        return None
    vd = v_dim or nv // kv
    if vd * kv != nv:
        return None
    return heads, kv, vd


def layout_of(m: nn.Module) -> Optional[Layout]:
    """The :class:`Layout` of a supported attention module, or None.

    Examples:
        >>> import torch
        >>> class Attn(torch.nn.Module):  # the Llama naming: q/k/v/o_proj and head_dim
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.head_dim = 8
        ...         self.q_proj, self.o_proj = torch.nn.Linear(32, 32), torch.nn.Linear(32, 32)
        ...         self.k_proj, self.v_proj = torch.nn.Linear(32, 16), torch.nn.Linear(32, 16)
        >>> lay = layout_of(Attn())
        >>> lay.heads, lay.kv_heads, lay.qk_dim
        (4, 2, 8)
    """
    # Llama, Mistral, Qwen2, ViT (transformers 5) and most decoders: q/k/v/o_proj + head_dim;
    # OPT: q/k/v_proj + out_proj
    q, k, v = (_linear(m, n) for n in ("q_proj", "k_proj", "v_proj"))
    o_name = "o_proj" if _linear(m, "o_proj") else "out_proj"
    o = _linear(m, o_name)
    hd = _int(m, "head_dim")
    if q and k and v and o and hd:
        split = _split(q, k, v, hd, _int(m, "v_head_dim"))
        if split and o.in_features == split[0] * split[2]:
            return Layout(Proj("q_proj"), Proj("k_proj"), Proj("v_proj"), Proj(o_name), split[0], split[1], hd, split[2],
                          family=f"q_proj/k_proj/v_proj/{o_name}")
    # Phi-3: one fused qkv_proj (query heads, then key heads, then value heads) + o_proj
    qkv, o, kv = _linear(m, "qkv_proj"), _linear(m, "o_proj"), _int(m, "num_key_value_heads")
    if qkv and o and hd and kv and o.in_features % hd == 0:
        nq = o.in_features // hd
        if nq % kv == 0 and qkv.out_features == (nq + 2 * kv) * hd:
            return Layout(Proj("qkv_proj"), Proj("qkv_proj", nq * hd), Proj("qkv_proj", (nq + kv) * hd),
                          Proj("o_proj"), nq, kv, hd, hd, family="Phi-3")
    # DistilBERT
    q, k, v, o = (_linear(m, n) for n in ("q_lin", "k_lin", "v_lin", "out_lin"))
    hd = _int(m, "attention_head_size")
    if q and k and v and o and hd:
        split = _split(q, k, v, hd)
        if split and o.in_features == split[0] * split[2]:
            return Layout(Proj("q_lin"), Proj("k_lin"), Proj("v_lin"), Proj("out_lin"), split[0], split[1], hd, split[2],
                          family="DistilBERT")
    # T5 (self- and cross-attention share one class: keys/values from key_value_states when given)
    q, k, v, o = (_linear(m, n) for n in ("q", "k", "v", "o"))
    hd = _int(m, "key_value_proj_dim")
    if q and k and v and o and hd and _int(m, "n_heads"):
        split = _split(q, k, v, hd)
        rel = "relative_attention_bias" if getattr(m, "has_relative_attention_bias", False) else None
        if split and o.in_features == split[0] * split[2]:
            return Layout(Proj("q"), Proj("k"), Proj("v"), Proj("o"), split[0], split[1], hd, split[2],
                          kv_arg=(2, "key_value_states"), position_bias=(3, "position_bias", 1), relative_bias=rel,
                          family="T5")
    # GPT-2: one fused Conv1D for q/k/v (or q_attn + a k/v Conv1D for cross-attention)
    c_attn, c_proj = _conv1d(m, "c_attn"), _conv1d(m, "c_proj")
    hd, heads, split_size = _int(m, "head_dim"), _int(m, "num_heads"), _int(m, "split_size")
    if c_attn and c_proj and hd and heads and split_size == heads * hd and c_proj.nx == split_size:
        if getattr(m, "is_cross_attention", False):
            q_attn = _conv1d(m, "q_attn")
            if q_attn and q_attn.nf == split_size and c_attn.nf == 2 * split_size:
                return Layout(Proj("q_attn", 0, True), Proj("c_attn", 0, True), Proj("c_attn", split_size, True),
                              Proj("c_proj", 0, True), heads, heads, hd, hd, kv_arg=(-1, "encoder_hidden_states"),
                              cross=True, family="GPT-2 cross-attention")
        elif c_attn.nf == 3 * split_size:
            return Layout(Proj("c_attn", 0, True), Proj("c_attn", split_size, True), Proj("c_attn", 2 * split_size, True),
                          Proj("c_proj", 0, True), heads, heads, hd, hd, family="GPT-2")
    # BERT / RoBERTa cross-attention (self-attention has its own handler); output projection outside
    q, k, v = (_linear(m, n) for n in ("query", "key", "value"))
    hd, heads = _int(m, "attention_head_size"), _int(m, "num_attention_heads")
    if q and k and v and hd and heads and "CrossAttention" in type(m).__name__:
        split = _split(q, k, v, hd)
        if split:
            return Layout(Proj("query"), Proj("key"), Proj("value"), None, split[0], split[1], hd, split[2],
                          kv_arg=(1, "encoder_hidden_states"), cross=True, family="BERT cross-attention")
    return None


def _layout(m: nn.Module) -> Layout:
    lay = layout_of(m)
    if lay is None:
        raise RuntimeError(f"{type(m).__name__} is no longer a supported attention layout (was it changed after tracing?)")
    return lay


_FIRST_PROJECTIONS = frozenset({"q_proj", "qkv_proj", "q_lin", "q", "c_attn", "query"})


def _is_projection_attention(m: nn.Module) -> bool:
    # cheap first: every supported layout has one of these submodules
    return not _FIRST_PROJECTIONS.isdisjoint(m._modules) and layout_of(m) is not None


def _per_head(m: nn.Module, lay: Layout) -> List[Entry]:
    """Tensors with one entry per query head: T5's relative position bias, GPT-OSS's attention sinks."""
    out = [Entry(f"{lay.relative_bias}.weight", 1)] if lay.relative_bias else []
    sinks = reparam.stored(m, "sinks")
    if sinks is not None and tuple(sinks.shape) == (lay.heads,):
        out.append(Entry("sinks", 0))
    return out


def _extras(m: nn.Module, lay: Layout) -> Tuple[List[Entry], List[Entry], List[str]]:
    """The module's other parameters (q/k norms...): entries per query head, entries per key/value head,
    and the ones that span several heads' channels at once (removing heads would change them).

    A vector of one head's size is shared by every head (Qwen3's and Gemma 3's per-head norms) and
    stays; a ``(heads, head size)`` one has a row per head (Cohere's per-head LayerNorm) and follows
    its head; a vector over every head's channels (OLMo-2's q/k norms) blocks the heads.
    """
    known = [p.path for p in (lay.q, lay.k, lay.v, lay.o) if p is not None]
    known += [lay.relative_bias] if lay.relative_bias else []
    per_q: List[Entry] = []
    per_kv: List[Entry] = []
    spans: List[str] = []
    for pname, param in m.named_parameters():
        path = pname
        owner, leaf = reparam.owner_of(m, pname)
        if leaf.endswith("_orig") and reparam.is_masked(owner, leaf[:-5]):  # a pruned tensor: its own name
            path, leaf = pname[:-5], leaf[:-5]
        if any(path == k or path.startswith(k + ".") for k in known) or path == "sinks":
            continue
        shape = tuple(param.shape)  # the stored tensor (name_orig when pruned)
        if shape == (lay.qk_dim,):
            continue
        if shape[:1] == (lay.heads,) and shape[1:] in ((), (lay.qk_dim,)) and not (
                lay.kv_heads != lay.heads and path.startswith("k")):
            per_q.append(Entry(path, 0))
        elif shape[:1] == (lay.kv_heads,) and shape[1:] in ((), (lay.qk_dim,)):
            per_kv.append(Entry(path, 0))
        else:
            spans.append(f"'{path}' {list(shape)}")
    return per_q, per_kv, spans


def _rows(p: Proj, m: nn.Module, offset: int = 0) -> List[Entry]:
    e = [Entry(f"{p.path}.weight", p.out_axis, p.offset + offset)]
    if has_tensor(m, f"{p.path}.bias"):
        e.append(Entry(f"{p.path}.bias", 0, p.offset + offset))
    return e


def _cols(*projs: Proj) -> List[Entry]:
    seen, out = set(), []
    for p in projs:
        if p.path not in seen:  # a fused projection has one set of input columns
            seen.add(p.path)
            out.append(Entry(f"{p.path}.weight", p.in_axis, 0, "in"))
    return out


@register_handler(predicate=_is_projection_attention)
class ProjectionAttentionHandler(ModuleHandler):
    """Whole heads (or key/value groups) of projection-based attention; see the module docstring."""

    def slots(self, m: nn.Module) -> Dict[str, Slot]:
        lay = _layout(m)
        per_q, per_kv, _ = _extras(m, lay)
        q_in = _cols(lay.q) if lay.cross or lay.kv_arg else _cols(lay.q, lay.k, lay.v)
        slots = {
            "in": Slot(_in_size(m, lay.q), q_in, role="in"),
            "q": Slot(lay.heads * lay.qk_dim, _rows(lay.q, m), role="heads"),
            "k": Slot(lay.kv_heads * lay.qk_dim, _rows(lay.k, m), role="heads"),
            "v": Slot(lay.kv_heads * lay.v_dim, _rows(lay.v, m), role="heads"),
            "heads": Slot(lay.heads, _per_head(m, lay) + per_q, role="heads"),
        }
        if per_kv:
            slots["kv_heads"] = Slot(lay.kv_heads, per_kv, role="heads")
        if lay.cross or lay.kv_arg:
            slots["kv_in"] = Slot(_in_size(m, lay.k), _cols(lay.k, lay.v), role="in")
        if lay.o is not None:
            slots["o_in"] = Slot(lay.heads * lay.v_dim, [Entry(f"{lay.o.path}.weight", lay.o.in_axis, 0, "in")], role="in")
            slots["out"] = Slot(_out_size(m, lay.o), _rows(lay.o, m), role="out")
        else:  # the context vectors, read by the next module's input columns
            slots["ctx"] = Slot(lay.heads * lay.v_dim, [], role="heads")
        return slots

    def trace(self, m: nn.Module, name: str, tracer: TracerAPI, args: tuple, kwargs: dict, output: Any) -> None:
        lay = _layout(m)
        _, per_kv, spans = _extras(m, lay)
        ids = {s: tracer.slot(name, s) for s in _slot_names(lay) + (["kv_heads"] if per_kv else [])}
        everything = list(ids.values())
        x = arg(args, kwargs, *lay.hidden_arg)
        kv = None
        if lay.kv_arg is not None:
            kv = kwargs.get(lay.kv_arg[1]) if lay.kv_arg[0] < 0 else arg(args, kwargs, *lay.kv_arg)
        cached = [a for a in lay.cache_args if kwargs.get(a) is not None and not cache_is_fresh(kwargs[a], m, x, kv)]
        if cached:
            for t in everything:
                tracer.block(t, f"attention '{name}' was traced with cached keys/values ({cached[0]}); trace without a cache")
            return
        tracer.bind(x, -1, ids["in"])
        if "kv_in" in ids:
            if kv is None and lay.cross:
                for t in everything:
                    tracer.block(t, f"cross-attention '{name}' ran without its key/value input ({lay.kv_arg[1] if lay.kv_arg else 'none named'})")
                return
            tracer.bind(x if kv is None else kv, -1, ids["kv_in"])
        self._tie(m, name, tracer, lay, ids)
        if spans:
            reason = (f"attention '{name}': {spans[0]} spans the channels of several heads at once (e.g. a q/k norm "
                      "over every head), so removing heads would change it")
            for s in ids:
                if s not in ("in", "kv_in", "out"):
                    tracer.block(ids[s], reason)
        if lay.position_bias is not None:
            pos, key, out_index = lay.position_bias
            given = arg(args, kwargs, pos, key)
            if given is not None:
                tracer.bind(given, 1, ids["heads"])
            if isinstance(output, (tuple, list)) and len(output) > out_index:
                tracer.emit(output[out_index], 1, ids["heads"])
        ctx = _context_values(m, lay)
        if lay.o is not None:
            tracer.read(ids["o_in"], ctx)
            o_bias = f"{lay.o.path}.bias" if has_tensor(m, f"{lay.o.path}.bias") else None
            values = affine_row_values(m, f"{lay.o.path}.weight", o_bias, ctx, lay.o.out_axis, lay.o.in_axis)
            if values is not None and lay.o.transposed:  # a fused output projection is never split
                values = values[lay.o.offset:]
            tracer.emit(first(output), -1, ids["out"], values)
        else:
            tracer.emit(first(output), -1, ids["ctx"], ctx)

    def fold_constant(self, m, slot):
        lay = _layout(m)
        if slot == "in":
            projs = [lay.q] if (lay.cross or lay.kv_arg) else [lay.q, lay.k, lay.v]
        elif slot == "kv_in":
            projs = [lay.k, lay.v]
        elif slot == "o_in" and lay.o is not None:
            projs = [lay.o]
        else:
            return f"slot {slot!r} of {lay.family} attention takes no constant"
        folds, seen = [], set()
        for p in projs:
            if p.path in seen:
                continue
            seen.add(p.path)
            if not has_tensor(m, f"{p.path}.bias"):
                return f"{lay.family} attention's '{p.path}' has no bias to take the constant"
            folds.append((f"{p.path}.weight", p.in_axis, p.out_axis, f"{p.path}.bias"))
        return folds

    @staticmethod
    def _tie(m: nn.Module, name: str, tracer: TracerAPI, lay: Layout, ids: Dict[str, Any]) -> None:
        g, r = lay.kv_heads, lay.heads // lay.kv_heads
        per_head = [ids["q"].view(lay.heads, lay.qk_dim), ids["heads"].view(lay.heads, 1)]
        per_head.append((ids["o_in"] if "o_in" in ids else ids["ctx"]).view(lay.heads, lay.v_dim))
        mode = tracer.options.get("gqa", "groups") if r > 1 else "groups"
        if mode == "groups":
            rows = [t.reshape(g, -1) for t in per_head]  # query heads of a group are consecutive
            rows += [ids["k"].view(g, -1), ids["v"].view(g, -1)]
            rows += [ids["kv_heads"].view(g, 1)] if "kv_heads" in ids else []
            tracer.tie(torch.cat(rows, dim=1))
        else:
            rows = [t.reshape(g, r, -1).transpose(0, 1).reshape(r, -1) for t in per_head]
            tracer.tie(torch.cat(rows, dim=1))
            reason = (f"attention '{name}': key/value heads are kept when query heads are pruned within groups "
                      "(gqa='query_heads')")
            tracer.block(ids["k"], reason)
            tracer.block(ids["v"], reason)
            if "kv_heads" in ids:
                tracer.block(ids["kv_heads"], reason)

    def attrs(self, m: nn.Module, sizes: Dict[str, int]) -> Dict[str, Any]:
        lay = _layout(m)
        heads = sizes["q"] // lay.qk_dim
        kv_heads = sizes["k"] // lay.qk_dim
        a: Dict[str, Any] = {}
        for attr in ("num_heads", "num_attention_heads", "n_heads"):
            if _int(m, attr):
                a[attr] = heads
        if _int(m, "num_key_value_heads"):
            a["num_key_value_heads"] = kv_heads
        if _int(m, "num_key_value_groups"):
            a["num_key_value_groups"] = heads // max(kv_heads, 1)
        for attr in ("all_head_size", "inner_dim", "split_size"):
            if _int(m, attr):
                a[attr] = heads * lay.v_dim
        if lay.relative_bias:
            a[f"{lay.relative_bias}.embedding_dim"] = heads
        sizes_of = {lay.q.path: 0, lay.k.path: 0, lay.v.path: 0}
        sizes_of[lay.q.path] += sizes["q"]
        sizes_of[lay.k.path] += sizes["k"]
        sizes_of[lay.v.path] += sizes["v"]
        ins = {lay.q.path: sizes["in"]}
        for p in (lay.k, lay.v):
            ins[p.path] = sizes.get("kv_in", sizes["in"])
        if lay.o is not None:
            sizes_of[lay.o.path] = sizes["out"]
            ins[lay.o.path] = sizes["o_in"]
        for path, n_out in sizes_of.items():
            sub = m.get_submodule(path)
            if isinstance(sub, nn.Linear):
                a[f"{path}.out_features"] = n_out
                a[f"{path}.in_features"] = ins[path]
            else:  # Conv1D
                a[f"{path}.nf"] = n_out
                a[f"{path}.nx"] = ins[path]
        return a


def cache_is_fresh(cache: Any, m: nn.Module, x: Any, kv: Any) -> bool:
    """Whether a key/value cache held nothing for this layer before this call (so the keys
    and values it used came from this call's inputs only)."""
    layer = getattr(m, "layer_idx", None)
    try:
        if kv is not None and hasattr(cache, "cross_attention_cache"):
            cache, tokens = cache.cross_attention_cache, kv.shape[-2]
        else:
            cache, tokens = getattr(cache, "self_attention_cache", cache), x.shape[-2]
        stored = cache.get_seq_length(layer) if layer is not None else cache.get_seq_length()
        return int(stored) == int(tokens)
    except Exception:  # an unknown cache: assume it held something
        return False


def _context_values(m: nn.Module, lay: Layout) -> Optional[torch.Tensor]:
    """Per context index (head, dim): the constant it holds when the head's value rows are masked
    (attention averages the value bias; zero without one), NaN otherwise; None if nothing is known."""
    bias = f"{lay.v.path}.bias" if has_tensor(m, f"{lay.v.path}.bias") else None
    rows = affine_row_values(m, f"{lay.v.path}.weight", bias, None, lay.v.out_axis, lay.v.in_axis)
    if rows is None:
        return None
    v = rows[lay.v.offset: lay.v.offset + lay.kv_heads * lay.v_dim].view(lay.kv_heads, lay.v_dim)
    per_head = v[torch.arange(lay.heads) // (lay.heads // lay.kv_heads)]  # the group each query head reads
    out = per_head.reshape(-1)
    return out if bool((~torch.isnan(out)).any()) else None


def _slot_names(lay: Layout) -> List[str]:
    names = ["in", "q", "k", "v", "heads"]
    if lay.cross or lay.kv_arg:
        names.append("kv_in")
    names += ["o_in", "out"] if lay.o is not None else ["ctx"]
    return names


def _in_size(m: nn.Module, p: Proj) -> int:
    sub: Any = m.get_submodule(p.path)  # an nn.Linear, or GPT-2's Conv1D (nx, nf) when transposed
    return sub.nx if p.transposed else sub.in_features


def _out_size(m: nn.Module, p: Proj) -> int:
    sub: Any = m.get_submodule(p.path)  # an nn.Linear, or GPT-2's Conv1D (nx, nf) when transposed
    return sub.nf if p.transposed else sub.out_features
