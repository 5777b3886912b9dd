"""``PruningContainer``: successive prunings of one tensor compose into one hook.

A new method acts only on what is still unpruned: for ``'unstructured'``
methods the entries whose mask is 1, for ``'structured'`` methods the
channels that still have a non-zero entry, for ``'global'`` methods all of
the tensor. A float amount is therefore a fraction of what remains, and the
mask only ever loses ones — the semantics of ``torch.nn.utils.prune``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import Tensor

from .base import BasePruningMethod

__all__ = ["PruningContainer", "combine_masks"]


class PruningContainer(BasePruningMethod):
    """Container holding a sequence of pruning methods for iterative pruning.

    Example:
        >>> import torch, prunekit
        >>> m = torch.nn.Linear(4, 3)
        >>> _ = prunekit.l1_unstructured(m, "weight", amount=0.5)
        >>> hook = prunekit.ln_structured(m, "weight", amount=1, n=2, dim=0)._forward_pre_hooks
        >>> container = next(iter(hook.values()))
        >>> [type(h).__name__ for h in container]
        ['L1Unstructured', 'LnStructured']
    """

    def __init__(self, *args: Any) -> None:
        self._pruning_methods: tuple = tuple()
        if not isinstance(args, Iterable):  # kept for parity with torch
            self._tensor_name = args._tensor_name
            self.add_pruning_method(args)
        elif len(args) == 1:
            self._tensor_name = args[0]._tensor_name
            self.add_pruning_method(args[0])
        else:
            for method in args:
                self.add_pruning_method(method)

    def add_pruning_method(self, method: Any) -> None:
        """Append ``method`` (a ``BasePruningMethod`` for the same tensor) to the container."""
        if not isinstance(method, BasePruningMethod) and method is not None:
            raise TypeError(f"{type(method).__name__} is not a BasePruningMethod subclass")
        elif method is not None and self._tensor_name != method._tensor_name:
            raise ValueError(
                "Can only add pruning methods acting on the parameter named "
                f"'{self._tensor_name}' to PruningContainer {self}. Found '{method._tensor_name}'"
            )
        self._pruning_methods += (method,)

    def __len__(self) -> int:
        return len(self._pruning_methods)

    def __iter__(self):
        return iter(self._pruning_methods)

    def __getitem__(self, idx: int) -> BasePruningMethod:
        return self._pruning_methods[idx]

    def compute_mask(self, t: Tensor, default_mask: Tensor) -> Tensor:
        """Apply the latest method to the still-unpruned part of ``t`` and combine with ``default_mask``."""
        return combine_masks(self._pruning_methods[-1], t, default_mask)


def combine_masks(method: BasePruningMethod, t: Tensor, mask: Tensor) -> Tensor:
    """New mask from ``method`` computed on the unpruned part of ``t``, combined with ``mask``.

    Example:
        >>> import torch, prunekit
        >>> mask = torch.tensor([1.0, 0.0, 1.0, 1.0])
        >>> combine_masks(prunekit.L1Unstructured(amount=1), torch.tensor([5.0, 0.1, 3.0, 4.0]), mask).tolist()
        [1.0, 0.0, 0.0, 1.0]
    """
    fast = method._combine_fast(t, mask)
    if fast is not None:
        return fast
    new_mask = mask.to(dtype=t.dtype) if t.is_floating_point() else mask.clone()
    if new_mask is mask:
        new_mask = mask.clone()
    if method.PRUNING_TYPE == "unstructured":
        slc: Any = mask == 1
    elif method.PRUNING_TYPE == "structured":
        if not hasattr(method, "dim"):
            raise AttributeError('Pruning methods of PRUNING_TYPE "structured" need to have the attribute `dim` defined.')
        n_dims = t.dim()
        dim = method.dim
        if not -n_dims <= dim < n_dims:
            raise IndexError(f"dim={dim} is out of range for a tensor with {n_dims} dims (shape {tuple(t.shape)})")
        dim %= n_dims
        keep_channel = mask.sum(dim=[d for d in range(n_dims) if d != dim]) != 0
        slc = [slice(None)] * n_dims
        slc[dim] = keep_channel
        slc = tuple(slc)
    elif method.PRUNING_TYPE == "global":
        slc = tuple([slice(None)] * t.dim())
    else:
        raise ValueError(f"Unrecognized PRUNING_TYPE {method.PRUNING_TYPE!r}; use 'unstructured', 'structured' or 'global'")
    partial_mask = method.compute_mask(t[slc], default_mask=mask[slc])
    new_mask[slc] = partial_mask.to(dtype=new_mask.dtype)
    return new_mask
