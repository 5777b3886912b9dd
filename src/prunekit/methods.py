"""The six pruning methods of ``torch.nn.utils.prune`` and their functional forms.

Each method's ``compute_mask(t, default_mask)`` has torch's semantics: the
same amount rules, the same random-number consumption (so ``random_*`` give
torch's masks under the same seed) and exactly ``k`` units pruned. The
magnitude selection is prunekit's linear-time kernel
(:mod:`prunekit.kernels.select`) instead of a full ``topk``. The criteria are
the importance registry's (:mod:`prunekit.importance`): ``magnitude`` for
``L1Unstructured``, ``ln`` (the kernels' channel norms) for ``LnStructured``.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor, nn

from . import reparam
from .reparam._internal import atomic
from ._backend import TORCH, backend_of, is_tensor, same_backend
from .base import BasePruningMethod, is_lazy_ones
from .errors import PruningError
from .importance import LnNorm, Magnitude
from .kernels.amount import (
    Amount,
    compute_nparams_to_prune,
    validate_pruning_amount,
    validate_pruning_amount_init,
)
from .kernels.norms import NormOrder, validate_norm_order
from .kernels.select import keep_mask_smallest, select_lowest

__all__ = [
    "CustomFromMask",
    "Identity",
    "L1Unstructured",
    "LnStructured",
    "RandomStructured",
    "RandomUnstructured",
    "apply_mask",
    "custom_from_mask",
    "identity",
    "l1_unstructured",
    "ln_structured",
    "random_structured",
    "random_unstructured",
]


def _with_keep(default_mask: Tensor, keep: Tensor) -> Tensor:
    """``default_mask`` with the entries where ``keep`` is False set to zero."""
    if is_lazy_ones(default_mask):
        return keep.to(default_mask.dtype).expand(default_mask.shape)
    return default_mask * keep


def validate_structured(t: Tensor, dim: int) -> int:
    """``dim`` as an index in ``[0, t.dim())``, after checking that ``t`` has channels along it.

    Examples:
        >>> import torch
        >>> validate_structured(torch.zeros(3, 4), -1)
        1
    """
    if t.dim() <= 1:
        raise ValueError(
            "Structured pruning can only be applied to multidimensional tensors. Found tensor of shape "
            f"{tuple(t.shape)} with {t.dim()} dims; use an unstructured method (e.g. l1_unstructured) instead"
        )
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"dim must be an int, got {dim!r}")
    if not -t.dim() <= dim < t.dim():
        raise IndexError(
            f"Invalid index {dim} for tensor of size {tuple(t.shape)}: dim must be in [{-t.dim()}, {t.dim() - 1}]"
        )
    return dim % t.dim()


def _count(amount: Amount, units: int) -> int:
    """Units to prune out of ``units`` (torch's rounding), refused if above what there is."""
    nparams_toprune = compute_nparams_to_prune(amount, units)
    validate_pruning_amount(nparams_toprune, units)
    return nparams_toprune


def _channels_to_prune(t: Tensor, dim: int, amount: Amount) -> Tuple[int, int, int]:
    """``(dim, channels along it, channels to prune)`` for a structured method, all validated."""
    dim = validate_structured(t, dim)
    return dim, t.shape[dim], _count(amount, t.shape[dim])


def _check_dim(dim: int) -> int:
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"dim must be an int, got {dim!r}")
    return dim


def _channel_mask(keep_channels: Tensor, t: Tensor, dim: int) -> Tensor:
    shape = [1] * t.dim()
    shape[dim] = -1
    return keep_channels.view(shape)


class Identity(BasePruningMethod):
    """Prunes nothing; installs the reparameterization with a mask of ones."""

    PRUNING_TYPE = "unstructured"
    _lazy_default_ok = True

    def compute_mask(self, t: Tensor, default_mask: Tensor) -> Tensor:
        return default_mask

    @classmethod
    def apply(cls, module: nn.Module, name: str, *, mask_dtype: Optional[torch.dtype] = None):  # type: ignore[override]
        return super().apply(module, name, mask_dtype=mask_dtype)


class RandomUnstructured(BasePruningMethod):
    """Prune (currently unpruned) entries at random; torch's masks under the same seed."""

    PRUNING_TYPE = "unstructured"

    def __init__(self, amount: Amount) -> None:
        validate_pruning_amount_init(amount)
        self.amount = amount

    def compute_mask(self, t: Tensor, default_mask: Tensor) -> Tensor:
        tensor_size = t.numel()
        nparams_toprune = _count(self.amount, tensor_size)
        b = backend_of(t) or TORCH
        mask = default_mask.clone(memory_format=b.contiguous_format)
        if nparams_toprune != 0:
            if not (t.is_floating_point() or t.is_complex()):
                # integer and bool tensors: float32 draws (torch's rand_like refuses their dtype)
                prob = b.ns.rand(tuple(t.shape)) if b is not TORCH else torch.rand(t.shape, device=t.device)
            elif b is not TORCH:
                prob = b.ns.rand_like(t)
            else:
                prob = torch.rand_like(t, memory_format=torch.contiguous_format)
            indices = b.topk(prob.reshape(-1), k=nparams_toprune)[1]
            mask.view(-1)[indices] = 0
        return mask

    @classmethod
    def apply(cls, module: nn.Module, name: str, amount: Amount, *, mask_dtype: Optional[torch.dtype] = None):  # type: ignore[override]
        return super().apply(module, name, amount=amount, mask_dtype=mask_dtype)


class L1Unstructured(BasePruningMethod):
    """Prune the (currently unpruned) entries with the smallest absolute value (or importance)."""

    PRUNING_TYPE = "unstructured"
    _lazy_default_ok = True
    #: the registry's criterion (ranks by |t|: the kernel reads ``t`` itself, no copy)
    scorer = Magnitude()

    def __init__(self, amount: Amount) -> None:
        validate_pruning_amount_init(amount)
        self.amount = amount

    def compute_mask(self, t: Tensor, default_mask: Tensor) -> Tensor:
        tensor_size = t.numel()
        nparams_toprune = _count(self.amount, tensor_size)
        if nparams_toprune == 0:
            return default_mask
        ranked = self.scorer.ranking_input(t)
        return _with_keep(default_mask, keep_mask_smallest(ranked, nparams_toprune).view(t.shape))

    def _combine_fast(self, t: Tensor, mask: Tensor) -> Optional[Tensor]:
        # Rank only entries whose mask is 1, in place instead of gathering them.
        if type(self).compute_mask is not L1Unstructured.compute_mask:
            return None  # a subclass changed the rule: use the generic path
        eligible = mask == 1
        remaining = int(eligible.sum())
        nparams_toprune = _count(self.amount, remaining)
        if nparams_toprune == 0:
            return mask
        return mask * keep_mask_smallest(self.scorer.ranking_input(t), nparams_toprune, eligible).view(t.shape)

    @classmethod
    def apply(cls, module: nn.Module, name: str, amount: Amount, importance_scores: Optional[Tensor] = None,  # type: ignore[override]
              *, mask_dtype: Optional[torch.dtype] = None):
        return super().apply(module, name, amount=amount, importance_scores=importance_scores, mask_dtype=mask_dtype)


class RandomStructured(BasePruningMethod):
    """Prune entire (currently unpruned) channels along ``dim`` at random; torch's masks under the same seed."""

    PRUNING_TYPE = "structured"

    def __init__(self, amount: Amount, dim: int = -1) -> None:
        validate_pruning_amount_init(amount)
        self.amount = amount
        self.dim = _check_dim(dim)

    def compute_mask(self, t: Tensor, default_mask: Tensor) -> Tensor:
        dim, tensor_size, nparams_toprune = _channels_to_prune(t, self.dim, self.amount)
        if nparams_toprune == 0:
            return default_mask
        b = backend_of(t) or TORCH
        prob = b.ns.rand(tensor_size)  # CPU draw, as torch does
        threshold = b.kthvalue(prob, nparams_toprune)[0]
        keep = prob > threshold
        if keep.device != t.device:
            keep = keep.to(t.device)
        return _with_keep(default_mask, _channel_mask(keep, t, dim))

    @classmethod
    def apply(cls, module: nn.Module, name: str, amount: Amount, dim: int = -1,  # type: ignore[override]
              *, mask_dtype: Optional[torch.dtype] = None):
        return super().apply(module, name, amount=amount, dim=dim, mask_dtype=mask_dtype)


class LnStructured(BasePruningMethod):
    """Prune entire (currently unpruned) channels along ``dim`` with the lowest L``n`` norm.

    ``n`` may be any real number, ``inf``, ``-inf``, ``'fro'`` or ``'nuc'``
    on tensors of any rank; see :func:`prunekit.kernels.norms.channel_norms`
    for the meaning of each.
    """

    PRUNING_TYPE = "structured"
    _lazy_default_ok = True

    def __init__(self, amount: Amount, n: NormOrder, dim: int = -1) -> None:
        validate_pruning_amount_init(amount)
        validate_norm_order(n)
        self.amount = amount
        self.n = n
        self.dim = _check_dim(dim)

    def compute_mask(self, t: Tensor, default_mask: Tensor) -> Tensor:
        dim, tensor_size, nparams_toprune = _channels_to_prune(t, self.dim, self.amount)
        if nparams_toprune == 0:
            return default_mask
        b = backend_of(t) or TORCH
        norm = LnNorm(self.n).unit_scores(t, dim)  # the registry's "ln": the kernels' channel norms
        nan = norm.isnan()
        if bool(nan.any()):
            raise ValueError(
                f"{int(nan.sum())} channel norm(s) are NaN (NaN in the weights or scores); "
                f"no channel order exists. Replace NaN first (e.g. {b.name}.nan_to_num)"
            )
        # the lowest norms, ties by position (lowest channel first): the same channels on every backend
        keep = ~select_lowest(norm, nparams_toprune)
        if keep.device != t.device:
            keep = keep.to(t.device)
        return _with_keep(default_mask, _channel_mask(keep, t, dim))

    @classmethod
    def apply(cls, module: nn.Module, name: str, amount: Amount, n: NormOrder, dim: int,  # type: ignore[override]
              importance_scores: Optional[Tensor] = None, *, mask_dtype: Optional[torch.dtype] = None):
        return super().apply(module, name, amount=amount, n=n, dim=dim,
                             importance_scores=importance_scores, mask_dtype=mask_dtype)


class CustomFromMask(BasePruningMethod):
    """Prune with a mask computed elsewhere. Once stored in ``name_mask`` the hook keeps no copy of it."""

    PRUNING_TYPE = "global"
    _lazy_default_ok = True
    mask: Optional[Tensor]  # None once the mask is stored in the module

    def __init__(self, mask: Tensor) -> None:
        if not is_tensor(mask):
            raise TypeError(f"mask must be a tensor (torch or tensorplay) of 0s and 1s, got {type(mask).__name__}")
        self.mask = mask

    def compute_mask(self, t: Tensor, default_mask: Tensor) -> Tensor:
        if self.mask is None:
            raise PruningError("this CustomFromMask was already applied; its mask lives in the module's name_mask buffer")
        if default_mask.shape != self.mask.shape:
            raise PruningError(
                f"default_mask shape {tuple(default_mask.shape)} must match mask shape {tuple(self.mask.shape)}"
            )
        same_backend(backend_of(default_mask) or TORCH, self.mask, "mask", "custom_from_mask")
        mask = self.mask.to(dtype=default_mask.dtype, device=default_mask.device)
        if is_lazy_ones(default_mask):  # first pruning: the mask itself, in a tensor of its own
            return mask.clone() if mask is self.mask else mask
        return default_mask * mask

    def _release(self) -> None:
        self.mask = None

    @classmethod
    def apply(cls, module: nn.Module, name: str, mask: Tensor, *, mask_dtype: Optional[torch.dtype] = None):  # type: ignore[override]
        return super().apply(module, name, mask=mask, mask_dtype=mask_dtype)


# ------------------------------------------------------------ functional API
@atomic
def identity(module: nn.Module, name: str, *, mask_dtype: Optional[torch.dtype] = None) -> nn.Module:
    """Reparameterize ``name`` with a mask of ones (prunes nothing).

    Examples:
        >>> import torch, prunekit
        >>> m = prunekit.identity(torch.nn.Linear(2, 3), "bias")
        >>> m.bias_mask
        tensor([1., 1., 1.])
    """
    Identity.apply(module, name, mask_dtype=mask_dtype)
    return module


@atomic
def random_unstructured(module: nn.Module, name: str, amount: Amount, *, mask_dtype: Optional[torch.dtype] = None) -> nn.Module:
    """Prune ``amount`` of the currently unpruned entries of ``name`` at random.

    Examples:
        >>> import torch, prunekit
        >>> m = prunekit.random_unstructured(torch.nn.Linear(2, 3), "weight", amount=1)
        >>> int((m.weight_mask == 0).sum())
        1
    """
    RandomUnstructured.apply(module, name, amount, mask_dtype=mask_dtype)
    return module


@atomic
def l1_unstructured(module: nn.Module, name: str, amount: Amount, importance_scores: Optional[Tensor] = None,
                    *, mask_dtype: Optional[torch.dtype] = None) -> nn.Module:
    """Prune ``amount`` of the currently unpruned entries of ``name`` with the smallest |value| (or importance).

    ``amount``: an int counts entries; a float in [0, 1] is a fraction.
    ``mask_dtype=torch.bool`` stores a lean boolean mask.

    Examples:
        >>> import torch, prunekit
        >>> m = prunekit.l1_unstructured(torch.nn.Linear(64, 32, bias=False), name="weight", amount=0.3)
        >>> int((m.weight_mask == 0).sum()), prunekit.is_pruned(m)
        (614, True)
    """
    L1Unstructured.apply(module, name, amount=amount, importance_scores=importance_scores, mask_dtype=mask_dtype)
    return module


@atomic
def random_structured(module: nn.Module, name: str, amount: Amount, dim: int,
                      *, mask_dtype: Optional[torch.dtype] = None) -> nn.Module:
    """Prune ``amount`` of the currently unpruned channels of ``name`` along ``dim`` at random.

    Examples:
        >>> import torch, prunekit
        >>> m = prunekit.random_structured(torch.nn.Linear(5, 3), "weight", amount=3, dim=1)
        >>> int((m.weight_mask.sum(0) == 0).sum())
        3
    """
    RandomStructured.apply(module, name, amount, dim, mask_dtype=mask_dtype)
    return module


@atomic
def ln_structured(module: nn.Module, name: str, amount: Amount, n: NormOrder, dim: int,
                  importance_scores: Optional[Tensor] = None, *, mask_dtype: Optional[torch.dtype] = None) -> nn.Module:
    """Prune ``amount`` of the currently unpruned channels of ``name`` along ``dim`` with the lowest L``n`` norm.

    Examples:
        >>> import torch, prunekit
        >>> m = prunekit.ln_structured(torch.nn.Conv2d(3, 8, 3), "weight", amount=0.25, n="nuc", dim=0)
        >>> int((m.weight_mask.sum(dim=(1, 2, 3)) == 0).sum())
        2
    """
    LnStructured.apply(module, name, amount, n, dim, importance_scores=importance_scores, mask_dtype=mask_dtype)
    return module


@atomic
def custom_from_mask(module: nn.Module, name: str, mask: Tensor, *, mask_dtype: Optional[torch.dtype] = None) -> nn.Module:
    """Prune ``name`` with a mask you computed (combined with any earlier mask).

    Examples:
        >>> import torch, prunekit
        >>> m = prunekit.custom_from_mask(torch.nn.Linear(5, 3), name="bias", mask=torch.tensor([0, 1, 0]))
        >>> m.bias_mask
        tensor([0., 1., 0.])
    """
    CustomFromMask.apply(module, name, mask, mask_dtype=mask_dtype)
    return module


def apply_mask(module: nn.Module, name: str, mask: Tensor, *, mask_dtype: Optional[torch.dtype] = None) -> None:
    """Prune ``module.name`` with ``mask`` (zeros prune), on top of any mask it already has.

    :func:`custom_from_mask` for callers that need no module back (loading masks,
    compaction, training): the reparameterization is installed with a
    :class:`CustomFromMask` hook, or the existing mask is multiplied by ``mask``
    (a mask only loses ones); nothing is changed if anything fails. ``mask_dtype``
    as for every pruning function.

    Examples:
        >>> import torch
        >>> m = torch.nn.Linear(3, 1, bias=False)
        >>> apply_mask(m, "weight", torch.tensor([[1, 0, 1]]))
        >>> apply_mask(m, "weight", torch.tensor([[0, 1, 1]]))
        >>> m.weight_mask.tolist()
        [[0.0, 0.0, 1.0]]
    """
    CustomFromMask.apply(module, name, mask, mask_dtype=mask_dtype)


def remove(module: nn.Module, name: str) -> nn.Module:
    """Make the pruning of ``name`` permanent (see :func:`prunekit.reparam.remove`).

    Examples:
        >>> import torch, prunekit
        >>> m = prunekit.l1_unstructured(torch.nn.Linear(4, 2), "weight", amount=4)
        >>> m = prunekit.remove(m, "weight")
        >>> int((m.weight == 0).sum()), prunekit.is_pruned(m)
        (4, False)
    """
    return reparam.remove(module, name)
