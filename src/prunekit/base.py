"""``BasePruningMethod``, ``PruningContainer`` and ``apply``: the contract of a pruning method.

A method computes a mask (``compute_mask``); ``apply`` validates everything
first, computes the new mask without touching the module, and only then
installs it through :mod:`prunekit.reparam`. If anything fails, the module is
restored exactly (parameters, buffers, hooks, class).

Successive prunings of one tensor compose into one ``PruningContainer`` hook.
A new method acts only on what is still unpruned: for ``'unstructured'``
methods the entries whose mask is 1, for ``'structured'`` methods the
channels that still have a non-zero entry, for ``'global'`` methods all of
the tensor. A float amount is therefore a fraction of what remains, and the
mask only ever loses ones -- the semantics of ``torch.nn.utils.prune``.
(The container lives here, beside ``apply``, which composes methods into it;
it is public as ``prunekit.PruningContainer``.)
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import Any, Optional

import torch
from torch import Tensor, nn

from . import _sharded, reparam
from .reparam._internal import Snapshot, check_prunable, effective_with_grad, install, with_context
from ._backend import TORCH, backend_of, is_tensor, same_backend
from .errors import PruningError

__all__ = ["BasePruningMethod", "PruningContainer", "combine_masks", "resolve_mask_dtype"]


def resolve_mask_dtype(mask_dtype: Optional[Any], orig: Tensor, existing: Optional[Tensor]) -> Any:
    """The dtype of the stored mask: explicit, else the existing mask's, else the weight's (as torch,
    integer and bool weights included: the pruned tensor keeps the weight's dtype).

    For a TensorPlay weight a torch dtype (``torch.bool``) is taken as the
    TensorPlay dtype of the same name.
    """
    b = backend_of(orig) or TORCH
    if mask_dtype is not None:
        if b is TORCH:
            if not isinstance(mask_dtype, torch.dtype):
                raise TypeError(f"mask_dtype must be a torch.dtype such as torch.bool, got {mask_dtype!r}")
            return mask_dtype
        return b.as_dtype(mask_dtype)
    if existing is not None:
        return existing.dtype
    return orig.dtype  # integer and bool weights keep their dtype, as torch does


def lazy_ones(like: Tensor) -> Tensor:
    """A mask of ones that takes no memory (an expanded scalar); built-in methods understand it."""
    b = backend_of(like) or TORCH
    return b.ns.ones((), dtype=like.dtype, device=like.device).expand(tuple(like.shape))


def is_lazy_ones(mask: Tensor) -> bool:
    return mask.dim() > 0 and all(s == 0 for s in mask.stride())


class BasePruningMethod(ABC):
    """Abstract base class for the creation of new pruning techniques.

    Subclasses set ``PRUNING_TYPE`` (``'unstructured'``, ``'structured'`` or
    ``'global'``) and implement ``compute_mask(t, default_mask)``, exactly as
    with ``torch.nn.utils.prune``.

    Examples:
        >>> import torch, prunekit
        >>> class KeepEven(prunekit.BasePruningMethod):
        ...     PRUNING_TYPE = "unstructured"
        ...     def compute_mask(self, t, default_mask):
        ...         mask = default_mask.clone()
        ...         mask.view(-1)[1::2] = 0
        ...         return mask
        >>> m = torch.nn.Linear(2, 2)
        >>> _ = KeepEven.apply(m, "weight")
        >>> m.weight_mask.view(-1).tolist()
        [1.0, 0.0, 1.0, 0.0]
    """

    PRUNING_TYPE: str = "unstructured"
    _tensor_name: Optional[str] = None
    _prunekit_method = True  # marks prunekit hooks in module._forward_pre_hooks
    _lazy_default_ok = False  # built-in methods accept a zero-memory default mask of ones

    def __call__(self, module: nn.Module, inputs: Any) -> None:
        """Forward pre-hook. Nothing to do: ``module.<name>`` is a property that is always current.

        The hook is kept so that code which looks for pruning methods among
        ``module._forward_pre_hooks`` (as torch's code does) finds it.
        """
        return None

    @abstractmethod
    def compute_mask(self, t: Tensor, default_mask: Tensor) -> Tensor:
        """Return the new mask for importance scores ``t``, on top of ``default_mask``."""

    def apply_mask(self, module: nn.Module) -> Tensor:
        """``name_orig * name_mask`` for the tensor this method prunes.

        Examples:
            >>> import torch, prunekit
            >>> m = prunekit.l1_unstructured(torch.nn.Linear(3, 2), "weight", amount=2)
            >>> hook = next(iter(m._forward_pre_hooks.values()))
            >>> torch.equal(hook.apply_mask(m), m.weight)
            True
        """
        if self._tensor_name is None:
            raise PruningError(f"Module {reparam.describe(module)} has to be pruned")
        return effective_with_grad(
            getattr(module, self._tensor_name + "_orig"), getattr(module, self._tensor_name + "_mask")
        )

    def prune(self, t: Tensor, default_mask: Optional[Tensor] = None, importance_scores: Optional[Tensor] = None) -> Tensor:
        """Return ``t`` with this method's mask applied (no module involved).

        Examples:
            >>> import torch, prunekit
            >>> prunekit.L1Unstructured(amount=1).prune(torch.tensor([3.0, 1.0, 2.0])).tolist()
            [3.0, 0.0, 2.0]
        """
        if importance_scores is not None:
            if importance_scores.shape != t.shape:
                raise PruningError(
                    f"importance_scores should have the same shape as tensor t, got "
                    f"{tuple(importance_scores.shape)} vs {tuple(t.shape)}"
                )
        else:
            importance_scores = t
        default_mask = default_mask if default_mask is not None else (backend_of(t) or TORCH).ns.ones_like(t)
        return t * self.compute_mask(importance_scores, default_mask=default_mask)

    def remove(self, module: nn.Module) -> None:
        """Make the pruning permanent and drop the reparameterization (see :func:`prunekit.remove`)."""
        if self._tensor_name is None:
            raise PruningError(f"Module {reparam.describe(module)} has to be pruned before pruning can be removed")
        reparam.remove(module, self._tensor_name)

    # ---------------------------------------------------------------- apply
    @classmethod
    def apply(
        cls,
        module: nn.Module,
        name: str,
        *args: Any,
        importance_scores: Optional[Tensor] = None,
        mask_dtype: Optional[Any] = None,
        **kwargs: Any,
    ) -> "BasePruningMethod":
        """Prune ``module.<name>`` with this method and install the reparameterization.

        ``mask_dtype`` (keyword, prunekit only) chooses the stored mask's
        dtype: by default the weight's dtype (as torch), ``torch.bool`` for a
        mask four times smaller than a float32 one.

        Examples:
            >>> import torch, prunekit
            >>> m = torch.nn.Linear(4, 2)
            >>> method = prunekit.L1Unstructured.apply(m, "weight", amount=0.5, mask_dtype=torch.bool)
            >>> m.weight_mask.dtype, int(m.weight_mask.sum())
            (torch.bool, 4)
        """
        orig, pruned = check_prunable(module, name)
        hook_key, old = reparam.find_hook(module, name) if pruned else (None, None)
        try:
            method = cls(*args, **kwargs)
        except (ValueError, TypeError, IndexError) as e:
            raise with_context(e, module, name) from None
        method._tensor_name = name
        existing = module._buffers[name + "_mask"] if pruned else None
        b = backend_of(orig) or TORCH
        sharded = _sharded.handler_for(orig)
        if sharded is None:
            _sharded.check_plain(orig, module, name)
        try:
            out_dtype = resolve_mask_dtype(mask_dtype, orig, existing)
            with b.no_grad():
                if sharded is None:
                    mask = _compute(method, old, module, name, orig, existing, importance_scores)
                    mask = _as_stored_mask(mask, orig, out_dtype)
                else:  # a DTensor shard: the same decision, made across ranks (prunekit.distributed)
                    mask = sharded.compute_mask(method, module, name, orig, existing, importance_scores, out_dtype)
        except (ValueError, TypeError, IndexError) as e:
            raise with_context(e, module, name) from None
        except NotImplementedError:
            if getattr(orig, "is_meta", False):  # e.g. built under accelerate's init_empty_weights()
                raise ValueError(
                    f"{reparam.describe(module, name)} is on the meta device (no values): {cls.__name__} cannot "
                    "choose what to prune. Load the weights first; or install the pruning structure with "
                    "prunekit.custom_from_mask(module, name, mask) (a meta mask is fine) and fill it with "
                    "model.load_state_dict(pruned_state_dict, assign=True); or load a pruned state dict into the "
                    "dense empty model with prunekit.load_state_dict(model, state_dict, assign=True)"
                ) from None
            raise

        hook = _compose(old, method)
        snapshot = Snapshot(module)
        try:
            install(module, name, mask, hook, hook_key)
            if isinstance(old, PruningContainer) and hook is old:
                old.add_pruning_method(method)
            if sharded is not None:
                sharded.installed(module, name)
            method._release()
            return hook
        except BaseException:
            snapshot.restore()
            raise

    def _release(self) -> None:
        """Drop tensors the method no longer needs once its mask is stored (none by default)."""

    def _combine_fast(self, t: Tensor, mask: Tensor) -> Optional[Tensor]:
        """Optional fast path for the container: new mask on top of ``mask``, or ``None``."""
        return None


class PruningContainer(BasePruningMethod):
    """Container holding a sequence of pruning methods for iterative pruning.

    Examples:
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

    Examples:
        >>> import torch, prunekit
        >>> mask = torch.tensor([1.0, 0.0, 1.0, 1.0])
        >>> combine_masks(prunekit.L1Unstructured(amount=1), torch.tensor([5.0, 0.1, 3.0, 4.0]), mask).tolist()
        [1.0, 0.0, 0.0, 1.0]
    """
    # the result has t's dtype whatever the dtype of mask (an integer default_mask
    # included), as torch's PruningContainer gives
    fast = method._combine_fast(t, mask)
    if fast is not None:
        return fast if fast.dtype == t.dtype else fast.to(t.dtype)
    new_mask = mask.to(dtype=t.dtype)
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


def _compose(old: Optional[BasePruningMethod], method: BasePruningMethod) -> BasePruningMethod:
    if old is None:
        return method
    if isinstance(old, PruningContainer):
        return old
    container = PruningContainer(old)
    container.add_pruning_method(method)
    return container


def _compute(
    method: BasePruningMethod,
    old: Optional[BasePruningMethod],
    module: nn.Module,
    name: str,
    orig: Tensor,
    existing: Optional[Tensor],
    importance_scores: Optional[Tensor],
) -> Tensor:
    b = backend_of(orig) or TORCH
    if importance_scores is not None:
        if not is_tensor(importance_scores):
            raise TypeError(
                f"importance_scores must be a tensor shaped like the parameter, got {type(importance_scores).__name__}"
            )
        same_backend(b, importance_scores, "importance_scores", f"parameter {name}")
        if importance_scores.shape != orig.shape:
            raise PruningError(
                f"importance_scores should have the same shape as parameter {name}: "
                f"got {tuple(importance_scores.shape)} vs {tuple(orig.shape)}"
            )
    if existing is None:
        scores = importance_scores if importance_scores is not None else orig.detach()
        default = lazy_ones(orig) if method._lazy_default_ok else b.ones_like(orig)
        return method.compute_mask(scores, default_mask=default)
    work_dtype = orig.dtype if orig.dtype != b.bool else b.ns.get_default_dtype()
    default = existing.to(dtype=work_dtype, memory_format=b.contiguous_format, copy=True)
    if importance_scores is not None:
        scores = importance_scores
    elif method.PRUNING_TYPE == "unstructured":
        # the container ranks only entries whose mask is 1, where orig == orig * mask
        scores = orig.detach()
    else:
        scores = reparam.effective(module, name)
    return combine_masks(method, scores, default)


def _as_stored_mask(mask: Tensor, orig: Tensor, dtype: Any) -> Tensor:
    """The mask as it is stored: ``dtype``, the weight's memory format, its own memory."""
    b = backend_of(orig) or TORCH
    if backend_of(mask) is not b or mask.shape != orig.shape:
        shape = tuple(mask.shape) if is_tensor(mask) else type(mask).__name__
        theirs = backend_of(mask)
        if is_tensor(mask) and theirs is not None and mask.shape == orig.shape:
            raise PruningError(
                f"the computed mask is a {theirs.name} tensor, expected a {b.name} tensor like the weight"
            )
        raise PruningError(f"the computed mask has shape {shape}, expected {tuple(orig.shape)}")
    if mask.device != orig.device:
        mask = mask.to(orig.device)
    cl = orig.dim() == 4 and orig.is_contiguous(memory_format=b.channels_last) and not orig.is_contiguous()
    fmt = b.channels_last if cl else b.contiguous_format
    if dtype == b.bool and mask.dtype != b.bool:
        mask = mask != 0
    if (mask.dtype == dtype and mask.is_contiguous(memory_format=fmt) and not is_lazy_ones(mask)
            and mask.data_ptr() != orig.data_ptr()):
        return mask
    out = b.empty_like(orig, dtype=dtype, channels_last=cl)
    out.copy_(mask)
    return out
