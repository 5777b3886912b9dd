"""2:4 semi-structured inference (CUDA only): :class:`SemiStructuredLinear` and the checks before it.

:func:`check_n_m_pattern` says whether a weight follows an N:M pattern; the
2:4 kernels silently drop values of a weight that does not, so
:func:`prunekit.sparse.sparsify_for_inference` checks first, and asks
:func:`_semi_structured_unsupported` whether PyTorch's kernels take the
weight's device, dtype and shape.
"""

from __future__ import annotations

from typing import Any, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from .base import SparseInferenceModule

__all__ = ["SemiStructuredLinear", "check_n_m_pattern"]


def check_n_m_pattern(weight: torch.Tensor, n: int = 2, m: int = 4) -> Tuple[bool, str]:
    """Whether every group of ``m`` consecutive inputs holds at most ``n`` non-zeros.

    Groups run along the last (input) dimension of ``weight`` viewed as 2-D
    ``(out, in)``, which is what semi-structured kernels require.

    Examples:
        >>> import torch
        >>> from prunekit.sparse import check_n_m_pattern
        >>> check_n_m_pattern(torch.tensor([[1., 0., 2., 0., 0., 3., 0., 4.]]))
        (True, 'every group of 4 inputs holds at most 2 non-zeros')
        >>> check_n_m_pattern(torch.tensor([[1., 1., 1., 0.]]))[0]
        False
    """
    if not (isinstance(n, int) and isinstance(m, int) and 0 <= n <= m and m > 0):
        raise ValueError(f"check_n_m_pattern: need integers 0 <= n <= m, m > 0; got n={n!r}, m={m!r}")
    w = weight.detach()
    if w.dim() < 2:
        return False, f"weight has {w.dim()} dimension(s); an N:M pattern needs a 2-D (out, in) weight"
    w2 = w.reshape(w.shape[0], -1)
    cols = w2.shape[1]
    if cols % m:
        return False, f"the input dimension ({cols}) is not a multiple of {m}"
    counts = (w2 != 0).reshape(w2.shape[0], cols // m, m).sum(dim=-1)
    bad = int((counts > n).sum())
    if bad:
        return False, (f"{bad} of {counts.numel()} groups of {m} inputs hold more than {n} non-zeros "
                       f"(prune with a {n}:{m} pattern first)")
    return True, f"every group of {m} inputs holds at most {n} non-zeros"


def _semi_structured_backend() -> Any:
    """The ``SparseSemiStructuredTensor`` subclass ``to_sparse_semi_structured`` would use."""
    from torch.sparse import SparseSemiStructuredTensor, SparseSemiStructuredTensorCUSPARSELT

    cusparselt = getattr(torch.backends, "cusparselt", None)
    has_cslt = bool(cusparselt is not None and cusparselt.is_available())
    if SparseSemiStructuredTensor._FORCE_CUTLASS or not has_cslt:
        return torch.sparse.SparseSemiStructuredTensorCUTLASS
    return SparseSemiStructuredTensorCUSPARSELT


def _semi_structured_unsupported(weight: torch.Tensor, backend: Any) -> str:
    """Why the 2:4 kernels cannot take this weight ('' when they can), per PyTorch's documented limits."""
    if weight.device.type != "cuda":
        return (f"semi-structured (2:4) sparse kernels run only on CUDA devices; this layer is on "
                f"{weight.device.type}")
    limits = getattr(backend, "_DTYPE_SHAPE_CONSTRAINTS", {})
    if weight.dtype not in limits:
        names = ", ".join(str(d).replace("torch.", "") for d in limits)
        return f"dtype {weight.dtype} is not supported by the {backend.__name__} kernels ({names})"
    rows, cols = weight.shape
    c = limits[weight.dtype]
    if rows < c.sparse_min_rows or rows % c.sparse_min_rows or cols < c.sparse_min_cols or cols % c.sparse_min_cols:
        return (f"shape {tuple(weight.shape)} is not a multiple of ({c.sparse_min_rows}, {c.sparse_min_cols}) "
                f"as the {weight.dtype} kernels require")
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
