"""Replacement modules for layers whose compacted shape their original class cannot express."""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["PrunedMultiheadAttention", "REPLACEMENTS"]


class PrunedMultiheadAttention(nn.MultiheadAttention):
    """``nn.MultiheadAttention`` after head (and embedding) pruning.

    ``num_heads * head_dim`` may differ from the input size ``embed_dim`` and from the
    output size ``out_proj.out_features``. Same call signature and outputs as
    ``nn.MultiheadAttention`` (packed q/k/v weights, no ``bias_k``/``add_zero_attn``).
    It never takes PyTorch's fused fast path (``_qkv_same_embed_dim`` is False), so
    ``nn.TransformerEncoderLayer`` runs it through this forward.

    Examples:
        >>> m = PrunedMultiheadAttention(embed_dim=16, num_heads=2, head_dim=4, embed_out=16, batch_first=True)
        >>> x = torch.randn(3, 5, 16)
        >>> m(x, x, x)[0].shape
        torch.Size([3, 5, 16])
    """

    in_proj_weight_orig: Tensor  # present once in_proj_weight is pruned

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        head_dim: int,
        embed_out: Optional[int] = None,
        bias: bool = True,
        dropout: float = 0.0,
        batch_first: bool = False,
        device=None,
        dtype=None,
    ) -> None:
        nn.Module.__init__(self)
        kw = {"device": device, "dtype": dtype}
        inner = num_heads * head_dim
        embed_out = embed_dim if embed_out is None else embed_out
        self.embed_dim = embed_dim
        self.kdim = self.vdim = embed_dim
        self._qkv_same_embed_dim = False
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.dropout = dropout
        self.batch_first = batch_first
        self.in_proj_weight = nn.Parameter(torch.empty(3 * inner, embed_dim, **kw))
        # torch annotates both as always present; bias=False makes in_proj_bias None (as in nn.MultiheadAttention)
        self.in_proj_bias = nn.Parameter(torch.zeros(3 * inner, **kw)) if bias else None  # type: ignore[assignment]
        self.register_parameter("q_proj_weight", None)
        self.register_parameter("k_proj_weight", None)
        self.register_parameter("v_proj_weight", None)
        self.out_proj = nn.Linear(inner, embed_out, bias=bias, **kw)  # type: ignore[assignment]
        self.bias_k = self.bias_v = None
        self.add_zero_attn = False
        nn.init.xavier_uniform_(self.in_proj_weight)

    def init_kwargs(self) -> dict:
        """Constructor arguments that rebuild this module's shapes (used by save/load)."""
        return {
            "embed_dim": self.in_proj_weight.shape[1] if not hasattr(self, "in_proj_weight_orig") else self.in_proj_weight_orig.shape[1],
            "num_heads": self.num_heads,
            "head_dim": self.head_dim,
            "embed_out": self.out_proj.out_features,
            "bias": self.in_proj_bias is not None,
            "dropout": self.dropout,
            "batch_first": self.batch_first,
        }

    @classmethod
    def from_module(cls, m: nn.MultiheadAttention, num_heads: int, embed_in: int, embed_out: int) -> "PrunedMultiheadAttention":
        """A module that shares ``m``'s Parameters (not yet sliced) and uses the new sizes."""
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.embed_dim = embed_in
        new.kdim = new.vdim = embed_in
        new._qkv_same_embed_dim = False
        new.num_heads = num_heads
        new.head_dim = m.head_dim
        new.dropout = m.dropout
        new.batch_first = m.batch_first
        new.in_proj_weight = m.in_proj_weight
        new.in_proj_bias = m.in_proj_bias
        new.register_parameter("q_proj_weight", None)
        new.register_parameter("k_proj_weight", None)
        new.register_parameter("v_proj_weight", None)
        new.out_proj = m.out_proj
        new.bias_k = new.bias_v = None
        new.add_zero_attn = False
        new.training = m.training
        return new

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        key_padding_mask: Optional[Tensor] = None,
        need_weights: bool = True,
        attn_mask: Optional[Tensor] = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> Tuple[Tensor, Optional[Tensor]]:
        unbatched = query.dim() == 2
        if unbatched:
            query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)
        if self.batch_first or unbatched:
            # unbatched inputs were made (L, 1, E) above: treat as seq-first
            pass
        if self.batch_first and not unbatched:
            q_in, k_in, v_in = query, key, value
        else:
            q_in, k_in, v_in = query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1)
        bsz, tgt, _ = q_in.shape
        src = k_in.shape[1]
        inner = self.num_heads * self.head_dim
        w = self.in_proj_weight
        b = self.in_proj_bias
        bq, bk, bv = (None, None, None) if b is None else (b[:inner], b[inner : 2 * inner], b[2 * inner :])
        q = F.linear(q_in, w[:inner], bq).view(bsz, tgt, self.num_heads, self.head_dim).transpose(1, 2)
        k = F.linear(k_in, w[inner : 2 * inner], bk).view(bsz, src, self.num_heads, self.head_dim).transpose(1, 2)
        v = F.linear(v_in, w[2 * inner :], bv).view(bsz, src, self.num_heads, self.head_dim).transpose(1, 2)

        mask = _merge_masks(attn_mask, key_padding_mask, bsz, self.num_heads, tgt, src, q.dtype)
        if is_causal and mask is None:
            mask = torch.ones(tgt, src, dtype=torch.bool, device=q.device).triu(1)
            mask = torch.zeros(tgt, src, dtype=q.dtype, device=q.device).masked_fill(mask, float("-inf"))
        p = self.dropout if self.training else 0.0
        if need_weights:
            scores = (q @ k.transpose(-2, -1)) * (self.head_dim**-0.5)
            if mask is not None:
                scores = scores + mask
            attn = torch.softmax(scores, dim=-1)
            if p > 0:
                attn = F.dropout(attn, p=p)
            out = attn @ v
            weights = attn.mean(dim=1) if average_attn_weights else attn
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p)
            weights = None
        out = self.out_proj(out.transpose(1, 2).reshape(bsz, tgt, inner))
        if not (self.batch_first and not unbatched):
            out = out.transpose(0, 1)
        if unbatched:
            out = out.squeeze(1)
            if weights is not None:
                weights = weights.squeeze(0)
        return out, weights


def _merge_masks(
    attn_mask: Optional[Tensor], key_padding_mask: Optional[Tensor], bsz: int, heads: int, tgt: int, src: int, dtype: torch.dtype
) -> Optional[Tensor]:
    mask = None
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            attn_mask = torch.zeros(attn_mask.shape, dtype=dtype, device=attn_mask.device).masked_fill(attn_mask, float("-inf"))
        if attn_mask.dim() == 3:
            attn_mask = attn_mask.view(bsz, heads, tgt, src)
        mask = attn_mask.to(dtype)
    if key_padding_mask is not None:
        kp = key_padding_mask
        if kp.dtype == torch.bool:
            kp = torch.zeros(kp.shape, dtype=dtype, device=kp.device).masked_fill(kp, float("-inf"))
        kp = kp.to(dtype).view(bsz, 1, 1, src)
        mask = kp if mask is None else mask + kp
    return mask


#: classes compaction may put in a model; loading a description only instantiates these
REPLACEMENTS = {"PrunedMultiheadAttention": PrunedMultiheadAttention}
