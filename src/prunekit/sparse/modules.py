"""Inference modules that multiply through a sparse weight.

* :class:`CSRLinear` — ``nn.Linear`` with its weight in CSR form (CPU via MKL,
  CUDA via cuSPARSE).
* :class:`CSRConv2d` — ``nn.Conv2d`` (``groups=1``, zero padding) as an
  unfold followed by a CSR matrix product.
* :class:`SemiStructuredLinear` — ``nn.Linear`` with a 2:4 semi-structured
  weight (``torch.sparse.to_sparse_semi_structured``; CUDA only).

The CSR modules keep the three CSR arrays (``crow_indices``,
``col_indices``, ``values``) as ordinary buffers, so ``state_dict``,
``copy.deepcopy``, pickling and ``.to()`` work as for any module (a CSR tensor
as a buffer breaks ``deepcopy``). Each module can rebuild a dense twin
(:meth:`to_dense_module`) and, when it was made with ``keep_original=True``,
hands back the very module it replaced (:attr:`original`).

These modules are for inference: the weights are buffers, not parameters.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Iterator, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["CSRLinear", "CSRConv2d", "SemiStructuredLinear", "SparseInferenceModule"]


def _csr_parts(weight: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    with warnings.catch_warnings():  # "Sparse CSR tensor support is in beta state"
        warnings.simplefilter("ignore", UserWarning)
        csr = weight.detach().to_sparse_csr()
    return csr.crow_indices().clone(), csr.col_indices().clone(), csr.values().clone()


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
    """Holds a 2-D weight as CSR buffers and builds the CSR tensor on demand."""

    def __init__(self, weight2d: torch.Tensor, original: Optional[nn.Module]) -> None:
        super().__init__(original)
        crow, col, values = _csr_parts(weight2d)
        self.register_buffer("crow_indices", crow)
        self.register_buffer("col_indices", col)
        self.register_buffer("values", values)
        self.weight_shape = tuple(weight2d.shape)
        self._csr_cache: Optional[Tuple[Any, torch.Tensor]] = None

    def csr_weight(self) -> torch.Tensor:
        """The 2-D weight as a ``torch.sparse_csr`` tensor (cached until the buffers change)."""
        key = tuple((t.data_ptr(), t.dtype, t.device, t._version)
                    for t in (self.crow_indices, self.col_indices, self.values))
        cache = self.__dict__.get("_csr_cache")
        if cache is not None and cache[0] == key:
            return cache[1]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            csr = torch.sparse_csr_tensor(
                self.crow_indices, self.col_indices, self.values, size=self.weight_shape
            )
        self.__dict__["_csr_cache"] = (key, csr)
        return csr

    def dense_weight(self) -> torch.Tensor:
        return self.csr_weight().to_dense()

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_csr_cache"] = None
        return state

    @property
    def nnz(self) -> int:
        return int(self.values.numel())

    def _matmul(self, x2d: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        """``x2d @ W.T + bias`` for ``x2d`` of shape ``(rows, in)``."""
        w = self.csr_weight()
        with _single_threaded(w.is_cuda):
            if x2d.shape[0] == 1:
                out = torch.mv(w, x2d[0]) if bias is None else torch.addmv(bias, w, x2d[0])
                return out.unsqueeze(0)
            xt = x2d.t()
            out = torch.mm(w, xt) if bias is None else torch.addmm(bias.unsqueeze(1), w, xt)
            return out.t()


@contextlib.contextmanager
def _single_threaded(skip: bool) -> Iterator[None]:
    """Run MKL's CPU sparse kernel on one thread.

    Between dense layers, whose OpenMP threads keep spinning for a while after
    each op, the multi-threaded sparse kernel stalls: on 2 cores a 95 %-sparse
    ``Linear(4096, 4096)`` at batch 8 took 16-24 ms right after a dense layer
    instead of 0.5 ms on its own, and 1.5 ms on one thread. One thread gives
    the stable win (``torch.set_num_threads`` is process-wide, so this is
    restored at once, but it is not meant for several Python threads running
    inference at the same time).
    """
    n = torch.get_num_threads()
    if skip or n == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


class CSRLinear(_CSRWeight):
    """A ``Linear`` layer whose weight is stored and multiplied in CSR form.

    Example:
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
                 original: Optional[nn.Module] = None) -> None:
        if weight.dim() != 2:
            raise ValueError(f"CSRLinear: weight must be 2-D, got shape {tuple(weight.shape)}")
        super().__init__(weight, original)
        self.out_features, self.in_features = weight.shape
        self.register_buffer("bias", None if bias is None else bias.detach().clone())

    @classmethod
    def from_dense(cls, linear: nn.Linear, *, keep_original: bool = True) -> "CSRLinear":
        """Build from an ``nn.Linear`` (pruned or not); reads ``linear.weight``."""
        with torch.no_grad():
            return cls(linear.weight, linear.bias, linear if keep_original else None)

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
                f"bias={self.bias is not None}, nnz={self.nnz} ({self.nnz / max(total, 1):.1%})")


class CSRConv2d(_CSRWeight):
    """A ``Conv2d`` (``groups=1``, zero padding) computed as unfold + CSR product.

    Example:
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

    def __init__(self, conv: nn.Conv2d, weight: torch.Tensor, keep_original: bool = True) -> None:
        reason = conv2d_unsupported_reason(conv)
        if reason:
            raise ValueError(f"CSRConv2d: {reason}")
        super().__init__(weight.reshape(weight.shape[0], -1), conv if keep_original else None)
        self.in_channels, self.out_channels = conv.in_channels, conv.out_channels
        self.kernel_size = tuple(conv.kernel_size)
        self.stride = tuple(conv.stride)
        self.padding = tuple(conv.padding)
        self.dilation = tuple(conv.dilation)
        self.register_buffer("bias", None if conv.bias is None else conv.bias.detach().clone())

    @classmethod
    def from_dense(cls, conv: nn.Conv2d, *, keep_original: bool = True) -> "CSRConv2d":
        """Build from an ``nn.Conv2d`` (pruned or not); reads ``conv.weight``."""
        with torch.no_grad():
            return cls(conv, conv.weight, keep_original)

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
        cols = cols.transpose(1, 2).reshape(n * ho * wo, -1)  # (N*L, C*k)
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
                f"stride={self.stride}, padding={self.padding}, dilation={self.dilation}, nnz={self.nnz}")


def conv2d_unsupported_reason(conv: nn.Conv2d) -> str:
    """Why :class:`CSRConv2d` cannot stand in for ``conv`` ('' when it can)."""
    if conv.groups != 1:
        return f"groups={conv.groups} (only groups=1 is supported)"
    if conv.padding_mode != "zeros":
        return f"padding_mode={conv.padding_mode!r} (only 'zeros' is supported)"
    if isinstance(conv.padding, str):
        return f"padding={conv.padding!r} (only explicit integer padding is supported)"
    return ""


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
