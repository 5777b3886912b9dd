"""Saving and loading pruned sharded models with ``torch.distributed.checkpoint`` (DCP).

A pruned FSDP2 model's ``state_dict()`` holds ``name_orig`` and ``name_mask``
as DTensor shards, so ``dcp.save`` writes the masks with the weights, each
rank writing its own shards. :func:`save` does that for a model and,
optionally, its pruning state (:class:`~prunekit.training.PruningCallbacks`:
steps, schedule, scores and masks) and anything else you pass.

Loading needs a target shaped like the checkpoint. :func:`load` makes it:
every tensor that carries a mask in the checkpoint is reparameterized first
(a mask of ones, of the checkpoint's dtype, placed like the parameter), and
pruning scores the fresh callbacks do not have yet get a place to load into.
Then ``dcp.load`` fills everything in place, shard by shard.
"""

from __future__ import annotations

import os
from typing import Any, Dict, Mapping, Optional, Union

import torch
from torch import nn

__all__ = ["load", "save"]

PathLike = Union[str, "os.PathLike[str]"]


def _state(model: nn.Module, pruning: Optional[Any], extra: Mapping[str, Any]) -> Dict[str, Any]:
    state: Dict[str, Any] = {"model": model.state_dict()}
    if pruning is not None:
        state["pruning"] = pruning.state_dict()
    for key, value in extra.items():
        if key in ("model", "pruning"):
            raise ValueError(f"extra entry {key!r} would overwrite the {key} entry; name it differently")
        state[key] = value
    return state


def save(checkpoint_id: PathLike, model: nn.Module, pruning: Optional[Any] = None, **extra: Any) -> None:
    """Save ``model`` (masks included) and ``pruning`` with ``torch.distributed.checkpoint``. Collective.

    ``extra`` entries (e.g. an optimizer's state dict from
    ``torch.distributed.checkpoint.state_dict.get_state_dict``) are saved beside them.

    Example (a process group of one, a model without DTensors):
        >>> import os, tempfile, torch, torch.distributed as dist, prunekit
        >>> store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
        >>> dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        >>> m = prunekit.l1_unstructured(torch.nn.Linear(4, 2), "weight", 3)
        >>> path = tempfile.mkdtemp()
        >>> prunekit.distributed.save(path, m)
        >>> fresh = torch.nn.Linear(4, 2)
        >>> prunekit.distributed.load(path, fresh)
        >>> torch.equal(fresh.weight_mask, m.weight_mask), torch.equal(fresh.weight, m.weight)
        (True, True)
        >>> dist.destroy_process_group()
    """
    import torch.distributed.checkpoint as dcp

    dcp.save(_state(model, pruning, extra), checkpoint_id=os.fspath(checkpoint_id))


def _metadata(checkpoint_id: str) -> Dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    return dcp.FileSystemReader(checkpoint_id).read_metadata().state_dict_metadata


def _prepare_masks(model: nn.Module, meta: Mapping[str, Any]) -> None:
    """Reparameterize every tensor of ``model`` that has a mask in the checkpoint (a mask of ones)."""
    from .. import methods, reparam

    modules = dict(model.named_modules())
    for key, entry in meta.items():
        if not (key.startswith("model.") and key.endswith("_mask")):
            continue
        qual, _, tensor = key[len("model."):].rpartition(".")
        name = tensor[: -len("_mask")]
        module = modules.get(qual)
        if module is None or name in reparam.pruned_names(module):
            continue
        if name not in module._parameters:
            raise ValueError(
                f"checkpoint entry {key!r}: the model has no parameter {qual + '.' if qual else ''}{name}; "
                "load into a model of the same architecture"
            )
        dtype = getattr(getattr(entry, "properties", None), "dtype", None)
        methods.identity(module, name, mask_dtype=dtype)


def _prepare_scores(pruning: Any, state: Dict[str, Any], meta: Mapping[str, Any]) -> None:
    """Give each score saved in the checkpoint a place to load into (shaped and placed like its mask)."""
    for i, (pruner, saved) in enumerate(zip(pruning.pruners, state["pruning"]["pruners"])):
        for layer, mask in pruner.masks.items():
            key = f"pruning.pruners.{i}.scores.{layer}"
            if key in meta and layer not in saved["scores"]:
                dtype = getattr(getattr(meta[key], "properties", None), "dtype", None) or torch.float32
                saved["scores"][layer] = torch.zeros_like(mask, dtype=dtype)


def load(checkpoint_id: PathLike, model: nn.Module, pruning: Optional[Any] = None, **extra: Any) -> None:
    """Load what :func:`save` wrote into ``model`` (pruned, or not yet) and ``pruning``. Collective.

    ``model`` is the same architecture, sharded the same way or not at all;
    tensors pruned in the checkpoint are reparameterized before loading.
    ``pruning`` (callbacks from :func:`prunekit.prepare_pruning` with the
    same config) gets its steps, schedule, scores and masks back. ``extra``
    entries are loaded in place, as ``dcp.load`` does. See :func:`save` for an
    example.
    """
    import torch.distributed.checkpoint as dcp

    path = os.fspath(checkpoint_id)
    meta = _metadata(path)
    _prepare_masks(model, meta)
    state = _state(model, pruning, extra)
    if pruning is not None:
        _prepare_scores(pruning, state, meta)
    dcp.load(state, checkpoint_id=path)
    from .fsdp import remask

    remask(model)  # dcp.load wrote into the shards in place: keep pruned entries at zero
    if pruning is not None:
        pruning.load_state_dict(state["pruning"])
