"""Moving state dicts between pruned and dense models.

A pruned model's state dict holds ``x_orig`` and ``x_mask`` where a dense
model has ``x``. ``torch.nn.Module.load_state_dict`` refuses either direction.
:func:`dense_state_dict` bakes the masks in (pruned -> dense); 
:func:`load_state_dict` loads any of the four combinations into a model.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Dict, List, Mapping, Tuple, Union

from torch import Tensor, nn

from . import methods, reparam
from .reparam._internal import Snapshot
from ._backend import TORCH, backend_of, is_module, is_tensor

__all__ = ["StateDictMismatchError", "dense_state_dict", "load_state_dict"]


class StateDictMismatchError(ValueError, RuntimeError):
    """Checkpoint keys or shapes that do not fit the model (a RuntimeError too, like torch's)."""


def dense_state_dict(source: Union[nn.Module, Mapping[str, Tensor]]) -> "OrderedDict[str, Tensor]":
    """A state dict in which every ``x_orig``/``x_mask`` pair is replaced by ``x = x_orig * x_mask``.

    Works on a model (pruned or not) or on a state dict; the result loads into
    the dense model with plain ``load_state_dict``.

    Examples:
        >>> import torch, prunekit
        >>> m = prunekit.l1_unstructured(torch.nn.Linear(4, 2), "weight", amount=3)
        >>> sd = prunekit.dense_state_dict(m)
        >>> sorted(sd), int((sd["weight"] == 0).sum())
        (['bias', 'weight'], 3)
        >>> torch.nn.Linear(4, 2).load_state_dict(sd)
        <All keys matched successfully>
    """
    sd = source.state_dict() if is_module(source) else source
    if not isinstance(sd, Mapping):
        raise TypeError(f"dense_state_dict() takes a module or a state dict, got {type(source).__name__}")
    out: "OrderedDict[str, Tensor]" = OrderedDict()
    for key, value in sd.items():
        if key.endswith("_orig") and key[:-5] + "_mask" in sd:
            base = key[:-5]
            out[base] = reparam.masked(value.detach(), sd[base + "_mask"])  # the one definition, as remove()
        elif key.endswith("_mask") and key[:-5] + "_orig" in sd:
            continue
        else:
            out[key] = value
    return out


def load_state_dict(model: nn.Module, state_dict: Mapping[str, Tensor], strict: bool = True,
                    assign: bool = False) -> Any:
    """Load ``state_dict`` into ``model`` whether either side is pruned or dense.

    * pruned state dict (``x_orig``/``x_mask``) into a dense model: the model's
      ``x`` is pruned with the saved mask (``methods.apply_mask``) and loaded,
      so it comes back in the saved state, ready to keep training;
    * dense state dict (``x``) into a pruned model: ``x`` is loaded into
      ``x_orig`` and the model's mask is kept;
    * same form on both sides: a plain ``load_state_dict``.

    All or nothing: on any failure (a key or shape that does not fit, a value
    torch refuses to copy, ``KeyboardInterrupt``) the model is left exactly as
    it was -- keys are checked before anything is copied, and the values about
    to be overwritten are kept aside (one copy of them, freed on return) so
    that a copy failing half-way is undone. Returns what
    ``nn.Module.load_state_dict`` returns. ``assign=True`` as in torch: the
    state dict's tensors become the model's (no copy), which is how a model
    built on the meta device (``torch.device("meta")``, accelerate's
    ``init_empty_weights()``) is loaded; the saved masks come with them.

    Examples:
        >>> import torch, prunekit
        >>> src = prunekit.l1_unstructured(torch.nn.Linear(4, 2), "weight", amount=3)
        >>> dst = torch.nn.Linear(4, 2)
        >>> _ = prunekit.load_state_dict(dst, src.state_dict())
        >>> prunekit.is_pruned(dst), torch.equal(dst.weight, src.weight)
        (True, True)
    """
    if not is_module(model):
        raise TypeError(f"load_state_dict() needs an nn.Module, got {type(model).__name__}")
    sd: Dict[str, Tensor] = dict(state_dict)
    modules = dict(model.named_modules())
    snapshots = []
    saved: List[Tuple[Tensor, Tensor]] = []
    # assign=True swaps tensor objects: keep every module's tensor dicts (references only) to put back
    held = [(m, dict(m._parameters), dict(m._buffers)) for m in modules.values()] if assign else []
    try:
        for key in list(sd):
            if not (key.endswith("_orig") and key[:-5] + "_mask" in sd):
                continue
            prefix, _, name = key[:-5].rpartition(".")
            module = modules.get(prefix)
            if module is None or name in reparam.pruned_names(module):
                continue
            if name in module._parameters:
                snapshots.append(Snapshot(module))
                mask = sd[key[:-5] + "_mask"]
                methods.apply_mask(module, name, mask, mask_dtype=mask.dtype)
        for qual, module in modules.items():
            for name in reparam.pruned_names(module):
                full = f"{qual}.{name}" if qual else name
                if full in sd and full + "_orig" not in sd:
                    sd[full + "_orig"] = sd.pop(full)
                    sd.setdefault(full + "_mask", module._buffers[name + "_mask"])
        _check_fits(model, sd, strict)
        target = model.state_dict(keep_vars=True)
        if not assign:
            with (backend_of(model) or TORCH).no_grad():
                saved = [(target[k], target[k].detach().clone()) for k in sd if k in target and is_tensor(target[k])]
            return model.load_state_dict(sd, strict=strict)
        return model.load_state_dict(sd, strict=strict, assign=True)
    except BaseException:
        with (backend_of(model) or TORCH).no_grad():
            for t, value in saved:
                t.copy_(value)
        for m, params, buffers in held:
            m._parameters.clear()
            m._parameters.update(params)
            m._buffers.clear()
            m._buffers.update(buffers)
        for snap in reversed(snapshots):
            snap.restore()
        raise


def _check_fits(model: nn.Module, sd: Mapping[str, Tensor], strict: bool) -> None:
    # torch copies the matching tensors before it reports a mismatch; check first so nothing changes
    target = model.state_dict()
    missing = [k for k in target if k not in sd] if strict else []
    unexpected = [k for k in sd if k not in target] if strict else []
    shapes = [f"{k}: checkpoint {tuple(sd[k].shape)} vs model {tuple(target[k].shape)}"
              for k in sd if k in target and is_tensor(sd[k]) and sd[k].shape != target[k].shape]
    if missing or unexpected or shapes:
        parts = []
        if missing:
            parts.append(f"Missing key(s) in state_dict: {missing}")
        if unexpected:
            parts.append(f"Unexpected key(s) in state_dict: {unexpected}")
        if shapes:
            parts.append(f"Size mismatch: {shapes}")
        raise StateDictMismatchError(
            "prunekit.load_state_dict: the checkpoint does not fit the model (keys are compared after translating "
            "x <-> x_orig/x_mask). " + "; ".join(parts) + ". Nothing was loaded; pass strict=False to load the "
            "keys that match"
        )
