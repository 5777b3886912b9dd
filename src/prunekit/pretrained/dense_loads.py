"""Loading dense weights into a pruned model: a Trainer resuming from a checkpoint folder.

The folder holds effective weights under plain names (``x``); the model it
resumes already carries masks (``x_orig``/``x_mask``). :func:`accept_dense_weights`
lets ``load_state_dict`` take each dense ``x`` into ``x_orig``, the mask kept.
"""

from __future__ import annotations

import weakref
from typing import Any, List, MutableMapping

from torch import nn

from .. import reparam

__all__ = ["accept_dense_weights", "dense_weights_loaded", "stop_accepting_dense_weights"]


class _DenseLoads:
    """A load_state_dict pre-hook on a model: dense ``x`` in a state dict loads into a masked ``x_orig``."""

    def __init__(self, model: nn.Module) -> None:
        self.handle = model.register_load_state_dict_pre_hook(self)
        self.translated: List[str] = []

    def __call__(self, module: nn.Module, state_dict: MutableMapping[str, Any], prefix: str, *args: Any) -> None:
        translated = []
        for qual, sub, name in list(reparam.iter_masked(module)):
            key = f"{prefix}{qual}.{name}" if qual else f"{prefix}{name}"
            if key in state_dict and key + "_orig" not in state_dict:
                state_dict[key + "_orig"] = state_dict.pop(key)
                state_dict.setdefault(key + "_mask", sub._buffers[name + "_mask"])
                translated.append(key)
        self.translated = translated


_DENSE_LOADS: "weakref.WeakKeyDictionary[nn.Module, _DenseLoads]" = weakref.WeakKeyDictionary()


def accept_dense_weights(model: nn.Module) -> None:
    """Let ``model.load_state_dict`` take the dense ``x`` of a masked tensor into ``x_orig`` (mask kept).

    What a ``Trainer`` resuming from a checkpoint folder needs: it loads
    ``model.safetensors`` (effective weights under plain names) with
    ``model.load_state_dict(..., strict=False)`` into a model that already
    carries masks; the masks come from :data:`~prunekit.pretrained.MASKS_FILE` afterwards.
    Idempotent; :func:`stop_accepting_dense_weights` removes it.
    """
    if model not in _DENSE_LOADS:
        _DENSE_LOADS[model] = _DenseLoads(model)


def dense_weights_loaded(model: nn.Module) -> List[str]:
    """The masked tensors whose dense ``x`` the latest ``model.load_state_dict`` took (see
    :func:`accept_dense_weights`): their masks did not come with them."""
    hook = _DENSE_LOADS.get(model)
    return list(hook.translated) if hook is not None else []


def stop_accepting_dense_weights(model: nn.Module) -> None:
    """Undo :func:`accept_dense_weights` (no-op when not accepting)."""
    hook = _DENSE_LOADS.pop(model, None)
    if hook is not None:
        hook.handle.remove()
