"""Block-sparse inference: :class:`BSRLinear`, a weight stored in 4x1 or 1x4 blocks (prunekit's compiled kernel)."""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from .. import native
from .base import SparseInferenceModule, _check_policy, _dense_linear, _index_dtype, policy_name

__all__ = ["BSRLinear", "block_fill", "bsr_unsupported_reason"]


class BSRLinear(SparseInferenceModule):
    """A ``Linear`` layer whose weight is stored in 4x1 or 1x4 blocks (prunekit's compiled kernel).

    ``block=(4, 1)`` groups 4 consecutive output rows of one input column,
    ``(1, 4)`` one output row over 4 consecutive input columns: the patterns
    ``"4x1"`` and ``"1x4"`` of :mod:`prunekit.training`. A block with any
    non-zero is stored whole, with one index per block, so the kernel reads a
    quarter of the indices CSR reads and reuses each load of the input four
    times. Without the compiled kernels the layer multiplies through its dense
    weight (correct, not fast).

    Examples:
        >>> import torch
        >>> from prunekit.sparse.modules import BSRLinear
        >>> lin = torch.nn.Linear(16, 8)
        >>> with torch.no_grad():
        ...     lin.weight[4:] = 0          # outputs 4-7 pruned: one 4x1 block per column is left
        >>> sp = BSRLinear.from_dense(lin, block=(4, 1))
        >>> x = torch.randn(2, 16)
        >>> sp.nnz_blocks, torch.allclose(sp(x), lin(x), atol=1e-6)
        (16, True)
    """

    # buffers (registered in __init__)
    block_rows: torch.Tensor
    block_cols: torch.Tensor
    values: torch.Tensor
    bias: Optional[torch.Tensor]

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor], original: Optional[nn.Module] = None,
                 *, block: Tuple[int, int] = (4, 1), threads: int = 0) -> None:
        super().__init__(original)
        given = tuple(block)  # a list is fine too
        if given not in ((4, 1), (1, 4)):
            raise ValueError(f"BSRLinear: block={given!r}; use (4, 1) or (1, 4)")
        block = (given[0], given[1])
        _check_policy("BSRLinear", "prunekit", threads)
        reason = bsr_unsupported_reason(weight, block)
        if reason:
            raise ValueError(f"BSRLinear: {reason}")
        brow, bcol, values = _bsr_parts(weight.detach(), block)
        self.register_buffer("block_rows", brow)
        self.register_buffer("block_cols", bcol)
        self.register_buffer("values", values)
        self.register_buffer("bias", None if bias is None else bias.detach().clone())
        self.out_features, self.in_features = weight.shape
        self.block = block
        self.kernel = "prunekit"
        self.threads = threads

    @classmethod
    def from_dense(cls, linear: nn.Linear, *, block: Tuple[int, int] = (4, 1), keep_original: bool = True,
                   threads: int = 0) -> "BSRLinear":
        """Build from an ``nn.Linear`` (pruned or not); reads ``linear.weight``."""
        with torch.no_grad():
            return cls(linear.weight, linear.bias, linear if keep_original else None, block=block, threads=threads)

    @property
    def policy(self) -> str:
        """``"bsr4x1"``, ``"bsr1x4"``, with ``-1t`` on one thread."""
        return policy_name(f"bsr{self.block[0]}x{self.block[1]}", "prunekit", self.threads)

    @property
    def nnz_blocks(self) -> int:
        return int(self.block_cols.numel())

    def dense_weight(self) -> torch.Tensor:
        bh, bw = self.block
        n_rows = self.out_features // bh
        per_row = (self.block_rows[1:] - self.block_rows[:-1]).long()
        rows = torch.repeat_interleave(torch.arange(n_rows, device=self.values.device), per_row)
        blocks = self.values.new_zeros(n_rows, self.in_features // bw, bh, bw)
        blocks[rows, self.block_cols.long()] = self.values
        return blocks.permute(0, 2, 1, 3).reshape(self.out_features, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"BSRLinear: input has {x.shape[-1]} features in its last dimension, "
                             f"the layer expects {self.in_features}")
        lead = x.shape[:-1]
        x2d = x.reshape(-1, self.in_features)
        if native.supports(x2d) and self.values.dtype == x2d.dtype:
            out = native.bsr_linear(x2d, self.block_rows, self.block_cols, self.values, self.bias,
                                    self.out_features, self.block, self.threads)
        else:
            out = F.linear(x2d, self.dense_weight(), self.bias)
        return out.reshape(*lead, self.out_features)

    def to_dense_module(self) -> nn.Linear:
        """A plain ``nn.Linear`` with the same (masked) weight and bias."""
        return _dense_linear(self.dense_weight(), self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, blocks={self.nnz_blocks} of {self.block[0]}x{self.block[1]}, "
                f"policy={self.policy}")


def bsr_unsupported_reason(weight: torch.Tensor, block: Tuple[int, int]) -> str:
    """Why a weight cannot be stored in ``block``-sized blocks ('' when it can).

    Examples:
        >>> import torch
        >>> from prunekit.sparse.modules import bsr_unsupported_reason
        >>> bsr_unsupported_reason(torch.zeros(6, 8), (4, 1))
        'shape (6, 8) is not a multiple of the 4x1 block'
    """
    if weight.dim() != 2:
        return f"weight must be 2-D, got shape {tuple(weight.shape)}"
    out_f, in_f = weight.shape
    if out_f % block[0] or in_f % block[1]:
        return f"shape {tuple(weight.shape)} is not a multiple of the {block[0]}x{block[1]} block"
    if weight.numel() >= 2**31:
        return "2**31 or more entries, more than int32 indices address"
    return ""


def _bsr_parts(weight: torch.Tensor, block: Tuple[int, int]) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    bh, bw = block
    out_f, in_f = weight.shape
    blocks = weight.reshape(out_f // bh, bh, in_f // bw, bw).permute(0, 2, 1, 3)  # (rows, cols, bh, bw)
    kept = (blocks != 0).flatten(2).any(-1)
    brow = torch.zeros(out_f // bh + 1, dtype=torch.int32, device=weight.device)
    brow[1:] = kept.sum(1).cumsum(0)
    bcol = kept.nonzero()[:, 1].to(_index_dtype(in_f // bw))
    return brow, bcol, blocks[kept].contiguous()


def block_fill(weight: torch.Tensor, block: Tuple[int, int]) -> float:
    """Non-zeros over the entries of the blocks that hold any (1.0: the weight is made of whole blocks).

    ``0.0`` when the weight cannot be cut into such blocks or is all zero.

    Examples:
        >>> import torch
        >>> from prunekit.sparse.modules import block_fill
        >>> w = torch.zeros(8, 4); w[:4, 0] = 1
        >>> block_fill(w, (4, 1)), block_fill(w, (1, 4))
        (1.0, 0.25)
    """
    if bsr_unsupported_reason(weight, block):
        return 0.0
    bh, bw = block
    out_f, in_f = weight.shape
    nz = weight.detach() != 0
    kept = int(nz.reshape(out_f // bh, bh, in_f // bw, bw).any(3).any(1).sum())
    return float(nz.sum()) / (kept * bh * bw) if kept else 0.0
