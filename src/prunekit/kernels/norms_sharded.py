"""Per-channel norms of a tensor spread over ranks: :func:`channel_norms` across shards.

* A replica, or a shard along the channel dimension itself: every rank has
  whole channels, so their norms are computed locally exactly as in one
  process (bit for bit) and gathered: one value per channel travels.
* A shard along another dimension: every channel is split between ranks, so
  partial reductions are combined -- the sum of ``|x|^p`` (in float64) for a
  p-norm (``'fro'``: p = 2; p = 0 counts non-zeros), the largest or smallest
  ``|x|`` for ``inf``/``-inf``, and for ``'nuc'`` the Gram matrix of each
  channel's matrix (``M^T M`` or ``M M^T``, whichever side the shard splits),
  whose eigenvalues are the squared singular values. These agree with the
  single-process norms to rounding (the order of the additions differs), so a
  ranking can differ only between channels whose norms differ by about one
  unit in the last place.
"""

from __future__ import annotations

import math

from torch import Tensor

from .._backend import TORCH, backend_of
from .norms import NormOrder, channel_norms, validate_norm_order
from .sharded import Communicator, ShardSpec, gather_along

__all__ = ["channel_norms_sharded"]


def channel_norms_sharded(t: Tensor, n: NormOrder, dim: int, spec: ShardSpec, comm: Communicator) -> Tensor:
    """The norm of every channel of the global tensor along ``dim``, on every rank.

    ``t`` is this rank's piece of the tensor and ``spec`` where it sits.
    Collective.

    Example (one rank holding the whole tensor):
        >>> import torch
        >>> class Alone:
        ...     rank, world = 0, 1
        ...     def all_reduce_sum(self, t): return t
        ...     def all_gather(self, t): return [t]
        >>> w = torch.tensor([[3.0, 4.0], [1.0, 0.0]])
        >>> channel_norms_sharded(w[:, :1], 2, 0, ShardSpec((2, 2), dim=1, offset=0, length=1), Alone()).tolist()
        [3.0, 1.0]
    """
    validate_norm_order(n)
    dim = dim % t.dim()
    if spec.dim is None:
        return channel_norms(t, n, dim)
    b = backend_of(t) or TORCH
    xp = b.ns
    x = t.detach()
    if not x.is_floating_point():
        x = x.to(xp.get_default_dtype())
    if spec.dim == dim:
        local = channel_norms(x, n, dim) if x.numel() else xp.zeros(0, dtype=x.dtype, device=x.device)
        return gather_along(local, spec, comm)
    channels = spec.global_shape[dim]
    other = [d for d in range(x.dim()) if d != dim]
    if n == "nuc":
        return _nuclear(x, dim, spec.dim, comm).to(x.dtype)
    order = 2.0 if n == "fro" else float(n)
    if math.isinf(order):
        if x.numel():
            part = x.abs().amax(other) if order > 0 else x.abs().amin(other)
        else:
            part = xp.full((channels,), -math.inf if order > 0 else math.inf, dtype=x.dtype, device=x.device)
        parts = xp.stack(comm.all_gather(part))
        return parts.amax(0) if order > 0 else parts.amin(0)
    a = x.abs().to(b.ns.float64)
    part = (a != 0).sum(other).to(b.ns.float64) if order == 0 else a.pow(order).sum(other)
    total = comm.all_reduce_sum(part)
    return (total if order == 0 else total.pow(1.0 / order)).to(x.dtype)


def _nuclear(x: Tensor, dim: int, split: int, comm: Communicator) -> Tensor:
    """Sum of singular values of each channel's matrix, from Gram matrices summed over ranks (``x`` split
    along ``split``)."""
    b = backend_of(x) or TORCH
    xp = b.ns
    c = x.movedim(dim, 0).to(xp.float64)
    mat = c.reshape(c.shape[0], c.shape[1], math.prod(c.shape[2:]))
    split_rows = (split + 1 if split < dim else split) == 1
    gram = mat.transpose(1, 2) @ mat if split_rows else mat @ mat.transpose(1, 2)
    gram = comm.all_reduce_sum(gram)
    eig = xp.linalg.eigvalsh(gram).clamp_min(0)
    return eig.sqrt().sum(-1)
