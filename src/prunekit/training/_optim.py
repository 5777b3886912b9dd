"""Optimizer state at pruned entries: cleared so a pruned weight gets no update, and kept cheap.

When a mask changes, the per-entry optimizer state of the newly pruned
entries (momentum, Adam's moments, ...) is cleared: with a zero gradient
there, the weight then never moves again. That is all SGD needs.

Adam-style optimizers (``Adam``, ``AdamW``, ``NAdam``, ``RAdam``) divide the
first moment by the square root of the second at every step. At a pruned
entry the first moment and the gradient are exactly zero, so the update is
zero *whatever the second moment holds* (``0 / (sqrt(v) + eps) = 0``, and
``param + (-lr) * 0`` leaves every bit of ``param`` as it was). A second
moment of exactly zero is nevertheless expensive: PyTorch's CPU ``sqrt`` for
float32/float64 calls Intel MKL's VML ``vmsSqrt`` (high-accuracy mode,
``VML_FTZDAZ_OFF``), which sends exact zeros and infinities down a
special-value path far slower per element than the one for ordinary values;
``torch.set_flush_denormal`` does not change it (nor is it about denormals:
NumPy's ``sqrt`` and PyTorch's own bfloat16 ``sqrt`` do not use VML and take
the ordinary path for zeros).

So the second moments at pruned entries hold :data:`TINY` (``2**-100``)
instead of zero. It is far below anything that matters (``sqrt(TINY)`` is
``2**-50``, some 10^7 times smaller than Adam's ``eps``), a normal float, and
it decays by ``beta2`` per step, so it is written again before it could reach
the denormal range (:func:`refill_period`). The weights are bit for bit those
of plain zeros; ``release`` puts the zeros back when the pruner lets go of the
optimizer, so the optimizer state is then exactly what it would have been.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, List, Optional

from torch import Tensor

from .. import _sharded
from .._backend import TORCH, backend_of, is_tensor
from ._undo import UndoLog, zero_where_

__all__ = ["TINY", "SECOND_MOMENTS", "optimizer_state_tensors", "refill_period", "clear_pruned_state_",
           "fill_second_moments_"]

#: what Adam-style second moments hold at pruned entries while a pruner drives the optimizer
TINY = 2.0 ** -100
#: written again before TINY * beta2**k falls below 2**-(100 + _HEADROOM) (still a normal float32)
_HEADROOM = 20
#: per-entry second-moment state of Adam-style optimizers (its square root divides the first moment)
SECOND_MOMENTS = ("exp_avg_sq", "max_exp_avg_sq")
#: set to False to keep plain zeros (the behaviour before this optimisation; used by the tests)
FILL_SECOND_MOMENTS = True


def _adam_like(optimizer: Any) -> bool:
    import torch

    kinds = tuple(getattr(torch.optim, n) for n in ("Adam", "AdamW", "NAdam", "RAdam") if hasattr(torch.optim, n))
    return isinstance(optimizer, kinds)


def optimizer_state_tensors(optimizers: Iterable[Any], param: Tensor) -> List[Tensor]:
    """Every per-entry optimizer state tensor of ``param`` (momentum, Adam's moments, ...):
    the tensors in ``optimizer.state[param]`` with the parameter's shape (not ``step``)."""
    out: List[Tensor] = []
    for opt in optimizers:
        state = opt.state.get(param)
        if not state:
            continue
        out.extend(v for v in state.values() if is_tensor(v) and tuple(v.shape) == tuple(param.shape))
    return out


def refill_period(optimizer: Any, param: Tensor) -> Optional[int]:
    """Steps after which :data:`TINY` in ``param``'s second moments must be written again
    (``None``: not an Adam-style optimizer, or a ``beta2`` too small for the trick to pay).

    Examples:
        >>> import torch
        >>> from prunekit.training._optim import refill_period
        >>> p = torch.nn.Parameter(torch.zeros(3))
        >>> refill_period(torch.optim.Adam([p]), p), refill_period(torch.optim.SGD([p], lr=0.1), p)
        (13856, None)
    """
    if not FILL_SECOND_MOMENTS or not _adam_like(optimizer) or _sharded.handler_for(param) is not None:
        return None  # (DTensor shards keep plain zeros)
    for group in optimizer.param_groups:
        if any(p is param for p in group["params"]):
            beta2 = group.get("betas", (None, None))[1]
            try:
                beta2 = float(beta2)
            except (TypeError, ValueError):
                return None
            if not 0.0 < beta2 < 1.0:
                return None
            period = int(_HEADROOM * math.log(2.0) / -math.log(beta2))
            return period if period >= 10 else None
    return None


def _second_moments(opt: Any, param: Tensor, keep: Tensor, value: float, undo: Optional[UndoLog]) -> bool:
    """Write ``value`` into ``param``'s second moments where ``keep`` is 0 *and* the first moment
    (``exp_avg``) is exactly 0 -- only there is the update zero whatever the second moment holds.
    Returns whether there was such state."""
    state = opt.state.get(param)
    first = state.get("exp_avg") if state else None
    if not (is_tensor(first) and tuple(first.shape) == tuple(param.shape)):
        return False
    where = (keep == 0) & (first == 0)
    for key in SECOND_MOMENTS:
        t = state.get(key)
        if is_tensor(t) and tuple(t.shape) == tuple(param.shape):
            _fill_where_(t, where, value, undo)
    return True


def fill_second_moments_(optimizers: Iterable[Any], param: Tensor, keep: Tensor,
                         undo: Optional[UndoLog]) -> Optional[int]:
    """Write :data:`TINY` into the Adam-style second moments of ``param`` where ``keep`` is 0 and
    the first moment is 0 (recorded in ``undo``); return the shortest refill period, or ``None``
    if nothing was written.

    Examples:
        >>> import torch
        >>> from prunekit.training._optim import TINY, fill_second_moments_
        >>> p = torch.nn.Parameter(torch.ones(4)); opt = torch.optim.Adam([p])
        >>> p.grad = torch.tensor([1., 0., 1., 0.]); opt.step()
        >>> fill_second_moments_([opt], p, torch.tensor([1., 0., 1., 0.]), None)
        13856
        >>> [v == TINY for v in opt.state[p]["exp_avg_sq"].tolist()]
        [False, True, False, True]
    """
    period: Optional[int] = None
    for opt in optimizers:
        p_period = refill_period(opt, param)
        if p_period is not None and _second_moments(opt, param, keep, TINY, undo):
            period = p_period if period is None else min(period, p_period)
    return period


def clear_pruned_state_(optimizers: Iterable[Any], param: Tensor, keep: Tensor,
                        undo: Optional[UndoLog]) -> Optional[int]:
    """Clear ``param``'s per-entry optimizer state where ``keep`` is 0 -- zeros, then :data:`TINY`
    in Adam-style second moments -- recording every change in ``undo``. Returns the refill period
    of the second moments written (``None`` when there were none)."""
    period: Optional[int] = None
    for opt in optimizers:
        state = opt.state.get(param)
        if not state:
            continue
        p_period = refill_period(opt, param)
        for key, t in state.items():
            if is_tensor(t) and tuple(t.shape) == tuple(param.shape):
                if p_period is None or key not in SECOND_MOMENTS:
                    zero_where_(t, keep, undo)
        if p_period is not None:
            for key in SECOND_MOMENTS:  # what the TINY fill does not cover is cleared as usual
                t = state.get(key)
                if is_tensor(t) and tuple(t.shape) == tuple(param.shape):
                    zero_where_(t, keep, undo)
            if _second_moments(opt, param, keep, TINY, undo):
                period = p_period if period is None else min(period, p_period)
    return period


def release_second_moments_(optimizers: Iterable[Any], param: Tensor, keep: Tensor,
                            undo: Optional[UndoLog]) -> None:
    """Put zeros back where :data:`TINY` was written (pruned entries whose first moment is 0):
    what plain clearing leaves there (cleared, then decayed with a zero gradient)."""
    for opt in optimizers:
        if refill_period(opt, param) is not None:
            _second_moments(opt, param, keep, 0.0, undo)


def _fill_where_(t: Tensor, where: Tensor, value: float, undo: Optional[UndoLog]) -> None:
    b = backend_of(t) or TORCH
    with b.no_grad():
        if undo is not None:
            saved = t[where]

            def restore() -> None:
                with b.no_grad():
                    t[where] = saved

            undo.add(restore)
        t.masked_fill_(where, value)
