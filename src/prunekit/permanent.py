"""Making pruning permanent for a whole model: :func:`remove_all`.

``prunekit.remove(module, name)`` bakes one mask into its tensor;
:func:`remove_all` does it for every masked tensor of a model (pruned by
prunekit or by ``torch.nn.utils.prune``), as one transaction. Afterwards the
model holds plain parameters only -- its ``state_dict()`` has ``weight``
where it had ``weight_orig``/``weight_mask`` -- so any tool that saves or
loads dense models handles it.
"""

from __future__ import annotations

from typing import Any, List, Optional, Tuple

from torch import Tensor, nn

from . import _sharded, reparam
from .reparam._internal import Snapshot, orig_and_mask
from ._backend import TORCH, backend_of, is_module

__all__ = ["remove_all"]


def _overwritten(orig: Tensor, mask: Tensor) -> Tuple[Optional[Tensor], Optional[Tensor]]:
    """What baking ``mask`` into ``orig`` overwrites, to put back after a failure: ``(where, values)``.

    ``(None, None)`` when the bake changes nothing (binary mask, ``orig`` already zero wherever the
    mask is: what the training pruners and one-shot pruning leave), so that common case keeps
    nothing aside. ``where`` is ``None`` with a full copy for sharded (DTensor) tensors.
    """
    b = backend_of(orig) or TORCH
    with b.no_grad():
        if type(orig) not in _sharded.PLAIN_TYPES or type(mask) not in _sharded.PLAIN_TYPES:
            return None, orig.detach().clone()
        where = ~mask if mask.dtype == b.bool else (mask != 1)
        values = orig.detach()[where]
        binary = mask.dtype == b.bool or bool(((mask == 0) | (mask == 1)).all())
        if binary and not bool((values != 0).any()):
            return None, None
        return where, values


def remove_all(model: nn.Module) -> int:
    """Make every mask in ``model`` permanent (:func:`prunekit.remove` on each masked tensor); return how many.

    Each ``name_orig``/``name_mask`` pair -- whoever made it, prunekit or
    ``torch.nn.utils.prune`` -- becomes the plain parameter ``name`` holding
    ``name_orig * name_mask`` (pruned entries exactly ``+0``); the
    ``nn.Parameter`` object stays the same, so an optimizer over the model
    keeps working. All or nothing: on any failure, ``KeyboardInterrupt``
    included, every tensor already made permanent is put back as it was.
    To undo, the values the bake overwrites (the entries under a mask, where
    they are not already zero) are kept until the call returns; a model whose
    pruned entries are already zero (after training or one-shot pruning) keeps
    nothing aside.

    Examples:
        >>> import torch, prunekit
        >>> net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
        >>> _ = prunekit.l1_unstructured(net[0], "weight", 8)
        >>> _ = prunekit.random_unstructured(net[2], "bias", 1)
        >>> prunekit.remove_all(net), prunekit.is_pruned(net), sorted(net.state_dict())
        (2, False, ['0.bias', '0.weight', '2.bias', '2.weight'])
        >>> int((net[0].weight == 0).sum()), prunekit.remove_all(net)
        (8, 0)
    """
    if not is_module(model):
        raise TypeError(f"remove_all() needs an nn.Module, got {type(model).__name__}; pass the model itself")
    todo = list(reparam.iter_masked(model))
    done: List[Tuple[Any, ...]] = []
    try:
        for qual, module, name in todo:
            orig, mask = orig_and_mask(module, name)
            reparam.sync(module)  # a pending write through the pruned name lands first
            # torch.nn.utils.prune's remove gives the parameter new storage: the old one is the undo
            where, values = _overwritten(orig, mask) if name in reparam.pruned_names(module) else (None, None)
            snapshot = Snapshot(module)
            old_data = orig.data
            done.append((module, snapshot, orig, old_data, mask, where, values))
            reparam.unmask(module, name, bake=True)
        return len(todo)
    except BaseException:
        for module, snapshot, orig, old_data, mask, where, values in reversed(done):
            b = backend_of(orig) or TORCH
            with b.no_grad():
                if orig.data is not old_data:
                    orig.data = old_data
                if values is not None:
                    if where is None:
                        orig.detach().copy_(values)
                    else:
                        orig.detach()[where] = values
            snapshot.restore()
        raise
