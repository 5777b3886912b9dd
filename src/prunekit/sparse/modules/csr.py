"""CSR inference modules: :class:`CSRLinear` and :class:`CSRConv2d` (an unfold, then a CSR product)."""

from __future__ import annotations

import warnings
from typing import Any, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from .. import native
from .base import SparseInferenceModule, _check_policy, _index_dtype, _threads, policy_name

__all__ = ["CSRLinear", "CSRConv2d", "conv2d_unsupported_reason"]


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


class _CSRWeight(SparseInferenceModule):
    """Holds a 2-D weight as CSR buffers; multiplies with its policy's kernel and thread count."""

    # buffers (registered in __init__)
    crow_indices: torch.Tensor
    col_indices: torch.Tensor
    values: torch.Tensor

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

    bias: Optional[torch.Tensor]  # a buffer

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

    bias: Optional[torch.Tensor]  # a buffer

    def __init__(self, conv: nn.Conv2d, weight: torch.Tensor, keep_original: bool = True, *,
                 kernel: str = "torch", threads: int = 0) -> None:
        reason = conv2d_unsupported_reason(conv)
        padding = conv.padding
        if reason or isinstance(padding, str):  # a string padding is one of the reasons
            raise ValueError(f"CSRConv2d: {reason}")
        super().__init__(weight.reshape(weight.shape[0], -1), conv if keep_original else None, kernel, threads)
        self.in_channels, self.out_channels = conv.in_channels, conv.out_channels
        self.kernel_size = _pair(conv.kernel_size)
        self.stride = _pair(conv.stride)
        self.padding = _pair(padding)
        self.dilation = _pair(conv.dilation)
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
            if self.bias is not None and conv.bias is not None:
                conv.bias.copy_(self.bias)
        return conv

    def extra_repr(self) -> str:
        return (f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, "
                f"stride={self.stride}, padding={self.padding}, dilation={self.dilation}, nnz={self.nnz}, "
                f"policy={self.policy}")


def _pair(v: Tuple[int, ...]) -> Tuple[int, int]:
    """A Conv2d's ``(height, width)`` setting (kernel size, stride, padding, dilation)."""
    return (v[0], v[1])


def conv2d_unsupported_reason(conv: nn.Conv2d) -> str:
    """Why :class:`CSRConv2d` cannot stand in for ``conv`` ('' when it can)."""
    if conv.groups != 1:
        return f"groups={conv.groups} (only groups=1 is supported)"
    if conv.padding_mode != "zeros":
        return f"padding_mode={conv.padding_mode!r} (only 'zeros' is supported)"
    if isinstance(conv.padding, str):
        return f"padding={conv.padding!r} (only explicit integer padding is supported)"
    return ""
