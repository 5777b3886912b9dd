"""Inference modules that multiply through a sparse weight.

* :class:`CSRLinear` — ``nn.Linear`` with its weight in CSR form.
* :class:`CSRConv2d` — ``nn.Conv2d`` (``groups=1``, zero padding) as an
  unfold followed by a CSR matrix product.
* :class:`BSRLinear` — ``nn.Linear`` with its weight in 4x1 or 1x4 blocks
  (the training pruners' block patterns), through prunekit's compiled kernel.
* :class:`ChannelLinear` — a ``Linear`` whose all-zero rows and columns are
  dropped: a smaller dense product plus a scatter (channel sparsity that
  compaction cannot remove, e.g. because a residual reads the channel).
* :class:`SemiStructuredLinear` — ``nn.Linear`` with a 2:4 semi-structured
  weight (``torch.sparse.to_sparse_semi_structured``; CUDA only).

The CSR and BSR modules run one *execution policy*: ``kernel`` is
``"prunekit"`` (the compiled kernels of :mod:`prunekit.sparse.native`) or
``"torch"`` (``torch.sparse``: MKL on CPU, cuSPARSE on CUDA), and
``threads`` is ``0`` (torch's current thread count) or ``1``. Each module's
:attr:`policy` names it the way :class:`prunekit.sparse.SparsifyReport` does
(``"csr"``, ``"csr-1t"``, ``"csr-torch"``, ``"bsr4x1"``, ``"channels"``, ...).
:func:`prunekit.sparse.sparsify_for_inference` measures the policies and
keeps the fastest per layer. A module whose compiled kernel is unavailable in
the running process (unpickled on a machine where it was not built, say)
computes the same result through torch's kernels.

The modules keep their arrays as ordinary buffers, so ``state_dict``,
``copy.deepcopy``, pickling and ``.to()`` work as for any module (a CSR tensor
as a buffer breaks ``deepcopy``). Each module can rebuild a dense twin
(:meth:`to_dense_module`) and, when it was made with ``keep_original=True``,
hands back the very module it replaced (:attr:`original`).

These modules are for inference: the weights are buffers, not parameters.
Stored zeros are skipped, so where the dense layer computes ``0 * inf = nan``
the sparse one does not.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Iterator, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from . import native

__all__ = ["CSRLinear", "CSRConv2d", "BSRLinear", "ChannelLinear", "SemiStructuredLinear", "SparseInferenceModule"]

_KERNELS = ("prunekit", "torch")


def _index_dtype(extent: int) -> torch.dtype:
    """int16 column indices while they fit (a third less memory traffic than int32), else int32."""
    return torch.int16 if extent <= 32768 else torch.int32


def _csr_parts(weight: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Row pointers (int32), column indices (int16 or int32) and values of a 2-D weight."""
    if weight.numel() >= 2**31:
        raise ValueError(f"weight of shape {tuple(weight.shape)} has 2**31 or more entries, more than int32 "
                         f"indices address; keep this layer dense")
    with warnings.catch_warnings():  # "Sparse CSR tensor support is in beta state"
        warnings.simplefilter("ignore", UserWarning)
        csr = weight.detach().to_sparse_csr()
    return (csr.crow_indices().to(torch.int32), csr.col_indices().to(_index_dtype(weight.shape[1])),
            csr.values().clone())


def _check_policy(owner: str, kernel: str, threads: int) -> None:
    if kernel not in _KERNELS:
        raise ValueError(f"{owner}: kernel={kernel!r}; use one of {_KERNELS}")
    if threads not in (0, 1):
        raise ValueError(f"{owner}: threads={threads!r}; use 0 (torch's thread count) or 1")


def policy_name(layout: str, kernel: str, threads: int) -> str:
    """The name of an execution policy: layout, ``-torch`` for torch's kernel, ``-1t`` for one thread.

    Examples:
        >>> from prunekit.sparse.modules import policy_name
        >>> policy_name("csr", "prunekit", 0), policy_name("csr", "torch", 1)
        ('csr', 'csr-torch-1t')
    """
    return (layout if kernel == "prunekit" else f"{layout}-torch") + ("-1t" if threads == 1 else "")


@contextlib.contextmanager
def _threads(n: int) -> Iterator[None]:
    """Run torch's kernels on ``n`` threads (0: leave torch's setting alone).

    ``torch.set_num_threads`` is process-wide: this is restored at once, but
    it is not meant for several Python threads running inference at the same
    time (prunekit's compiled kernels take the count as an argument instead).
    """
    current = torch.get_num_threads()
    if n == 0 or n == current:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(current)


class SparseInferenceModule(nn.Module):
    """Common base: keeps the replaced module (optionally) and rebuilds a dense twin."""

    def __init__(self, original: Optional[nn.Module]) -> None:
        super().__init__()
        # Not a registered submodule: it must not appear in state_dict() or
        # parameters() of the converted model.
        object.__setattr__(self, "_original", original)

    @property
    def original(self) -> Optional[nn.Module]:
        """The module this one replaced (``None`` when it was not kept)."""
        return self._original

    def to_dense_module(self) -> nn.Module:  # pragma: no cover - overridden
        raise NotImplementedError


class _CSRWeight(SparseInferenceModule):
    """Holds a 2-D weight as CSR buffers; multiplies with its policy's kernel and thread count."""

    def __init__(self, weight2d: torch.Tensor, original: Optional[nn.Module], kernel: str = "torch",
                 threads: int = 0) -> None:
        super().__init__(original)
        _check_policy(type(self).__name__, kernel, threads)
        crow, col, values = _csr_parts(weight2d)
        self.register_buffer("crow_indices", crow)
        self.register_buffer("col_indices", col)
        self.register_buffer("values", values)
        self.weight_shape = tuple(weight2d.shape)
        self.kernel = kernel
        self.threads = threads
        self._csr_cache: Optional[Tuple[Any, torch.Tensor]] = None

    @property
    def policy(self) -> str:
        """The execution policy's name (``"csr"``, ``"csr-1t"``, ``"csr-torch"``, ``"csr-torch-1t"``)."""
        return policy_name("csr", self.kernel, self.threads)

    def csr_weight(self) -> torch.Tensor:
        """The 2-D weight as a ``torch.sparse_csr`` tensor (cached until the buffers change)."""
        key = tuple((t.data_ptr(), t.dtype, t.device, t._version)
                    for t in (self.crow_indices, self.col_indices, self.values))
        cache = self.__dict__.get("_csr_cache")
        if cache is not None and cache[0] == key:
            return cache[1]
        crow = self.crow_indices
        col = self.col_indices.to(crow.dtype)  # torch wants both index arrays in one dtype
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            csr = torch.sparse_csr_tensor(crow, col, self.values, size=self.weight_shape)
        self.__dict__["_csr_cache"] = (key, csr)
        return csr

    def dense_weight(self) -> torch.Tensor:
        return self.csr_weight().to_dense()

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_csr_cache"] = None
        return state

    def __setstate__(self, state: dict) -> None:
        # modules pickled before execution policies existed ran torch's kernel on one thread
        state.setdefault("kernel", "torch")
        state.setdefault("threads", 1)
        self.__dict__.update(state)

    @property
    def nnz(self) -> int:
        return int(self.values.numel())

    def _matmul(self, x2d: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        """``x2d @ W.T + bias`` for ``x2d`` of shape ``(rows, in)``."""
        if self.kernel == "prunekit" and native.supports(x2d) and self.values.dtype == x2d.dtype:
            return native.csr_linear(x2d, self.crow_indices, self.col_indices, self.values, bias,
                                     self.weight_shape[0], self.threads)
        # torch.sparse (MKL on CPU): W @ x.T, the only sparse-times-dense order it offers
        w = self.csr_weight()
        with _threads(0 if w.is_cuda else self.threads):
            if x2d.shape[0] == 1:
                out = torch.mv(w, x2d[0]) if bias is None else torch.addmv(bias, w, x2d[0])
                return out.unsqueeze(0)
            xt = x2d.t()
            out = torch.mm(w, xt) if bias is None else torch.addmm(bias.unsqueeze(1), w, xt)
            return out.t()


class CSRLinear(_CSRWeight):
    """A ``Linear`` layer whose weight is stored and multiplied in CSR form.

    Examples:
        >>> import torch
        >>> from prunekit.sparse.modules import CSRLinear
        >>> lin = torch.nn.Linear(16, 4)
        >>> with torch.no_grad():
        ...     lin.weight[:, 4:] = 0
        >>> sp = CSRLinear.from_dense(lin)
        >>> x = torch.randn(3, 16)
        >>> torch.allclose(sp(x), lin(x), atol=1e-6)
        True
    """

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor],
                 original: Optional[nn.Module] = None, *, kernel: str = "torch", threads: int = 0) -> None:
        if weight.dim() != 2:
            raise ValueError(f"CSRLinear: weight must be 2-D, got shape {tuple(weight.shape)}")
        super().__init__(weight, original, kernel, threads)
        self.out_features, self.in_features = weight.shape
        self.register_buffer("bias", None if bias is None else bias.detach().clone())

    @classmethod
    def from_dense(cls, linear: nn.Linear, *, keep_original: bool = True, kernel: str = "torch",
                   threads: int = 0) -> "CSRLinear":
        """Build from an ``nn.Linear`` (pruned or not); reads ``linear.weight``.

        ``kernel="prunekit"`` runs the compiled kernels (torch's where they are
        not built); ``threads=1`` runs on one thread.
        """
        with torch.no_grad():
            return cls(linear.weight, linear.bias, linear if keep_original else None, kernel=kernel,
                       threads=threads)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(
                f"CSRLinear: input has {x.shape[-1]} features in its last dimension, "
                f"the layer expects {self.in_features}"
            )
        lead = x.shape[:-1]
        out = self._matmul(x.reshape(-1, self.in_features), self.bias)
        return out.reshape(*lead, self.out_features)

    def to_dense_module(self) -> nn.Linear:
        """A plain ``nn.Linear`` with the same (masked) weight and bias."""
        lin = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None,
                        device=self.values.device, dtype=self.values.dtype)
        with torch.no_grad():
            lin.weight.copy_(self.dense_weight())
            if self.bias is not None:
                lin.bias.copy_(self.bias)
        return lin

    def extra_repr(self) -> str:
        total = self.in_features * self.out_features
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, nnz={self.nnz} ({self.nnz / max(total, 1):.1%}), "
                f"policy={self.policy}")


class CSRConv2d(_CSRWeight):
    """A ``Conv2d`` (``groups=1``, zero padding) computed as unfold + CSR product.

    Examples:
        >>> import torch
        >>> from prunekit.sparse.modules import CSRConv2d
        >>> conv = torch.nn.Conv2d(3, 8, 3, padding=1)
        >>> with torch.no_grad():
        ...     conv.weight[:, 1:] = 0
        >>> sp = CSRConv2d.from_dense(conv)
        >>> x = torch.randn(2, 3, 10, 10)
        >>> torch.allclose(sp(x), conv(x), atol=1e-5)
        True
    """

    def __init__(self, conv: nn.Conv2d, weight: torch.Tensor, keep_original: bool = True, *,
                 kernel: str = "torch", threads: int = 0) -> None:
        reason = conv2d_unsupported_reason(conv)
        if reason:
            raise ValueError(f"CSRConv2d: {reason}")
        super().__init__(weight.reshape(weight.shape[0], -1), conv if keep_original else None, kernel, threads)
        self.in_channels, self.out_channels = conv.in_channels, conv.out_channels
        self.kernel_size = tuple(conv.kernel_size)
        self.stride = tuple(conv.stride)
        self.padding = tuple(conv.padding)
        self.dilation = tuple(conv.dilation)
        self.register_buffer("bias", None if conv.bias is None else conv.bias.detach().clone())

    @classmethod
    def from_dense(cls, conv: nn.Conv2d, *, keep_original: bool = True, kernel: str = "torch",
                   threads: int = 0) -> "CSRConv2d":
        """Build from an ``nn.Conv2d`` (pruned or not); reads ``conv.weight``."""
        with torch.no_grad():
            return cls(conv, conv.weight, keep_original, kernel=kernel, threads=threads)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        unbatched = x.dim() == 3
        if unbatched:
            x = x.unsqueeze(0)
        if x.dim() != 4 or x.shape[1] != self.in_channels:
            raise ValueError(
                f"CSRConv2d: expected input of shape (N, {self.in_channels}, H, W), got {tuple(x.shape)}"
            )
        n, _, h, w = x.shape
        kh, kw = self.kernel_size
        ho = (h + 2 * self.padding[0] - self.dilation[0] * (kh - 1) - 1) // self.stride[0] + 1
        wo = (w + 2 * self.padding[1] - self.dilation[1] * (kw - 1) - 1) // self.stride[1] + 1
        cols = F.unfold(x, self.kernel_size, self.dilation, self.padding, self.stride)  # (N, C*k, L)
        cols = cols.transpose(1, 2).reshape(n * ho * wo, -1)  # (N*L, C*k), a copy: contiguous
        out = self._matmul(cols, self.bias)  # (N*L, O)
        out = out.reshape(n, ho, wo, self.out_channels).permute(0, 3, 1, 2)
        return out[0] if unbatched else out

    def to_dense_module(self) -> nn.Conv2d:
        """A plain ``nn.Conv2d`` with the same (masked) weight and bias."""
        conv = nn.Conv2d(self.in_channels, self.out_channels, self.kernel_size, self.stride,
                         self.padding, self.dilation, bias=self.bias is not None,
                         device=self.values.device, dtype=self.values.dtype)
        with torch.no_grad():
            conv.weight.copy_(self.dense_weight().reshape(conv.weight.shape))
            if self.bias is not None:
                conv.bias.copy_(self.bias)
        return conv

    def extra_repr(self) -> str:
        return (f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, "
                f"stride={self.stride}, padding={self.padding}, dilation={self.dilation}, nnz={self.nnz}, "
                f"policy={self.policy}")


def conv2d_unsupported_reason(conv: nn.Conv2d) -> str:
    """Why :class:`CSRConv2d` cannot stand in for ``conv`` ('' when it can)."""
    if conv.groups != 1:
        return f"groups={conv.groups} (only groups=1 is supported)"
    if conv.padding_mode != "zeros":
        return f"padding_mode={conv.padding_mode!r} (only 'zeros' is supported)"
    if isinstance(conv.padding, str):
        return f"padding={conv.padding!r} (only explicit integer padding is supported)"
    return ""


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

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor], original: Optional[nn.Module] = None,
                 *, block: Tuple[int, int] = (4, 1), threads: int = 0) -> None:
        super().__init__(original)
        block = tuple(block)
        if block not in ((4, 1), (1, 4)):
            raise ValueError(f"BSRLinear: block={block!r}; use (4, 1) or (1, 4)")
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


def _dense_linear(weight: torch.Tensor, bias: Optional[torch.Tensor]) -> nn.Linear:
    lin = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device=weight.device,
                    dtype=weight.dtype)
    with torch.no_grad():
        lin.weight.copy_(weight)
        if bias is not None:
            lin.bias.copy_(bias)
    return lin


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


class SemiStructuredLinear(SparseInferenceModule):
    """A ``Linear`` layer with a 2:4 semi-structured sparse weight (CUDA only).

    Wraps :func:`torch.sparse.to_sparse_semi_structured`; the weight must
    already follow the 2:4 pattern (at most two non-zeros in every group of
    four along the input dimension), or the compressed weight silently drops
    values — :func:`prunekit.sparse.sparsify_for_inference` checks this first.
    """

    def __init__(self, linear: nn.Linear, weight: torch.Tensor, backend: Any,
                 keep_original: bool = True) -> None:
        super().__init__(linear if keep_original else None)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = nn.Parameter(backend.from_dense(weight.detach().contiguous()), requires_grad=False)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(),
                                                                  requires_grad=False)
        self.kernel, self.threads = "torch", 0

    @property
    def policy(self) -> str:
        return "2:4"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        out = F.linear(x.reshape(-1, self.in_features).contiguous(), self.weight, self.bias)
        return out.reshape(*lead, self.out_features)

    def to_dense_module(self) -> nn.Linear:
        lin = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None,
                        device=self.weight.device, dtype=self.weight.dtype)
        with torch.no_grad():
            lin.weight.copy_(self.weight.to_dense())
            if self.bias is not None:
                lin.bias.copy_(self.bias)
        return lin
