"""Channel-sparse inference: :class:`ChannelLinear`, a smaller dense product over the non-zero rows and columns."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from .base import SparseInferenceModule, _dense_linear

__all__ = ["ChannelLinear"]


class ChannelLinear(SparseInferenceModule):
    """A ``Linear`` whose all-zero output rows and input columns are dropped.

    Computes ``x[..., cols] @ W[rows][:, cols].T`` as a smaller dense product
    and scatters it into the output (a dropped output holds its bias): the
    execution policy for whole-channel sparsity that compaction cannot take
    away (a channel a residual connection still reads, say).

    Examples:
        >>> import torch
        >>> from prunekit.sparse.modules import ChannelLinear
        >>> lin = torch.nn.Linear(8, 6)
        >>> with torch.no_grad():
        ...     lin.weight[:2] = 0
        ...     lin.weight[:, 5:] = 0
        >>> sp = ChannelLinear.from_dense(lin)
        >>> x = torch.randn(3, 8)
        >>> tuple(sp.weight.shape), torch.allclose(sp(x), lin(x), atol=1e-6)
        ((4, 5), True)
    """

    # buffers (registered in __init__)
    rows: torch.Tensor
    cols: torch.Tensor
    weight: torch.Tensor
    bias: Optional[torch.Tensor]
    kept_bias: Optional[torch.Tensor]

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor],
                 original: Optional[nn.Module] = None) -> None:
        super().__init__(original)
        if weight.dim() != 2:
            raise ValueError(f"ChannelLinear: weight must be 2-D, got shape {tuple(weight.shape)}")
        w = weight.detach()
        nz = w != 0
        rows = nz.any(1).nonzero().flatten()
        cols = nz.any(0).nonzero().flatten()
        self.out_features, self.in_features = w.shape
        self.register_buffer("rows", rows)
        self.register_buffer("cols", cols)
        self.register_buffer("weight", w.index_select(0, rows).index_select(1, cols).contiguous())
        self.register_buffer("bias", None if bias is None else bias.detach().clone())
        self.register_buffer("kept_bias", None if bias is None else bias.detach().index_select(0, rows).clone())
        self.kernel, self.threads = "torch", 0

    @classmethod
    def from_dense(cls, linear: nn.Linear, *, keep_original: bool = True) -> "ChannelLinear":
        """Build from an ``nn.Linear`` (pruned or not); reads ``linear.weight``."""
        with torch.no_grad():
            return cls(linear.weight, linear.bias, linear if keep_original else None)

    @property
    def policy(self) -> str:
        return "channels"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"ChannelLinear: input has {x.shape[-1]} features in its last dimension, "
                             f"the layer expects {self.in_features}")
        if self.cols.numel() != self.in_features:
            x = x.index_select(-1, self.cols)
        y = F.linear(x, self.weight, self.kept_bias)
        if self.rows.numel() == self.out_features:
            return y
        if self.bias is None:
            out = y.new_zeros(*y.shape[:-1], self.out_features)
        else:
            out = self.bias.expand(*y.shape[:-1], self.out_features).clone()
        return out.index_copy_(-1, self.rows, y)

    def dense_weight(self) -> torch.Tensor:
        w = self.weight.new_zeros(self.out_features, self.in_features)
        w[self.rows.unsqueeze(1), self.cols.unsqueeze(0)] = self.weight
        return w

    def to_dense_module(self) -> nn.Linear:
        """A plain ``nn.Linear`` with the same (masked) weight and bias."""
        return _dense_linear(self.dense_weight(), self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"kept {self.rows.numel()} rows x {self.cols.numel()} columns, policy=channels")
