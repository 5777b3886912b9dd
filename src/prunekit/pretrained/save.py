"""Saving pruned Hugging Face models: effective weights under plain names, the masks file beside them.

:func:`install_save_hooks` wraps ``PreTrainedModel.save_pretrained`` (prunekit
calls it the first time a module is pruned while ``transformers`` is loaded)
so that a model with masks is saved with its effective state dict and
:data:`~prunekit.pretrained.MASKS_FILE`; :func:`save_pretrained` does the same
as a function and :func:`load_pretrained` loads a folder with its masks.
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
import secrets
import sys
from typing import Any, Callable, Dict, Optional, Tuple, Type

from torch import Tensor, nn

from .. import reparam
from .masks import MASKS_FILE, _masks_file_contents, restore_masks, split_state_dict

__all__ = ["install_save_hooks", "load_pretrained", "save_pretrained"]

logger = logging.getLogger(__name__)


def _masks_path(folder: str) -> str:
    return os.path.join(folder, MASKS_FILE)


def _has_masks(model: nn.Module) -> bool:
    return next(iter(reparam.iter_masked(model)), None) is not None


def _write_masks_file(folder: str, tensors: Dict[str, Tensor], metadata: Dict[str, str]) -> None:
    from safetensors.torch import save_file

    from ..io.writer import atomic_path

    with atomic_path(_masks_path(folder)) as tmp:
        save_file(tensors, tmp, metadata=metadata)


def _set_aside(folder: str) -> Optional[str]:
    """Move an existing masks file to a temporary name (put back by :func:`_put_back` on failure)."""
    target = _masks_path(folder)
    if not os.path.lexists(target):
        return None
    aside = os.path.join(folder, f".{MASKS_FILE}.{secrets.token_hex(4)}.prunekit-tmp")
    os.replace(target, aside)
    return aside


def _put_back(folder: str, aside: Optional[str], wrote: bool) -> None:
    target = _masks_path(folder)
    if wrote and os.path.lexists(target):
        os.remove(target)
    if aside is not None:
        os.replace(aside, target)


def _save_with(original: Callable[..., Any], model: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    """Run transformers' ``save_pretrained`` with the effective state dict, and write the masks file."""
    bound = inspect.signature(original).bind(model, *args, **kwargs)
    folder = os.fspath(bound.arguments["save_directory"])
    given = bound.arguments.get("state_dict")
    sd = given if given is not None else (model.state_dict() if _has_masks(model) else None)
    dense = masks = origs = None
    if sd is not None:
        dense, masks, origs = split_state_dict(sd)
    if not masks or dense is None or origs is None:  # masks come with dense and origs
        if given is not None:
            bound.arguments["state_dict"] = dense
        aside = None
        is_main = bool(bound.arguments.get("is_main_process", True))
        if is_main and os.path.isdir(folder) and os.path.lexists(_masks_path(folder)):
            aside = _set_aside(folder)  # a stale masks file would be applied to these new weights
        try:
            result = original(*bound.args, **bound.kwargs)
        except BaseException:
            if aside is not None:
                _put_back(folder, aside, wrote=False)
            raise
        if aside is not None:
            os.remove(aside)
            logger.info("%s: removed the masks file of an earlier save (the model saved now has no masks)", folder)
        return result
    bound.arguments["state_dict"] = dense
    if getattr(model, "_hf_peft_config_loaded", False):
        # transformers' own adapter saving: only the adapters' weights go in the folder, effective ones
        return original(*bound.args, **bound.kwargs)
    is_main = bound.arguments.get("is_main_process", True)
    should = getattr(model, "should_save_on_this_rank", None)
    write = bool(should(is_main)) if callable(should) else bool(is_main)
    if not write or os.path.isfile(folder):
        return original(*bound.args, **bound.kwargs)
    tensors, metadata = _masks_file_contents(dense, masks, origs)
    os.makedirs(folder, exist_ok=True)
    aside = _set_aside(folder)
    wrote = False
    try:
        # written before the weights: push_to_hub uploads what the folder holds when the weights are written
        _write_masks_file(folder, tensors, metadata)
        wrote = True
        result = original(*bound.args, **bound.kwargs)
    except BaseException:
        _put_back(folder, aside, wrote)
        raise
    if aside is not None:
        os.remove(aside)
    logger.info("%s: effective weights of %d pruned tensors written, their masks in %s", folder, len(masks),
                MASKS_FILE)
    return result


def _original_save(cls: Type[Any]) -> Callable[..., Any]:
    fn = cls.save_pretrained
    return getattr(fn, "_prunekit_original", fn)


_patched = False


def install_save_hooks() -> bool:
    """Make ``transformers.PreTrainedModel.save_pretrained`` write pruned models as :mod:`prunekit.pretrained` says.

    Called by prunekit itself the first time a module is pruned while
    ``transformers`` is loaded (and by :func:`save_pretrained`); idempotent.
    Returns whether the hook is in place (``False`` while ``transformers`` is not imported).
    """
    global _patched
    if _patched:
        return True
    mu = sys.modules.get("transformers.modeling_utils")
    cls = getattr(mu, "PreTrainedModel", None) if mu is not None else None
    if cls is None:
        return False
    current = cls.__dict__.get("save_pretrained")
    if current is None:  # pragma: no cover - every transformers release defines it there
        return False
    if getattr(current, "_prunekit_original", None) is None:
        original = current

        @functools.wraps(original)
        def save_pretrained(self: Any, *args: Any, **kwargs: Any) -> Any:
            return _save_with(original, self, args, kwargs)

        save_pretrained._prunekit_original = original  # type: ignore[attr-defined]
        cls.save_pretrained = save_pretrained
    _patched = True
    return True


def _on_pruned(module: nn.Module) -> None:
    if _patched or "transformers.modeling_utils" not in sys.modules:
        return
    try:
        install_save_hooks()
    except Exception:  # pragma: no cover - never let a save hook break pruning
        logger.debug("could not wrap PreTrainedModel.save_pretrained", exc_info=True)


reparam.observe_pruned(_on_pruned)


def save_pretrained(model: Any, save_directory: Any, **kwargs: Any) -> None:
    """``model.save_pretrained(save_directory, **kwargs)`` with effective weights and :data:`MASKS_FILE`.

    What ``model.save_pretrained`` does once prunekit has pruned a module (see
    :mod:`prunekit.pretrained`); as a function it also works before that.
    ``model`` is a ``transformers.PreTrainedModel``.

    Examples:
        >>> import os, tempfile, transformers, prunekit
        >>> cfg = transformers.BertConfig(vocab_size=32, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
        ...                               intermediate_size=16, max_position_embeddings=8)
        >>> model = transformers.BertModel(cfg)
        >>> _ = prunekit.l1_unstructured(model.pooler.dense, "weight", 0.5)
        >>> folder = tempfile.mkdtemp()
        >>> prunekit.save_pretrained(model, folder)
        >>> sorted(os.listdir(folder))
        ['config.json', 'model.safetensors', 'prunekit_masks.safetensors']
    """
    if not callable(getattr(type(model), "save_pretrained", None)):
        raise TypeError(f"save_pretrained() needs a transformers PreTrainedModel, got {type(model).__name__}; "
                        "for a plain module use prunekit.save_compressed or prunekit.dense_state_dict")
    install_save_hooks()
    _save_with(_original_save(type(model)), model, (save_directory,), kwargs)


def _model_class(folder: str) -> Any:
    import transformers

    from ..io.reader import read_json

    config_path = os.path.join(folder, "config.json")
    archs = read_json(config_path).get("architectures") if os.path.isfile(config_path) else None
    if isinstance(archs, list) and archs and isinstance(archs[0], str):
        cls = getattr(transformers, archs[0], None)
        if isinstance(cls, type):
            return cls
    return transformers.AutoModel


def load_pretrained(folder: Any, model_class: Any = None, **kwargs: Any) -> nn.Module:
    """``model_class.from_pretrained(folder, **kwargs)`` with the masks of :data:`MASKS_FILE` put back.

    ``model_class`` defaults to the class the folder's ``config.json`` names
    (``architectures``), else ``transformers.AutoModel``. The result is pruned
    as the saved model was (``weight_orig``/``weight_mask``), so training or
    pruning continues; see :func:`restore_masks` for the checks. A folder
    without a masks file loads as ``from_pretrained`` loads it.

    Examples:
        >>> import tempfile, torch, transformers, prunekit
        >>> cfg = transformers.BertConfig(vocab_size=32, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
        ...                               intermediate_size=16, max_position_embeddings=8)
        >>> model = transformers.BertModel(cfg)
        >>> _ = prunekit.l1_unstructured(model.pooler.dense, "weight", 0.5)
        >>> folder = tempfile.mkdtemp(); model.save_pretrained(folder)
        >>> again = prunekit.load_pretrained(folder)
        >>> type(again).__name__, torch.equal(again.pooler.dense.weight_mask, model.pooler.dense.weight_mask)
        ('BertModel', True)
    """
    folder = os.fspath(folder)
    cls = _model_class(folder) if model_class is None else model_class
    model = cls.from_pretrained(folder, **kwargs)
    restore_masks(model, folder)
    return model
