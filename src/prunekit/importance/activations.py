"""Statistics of a layer's inputs, gathered over a calibration pass (pure tensor math).

A linear layer ``y = x W^T`` sees inputs ``x`` of shape ``(..., in_features)``.
Activation-aware scorers need, per input feature ``j``, the squared norm
``sum_t x_tj^2`` over every calibration token (Wanda's ``||X_j||_2``), and
second-order ones the matrix ``X^T X`` (SparseGPT's Hessian, up to a factor).
:class:`ActivationStats` accumulates both, one batch at a time, in float32
(float64 on request), so the calibration set is never held whole.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

__all__ = ["ActivationStats"]


class ActivationStats:
    """Running statistics of inputs with ``features`` columns.

    ``add(x)`` takes any ``(..., features)`` tensor (every leading index is one
    sample); ``token_mask`` (shape ``x.shape[:-1]``, true = count it) drops
    padding. ``sq_norm`` is ``sum x_j^2`` per feature, ``norm`` its square
    root, ``hessian`` the mean ``X^T X / count`` (with ``hessian=True``).

    Examples:
        >>> import torch
        >>> from prunekit.importance import ActivationStats
        >>> s = ActivationStats(2, hessian=True)
        >>> s.add(torch.tensor([[1., 2.], [3., 0.]]))
        >>> s.count, s.sq_norm.tolist(), s.hessian.tolist()
        (2, [10.0, 4.0], [[5.0, 1.0], [1.0, 2.0]])
    """

    def __init__(self, features: int, *, hessian: bool = False, dtype: torch.dtype = torch.float32,
                 device: Optional[torch.device] = None) -> None:
        if isinstance(features, bool) or not isinstance(features, int) or features < 1:
            raise ValueError(f"features must be a positive int, got {features!r}")
        self.features = features
        self.count = 0
        self.sq_norm = torch.zeros(features, dtype=dtype, device=device)
        self._xtx: Optional[Tensor] = torch.zeros(features, features, dtype=dtype, device=device) if hessian else None

    @property
    def has_hessian(self) -> bool:
        """Whether ``X^T X`` is gathered."""
        return self._xtx is not None

    def add(self, x: Tensor, token_mask: Optional[Tensor] = None) -> None:
        """Add a batch of inputs ``(..., features)``; rows where ``token_mask`` is false are skipped."""
        if x.shape[-1] != self.features:
            raise ValueError(f"inputs have {x.shape[-1]} features, these statistics {self.features}")
        x = x.detach().reshape(-1, self.features)
        if token_mask is not None:
            x = x[token_mask.reshape(-1).to(device=x.device, dtype=torch.bool)]
        if x.shape[0] == 0:
            return
        dtype = self.sq_norm.dtype
        x = x.to(device=self.sq_norm.device, dtype=dtype)
        self.count += x.shape[0]
        self.sq_norm += (x * x).sum(dim=0)
        if self._xtx is not None:
            self._xtx.addmm_(x.t(), x)

    @property
    def norm(self) -> Tensor:
        """``||X_j||_2`` per input feature."""
        return self.sq_norm.sqrt()

    @property
    def xtx(self) -> Tensor:
        """The summed ``X^T X`` (``features x features``)."""
        if self._xtx is None:
            raise ValueError("these statistics were gathered without hessian=True; X^T X is not available")
        return self._xtx

    @property
    def hessian(self) -> Tensor:
        """``X^T X / count``: the inputs' second moment (SparseGPT's Hessian up to the factor 2)."""
        return self.xtx / max(self.count, 1)

    def to(self, device: torch.device) -> "ActivationStats":
        """Move the statistics to ``device`` (in place); returns self."""
        self.sq_norm = self.sq_norm.to(device)
        if self._xtx is not None:
            self._xtx = self._xtx.to(device)
        return self

    def __repr__(self) -> str:
        return f"ActivationStats(features={self.features}, count={self.count}, hessian={self.has_hessian})"
