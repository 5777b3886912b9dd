"""Attention handlers: ``nn.MultiheadAttention`` and Hugging Face BERT-style self-attention."""

from __future__ import annotations

from typing import Any, Dict

from torch import nn

from .base import Entry, ModuleHandler, Slot, arg, first, has_tensor, register_handler
from ..proofs.constants import affine_row_values
from .projection_attention import cache_is_fresh

__all__ = ["BertSelfAttentionHandler", "MultiheadAttentionHandler"]


@register_handler(nn.MultiheadAttention)
class MultiheadAttentionHandler(ModuleHandler[nn.MultiheadAttention]):
    """``nn.MultiheadAttention`` with packed q/k/v weights: heads, input and output dims.

    A compacted attention layer becomes :class:`~prunekit.compact.modules.PrunedMultiheadAttention`
    (heads x head_dim may differ from embed_dim, which ``nn.MultiheadAttention`` cannot express).
    """

    @staticmethod
    def _inner(m: nn.MultiheadAttention) -> int:
        return m.num_heads * m.head_dim

    def slots(self, m: nn.MultiheadAttention) -> Dict[str, Slot]:
        inner = self._inner(m)
        heads = [Entry("in_proj_weight", 0, k * inner) for k in range(3)]
        if has_tensor(m, "in_proj_bias"):
            heads += [Entry("in_proj_bias", 0, k * inner) for k in range(3)]
        heads.append(Entry("out_proj.weight", 1, role="in"))
        out = [Entry("out_proj.weight", 0)] + ([Entry("out_proj.bias", 0)] if has_tensor(m, "out_proj.bias") else [])
        e_in = m.in_proj_weight.shape[1] if m.in_proj_weight is not None else m.embed_dim
        return {
            "in": Slot(e_in, [Entry("in_proj_weight", 1, role="in")], role="in"),
            "heads": Slot(inner, heads, role="heads", tie=m.head_dim),
            "out": Slot(m.out_proj.out_features, out, role="out"),
        }

    def trace(self, m, name, tracer, args, kwargs, output):
        ids_in, ids_h, ids_out = (tracer.slot(name, s) for s in ("in", "heads", "out"))
        from ..modules import PrunedMultiheadAttention

        supported = (isinstance(m, PrunedMultiheadAttention) or m._qkv_same_embed_dim) and m.bias_k is None and not m.add_zero_attn
        if not supported:
            reason = f"nn.MultiheadAttention '{name}' with separate kdim/vdim, bias_k/bias_v or add_zero_attn is not supported"
            for ids in (ids_in, ids_h, ids_out):
                tracer.block(ids, reason)
            return
        for i, key in enumerate(("query", "key", "value")):
            tracer.bind(arg(args, kwargs, i, key), -1, ids_in)
        inner = self._inner(m)
        # a head dim whose value rows are masked carries its value bias (attention averages a constant)
        v = affine_row_values(m, "in_proj_weight", "in_proj_bias" if has_tensor(m, "in_proj_bias") else None, None)
        ctx = None if v is None else v[2 * inner:]
        tracer.read(ids_h, ctx)
        out_b = "out_proj.bias" if has_tensor(m, "out_proj.bias") else None
        tracer.emit(first(output), -1, ids_out, affine_row_values(m, "out_proj.weight", out_b, ctx))

    def attrs(self, m, sizes):
        return {}

    def fold_constant(self, m, slot):
        if slot == "in" and has_tensor(m, "in_proj_bias"):
            return [("in_proj_weight", 1, 0, "in_proj_bias")]
        if slot == "heads" and has_tensor(m, "out_proj.bias"):
            return [("out_proj.weight", 1, 0, "out_proj.bias")]
        return "nn.MultiheadAttention without biases cannot take a constant"

    def convert(self, m, sizes):
        from ..modules import PrunedMultiheadAttention

        return PrunedMultiheadAttention.from_module(m, num_heads=sizes["heads"] // m.head_dim, embed_in=sizes["in"], embed_out=sizes["out"])


def _is_bert_self_attention(m: nn.Module) -> bool:
    return (
        "query" in m._modules
        and "CrossAttention" not in type(m).__name__  # cross-attention: projection_attention's handler
        and all(isinstance(getattr(m, k, None), nn.Linear) for k in ("query", "key", "value"))
        and isinstance(getattr(m, "num_attention_heads", None), int)
        and isinstance(getattr(m, "attention_head_size", None), int)
        and isinstance(getattr(m, "all_head_size", None), int)
    )


@register_handler(predicate=_is_bert_self_attention)
class BertSelfAttentionHandler(ModuleHandler[Any]):
    """Hugging Face BERT-style self-attention (``query``/``key``/``value`` Linears,
    ``num_attention_heads``, ``attention_head_size``, ``all_head_size``): whole heads.

    The head's output columns live in the next layer (``BertSelfOutput.dense``), which
    the tracer couples automatically.
    """

    def slots(self, m: Any) -> Dict[str, Slot]:  # duck-typed: _is_bert_self_attention checked its attributes
        heads = []
        ins = []
        for k in ("query", "key", "value"):
            heads.append(Entry(f"{k}.weight", 0))
            if has_tensor(m, f"{k}.bias"):
                heads.append(Entry(f"{k}.bias", 0))
            ins.append(Entry(f"{k}.weight", 1, role="in"))
        return {
            "in": Slot(m.query.in_features, ins, role="in"),
            "heads": Slot(m.all_head_size, heads, role="heads", tie=m.attention_head_size),
        }

    def trace(self, m, name, tracer, args, kwargs, output):
        ids_in, ids_h = tracer.slot(name, "in"), tracer.slot(name, "heads")
        x = arg(args, kwargs, 0, "hidden_states")
        tracer.bind(x, -1, ids_in)
        cached = [k for k in ("past_key_value", "past_key_values", "cache") if kwargs.get(k) is not None
                  and not cache_is_fresh(kwargs[k], m, x, None)]
        if kwargs.get("encoder_hidden_states") is not None or cached:
            tracer.block(ids_h, f"cross-attention or cached keys in '{name}' are not supported")
        bias = "value.bias" if has_tensor(m, "value.bias") else None
        tracer.emit(first(output), -1, ids_h, affine_row_values(m, "value.weight", bias, None))

    def fold_constant(self, m, slot):
        if slot == "in" and all(has_tensor(m, f"{k}.bias") for k in ("query", "key", "value")):
            return [(f"{k}.weight", 1, 0, f"{k}.bias") for k in ("query", "key", "value")]
        return "BERT self-attention without biases cannot take a constant"

    def attrs(self, m: Any, sizes: Dict[str, int]) -> Dict[str, Any]:
        n_in, n_h = sizes["in"], sizes["heads"]
        a: Dict[str, Any] = {"all_head_size": n_h, "num_attention_heads": n_h // m.attention_head_size}
        for k in ("query", "key", "value"):
            a[f"{k}.in_features"] = n_in
            a[f"{k}.out_features"] = n_h
        return a
