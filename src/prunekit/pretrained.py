"""Hugging Face model folders of pruned models: plain weights, masks beside them.

A pruned module holds ``weight_orig`` and ``weight_mask`` where a dense one
holds ``weight`` (torch's layout, kept by ``state_dict()``). A folder written
with those names is one that plain ``transformers`` cannot read: its
``from_pretrained`` finds no ``weight`` and initialises it at random. So once
prunekit has pruned a module, ``PreTrainedModel.save_pretrained`` (and so
``Trainer.save_model`` and every ``Trainer`` checkpoint) writes:

* ``model.safetensors`` (or its shards) with the *effective* weights under the
  plain names -- ``weight = weight_orig * weight_mask``, pruned entries zero --
  which plain ``from_pretrained`` loads as the pruned model, sparsity and all;
* :data:`MASKS_FILE` (``prunekit_masks.safetensors``) beside it: each mask as
  a packed bitmask, with its shape, dtype and the number of zeros of the
  weight it belongs to, so :func:`load_pretrained` / :func:`restore_masks`
  put the masks back and pruning (or training) continues where it stopped.

How: ``save_pretrained`` takes the state dict to write as its
``state_dict=`` argument; prunekit wraps ``PreTrainedModel.save_pretrained``
(once, when a module is first pruned while ``transformers`` is loaded) so that
for a model with masks it passes the effective state dict there and writes the
masks file; a model without masks is saved exactly as before (a stale masks
file from an earlier save is removed). ``module.state_dict()`` itself is not
changed. :func:`save_pretrained` is the same thing as a plain function.

What is not kept: the values ``weight_orig`` holds *under* the mask (the
entries the mask zeroes), as :func:`prunekit.remove` drops them; a restored
model has zeros there (training pruners and one-shot pruning keep zeros
there anyway). Masks with values other than 0 and 1 (scaling masks) are
stored whole, with their ``weight_orig``, and restored exactly.

Examples:
    >>> import tempfile, torch, transformers, prunekit
    >>> cfg = transformers.BertConfig(vocab_size=32, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
    ...                               intermediate_size=16, max_position_embeddings=8)
    >>> model = transformers.BertModel(cfg)
    >>> query = model.encoder.layer[0].attention.self.query
    >>> _ = prunekit.l1_unstructured(query, "weight", 32)
    >>> folder = tempfile.mkdtemp()
    >>> model.save_pretrained(folder)
    >>> plain = transformers.BertModel.from_pretrained(folder)          # plain transformers: pruned weights
    >>> torch.equal(plain.encoder.layer[0].attention.self.query.weight, query.weight)
    True
    >>> again = prunekit.load_pretrained(folder, transformers.BertModel)  # masks back
    >>> prunekit.is_pruned(again), int((again.encoder.layer[0].attention.self.query.weight_mask == 0).sum())
    (True, 32)
"""

from __future__ import annotations

import functools
import inspect
import json
import logging
import math
import os
import secrets
import sys
import weakref
from collections import OrderedDict
from typing import Any, Callable, Dict, List, Mapping, MutableMapping, Optional, Tuple

import torch
from torch import Tensor, nn

from . import methods, reparam
from .reparam._internal import Snapshot, drop_cache
from ._backend import is_module

__all__ = [
    "MASKS_FILE",
    "SavedMask",
    "accept_dense_weights",
    "apply_saved",
    "check_weights",
    "dense_weights_loaded",
    "install_save_hooks",
    "load_pretrained",
    "read_masks",
    "restore_masks",
    "save_pretrained",
    "split_state_dict",
    "stop_accepting_dense_weights",
]

logger = logging.getLogger(__name__)

#: the file, inside a Hugging Face model folder, that holds the masks of the weights beside it
MASKS_FILE = "prunekit_masks.safetensors"
_FORMAT = "prunekit-masks"
_VERSION = "1"
_BITS = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)
_SHIFTS = torch.arange(8, dtype=torch.uint8)
_MASK_DTYPES = {str(d).split(".")[1]: d for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64,
                                                  torch.bool, torch.uint8, torch.int8, torch.int32, torch.int64)}


# ----------------------------------------------------------------------------- the state dict to write
def _is_binary(mask: Tensor) -> bool:
    return mask.dtype == torch.bool or bool(((mask == 0) | (mask == 1)).all())


def split_state_dict(state_dict: Mapping[str, Any]) -> Tuple["OrderedDict[str, Any]", Dict[str, Tensor],
                                                                Dict[str, Tensor]]:
    """``(dense, masks, origs)``: the state dict with every ``x_orig``/``x_mask`` pair replaced by ``x``.

    ``dense[x]`` is the effective value (``x_orig`` itself when the mask is binary and
    ``x_orig`` is already zero wherever the mask is -- no copy -- otherwise
    ``x_orig * x_mask``, a new tensor); ``masks[x]`` is the mask, and ``origs[x]`` is
    ``x_orig`` for masks with values other than 0 and 1 (their effective value does not give it back).
    Keys keep their order.

    Examples:
        >>> import torch, prunekit
        >>> m = prunekit.l1_unstructured(torch.nn.Linear(3, 2), "weight", 2)
        >>> dense, masks, origs = split_state_dict(m.state_dict())
        >>> list(dense), list(masks), origs, int((dense["weight"] == 0).sum())
        (['bias', 'weight'], ['weight'], {}, 2)
    """
    dense: "OrderedDict[str, Any]" = OrderedDict()
    masks: Dict[str, Tensor] = {}
    origs: Dict[str, Tensor] = {}
    for key, value in state_dict.items():
        if key.endswith("_mask") and key[:-5] + "_orig" in state_dict:
            continue
        if not (key.endswith("_orig") and key[:-5] + "_mask" in state_dict):
            dense[key] = value
            continue
        path = key[:-5]
        mask = state_dict[path + "_mask"]
        if not isinstance(value, Tensor) or not isinstance(mask, Tensor):
            raise TypeError(f"{path}: the state dict holds a {type(value).__name__} and a {type(mask).__name__} "
                            "for its _orig/_mask pair, not tensors")
        if value.device.type == "meta" or mask.device.type == "meta":
            raise ValueError(f"{path}: the pruned tensor is on the meta device (offloaded), so its effective "
                             "value cannot be computed; load it, or call prunekit.remove_all(model) before saving")
        with torch.no_grad():
            orig = value.detach()
            if mask.shape != orig.shape:
                raise ValueError(f"{path}: mask of shape {tuple(mask.shape)} for a tensor of shape "
                                 f"{tuple(orig.shape)}")
            binary = _is_binary(mask)
            keep = mask if mask.dtype == torch.bool else mask != 0
            clean = binary and not bool((orig.ne(0) & ~keep).any())  # bool temporaries, no value copy
            dense[path] = orig if clean else reparam.masked(orig, mask)
        masks[path] = mask.detach()
        if not binary:
            origs[path] = orig
    return dense, masks, origs


# ----------------------------------------------------------------------------- the masks file
def _pack(keep: Tensor) -> Tensor:
    """One bit per entry (1 = kept), little-endian within each byte, padded with zeros."""
    flat = keep.reshape(-1).to(torch.uint8)
    pad = (-flat.numel()) % 8
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    return (flat.view(-1, 8) * _BITS.to(flat.device)).sum(dim=1, dtype=torch.uint8).cpu()


def _unpack(packed: Tensor, numel: int) -> Tuple[Tensor, bool]:
    bits = packed.reshape(-1, 1).bitwise_right_shift(_SHIFTS).bitwise_and_(1).reshape(-1)
    return bits[:numel].bool(), not bool(bits[numel:].any())


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).split(".")[1]


def _masks_file_contents(dense: Mapping[str, Any], masks: Mapping[str, Tensor],
                         origs: Mapping[str, Tensor]) -> Tuple[Dict[str, Tensor], Dict[str, str]]:
    tensors: Dict[str, Tensor] = {}
    entries: Dict[str, Any] = {}
    with torch.no_grad():
        for path, mask in masks.items():
            value = dense[path]
            entry = {"shape": list(mask.shape), "dtype": _dtype_name(mask.dtype), "packed": path not in origs,
                     "weight_dtype": _dtype_name(value.dtype), "weight_zeros": int(value.numel() - value.count_nonzero())}
            if path in origs:
                tensors[path + "_mask"] = mask.detach().contiguous().cpu()
                tensors[path + "_orig"] = origs[path].detach().contiguous().cpu()
            else:
                tensors[path + "_mask"] = _pack(mask if mask.dtype == torch.bool else mask != 0)
            entries[path] = entry
    metadata = {"format": _FORMAT, "version": _VERSION, "masks": json.dumps(entries, sort_keys=True)}
    return tensors, metadata


class SavedMask:
    """One validated entry of a masks file: the tensor it belongs to and the mask to put there."""

    __slots__ = ("path", "module", "name", "mask", "orig", "weight_dtype", "weight_zeros")

    def __init__(self, path: str, module: nn.Module, name: str, mask: Tensor, orig: Optional[Tensor],
                 weight_dtype: str, weight_zeros: int) -> None:
        self.path = path
        self.module = module
        self.name = name
        self.mask = mask
        self.orig = orig
        self.weight_dtype = weight_dtype
        self.weight_zeros = weight_zeros


def _bad(path: str, detail: str) -> ValueError:
    from .io.errors import UnreadableFileError

    return UnreadableFileError(f"{path}: {detail}")


def _int(value: Any) -> bool:
    return type(value) is int


def read_masks(folder: Any, model: nn.Module) -> List[SavedMask]:
    """Read and check ``folder``'s :data:`MASKS_FILE` against ``model`` (nothing is changed).

    The file is read as hostile input (:mod:`prunekit.io.reader`): a regular
    file, a valid safetensors header, the format and version prunekit writes,
    one entry per mask naming a parameter of ``model`` of the recorded shape,
    bitmasks of the right length with zero padding, finite values. Every
    problem is a ``ValueError`` naming the file and the entry. Returns the
    masks in the file's order, on the devices of their tensors.

    Examples:
        >>> import tempfile, torch, transformers, prunekit
        >>> cfg = transformers.BertConfig(vocab_size=32, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
        ...                               intermediate_size=16, max_position_embeddings=8)
        >>> model = transformers.BertModel(cfg)
        >>> _ = prunekit.l1_unstructured(model.pooler.dense, "weight", 10)
        >>> folder = tempfile.mkdtemp(); model.save_pretrained(folder)
        >>> [(m.path, int((m.mask == 0).sum())) for m in read_masks(folder, model)]
        [('pooler.dense.weight', 10)]
    """
    from .io.reader import open_regular, read_safetensors_header, read_safetensors_tensor

    path = os.path.join(os.fspath(folder), MASKS_FILE)
    with open_regular(path, what="masks file") as f:
        header = read_safetensors_header(f, path)
        meta = header.metadata
        if meta.get("format") != _FORMAT:
            raise _bad(path, f"format {meta.get('format')!r} is not {_FORMAT!r}: not a prunekit masks file")
        if meta.get("version") != _VERSION:
            raise _bad(path, f"version {meta.get('version')!r} is not supported (this prunekit reads {_VERSION!r}); "
                             "upgrade prunekit")
        from .io.reader import loads_json_strict

        entries = loads_json_strict(meta.get("masks", ""), f"{path}: metadata 'masks'", max_depth=4)
        if not isinstance(entries, dict):
            raise _bad(path, "metadata 'masks' is not a JSON object")
        expected = set()
        out: List[SavedMask] = []
        for key, entry in entries.items():
            where = f"entry {key!r}"
            if not isinstance(entry, dict) or set(entry) != {"shape", "dtype", "packed", "weight_dtype",
                                                              "weight_zeros"}:
                raise _bad(path, f"{where}: must hold exactly shape, dtype, packed, weight_dtype, weight_zeros")
            shape, dtype, packed = entry["shape"], entry["dtype"], entry["packed"]
            if not isinstance(shape, list) or not all(_int(s) and s >= 0 for s in shape) or len(shape) > 64:
                raise _bad(path, f"{where}: bad shape {shape!r}")
            if dtype not in _MASK_DTYPES or type(packed) is not bool:
                raise _bad(path, f"{where}: bad dtype {dtype!r} or packed {packed!r}")
            if entry["weight_dtype"] not in _MASK_DTYPES or not _int(entry["weight_zeros"]) or not (
                    0 <= entry["weight_zeros"] <= math.prod(shape)):
                raise _bad(path, f"{where}: bad weight_dtype {entry['weight_dtype']!r} or weight_zeros "
                                 f"{entry['weight_zeros']!r}")
            try:
                module, name = reparam.owner_of(model, key)
            except AttributeError:
                module, name = None, ""
            current = reparam.stored(module, name) if module is not None else None
            if not isinstance(current, Tensor) or not (name in module._parameters or reparam.is_masked(module, name)):
                raise _bad(path, f"{where}: {type(model).__name__} has no parameter {key!r}; the masks file "
                                 "belongs to another model")
            if list(current.shape) != shape:
                raise _bad(path, f"{where}: mask of shape {shape} for the model's tensor of shape "
                                 f"{list(current.shape)}")
            numel = math.prod(shape)
            want = {key + "_mask": ("U8", [(numel + 7) // 8])} if packed else {key + "_mask": (None, shape),
                                                                               key + "_orig": (None, shape)}
            for tkey, (tag, tshape) in want.items():
                info = header.tensors.get(tkey)
                if info is None:
                    raise _bad(path, f"{where}: tensor {tkey!r} is missing")
                if (tag is not None and info[0] != tag) or info[1] != tshape:
                    raise _bad(path, f"{where}: tensor {tkey!r} is {info[0]} {info[1]}, expected "
                                     f"{tag or 'a tensor'} {tshape}")
                expected.add(tkey)
            orig = None
            if packed:
                keep, clean = _unpack(read_safetensors_tensor(f, header, key + "_mask"), numel)
                if not clean:
                    raise _bad(path, f"{where}: the bitmask's padding bits are not zero (damaged file)")
                mask = keep.reshape(shape).to(_MASK_DTYPES[dtype])
            else:
                mask = read_safetensors_tensor(f, header, key + "_mask").clone()
                orig = read_safetensors_tensor(f, header, key + "_orig").clone()
                if _dtype_name(mask.dtype) != dtype:
                    raise _bad(path, f"{where}: mask stored as {mask.dtype}, recorded as {dtype}")
                for label, t in (("mask", mask), ("weight_orig", orig)):
                    if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                        raise _bad(path, f"{where}: the {label} holds non-finite values")
                if orig.dtype != current.dtype:
                    raise _bad(path, f"{where}: weight_orig stored as {orig.dtype}, the model's tensor is "
                                     f"{current.dtype}")
                orig = orig.to(current.device)
            out.append(SavedMask(key, module, name, mask.to(current.device), orig, entry["weight_dtype"],
                                 entry["weight_zeros"]))
        extra = sorted(set(header.tensors) - expected)
        if extra:
            raise _bad(path, f"tensors {extra[:5]} are not described by its metadata (damaged file)")
    return out


def check_weights(saved: List[SavedMask], source: str) -> None:
    """``ValueError`` unless each weight as loaded is zero wherever its saved mask is (the masks belong to it).

    The weight as loaded is ``weight`` of a dense model, ``weight_orig`` of a masked one (where a dense
    ``weight`` loads, see :func:`accept_dense_weights`). Also compares its number of zeros with the one
    recorded at save time when it has the saved dtype: masks of an earlier or later checkpoint are refused.
    ``source`` names the masks file in the message.

    Examples:
        >>> import tempfile, torch, transformers, prunekit
        >>> cfg = transformers.BertConfig(vocab_size=32, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
        ...                               intermediate_size=16, max_position_embeddings=8)
        >>> model = transformers.BertModel(cfg)
        >>> _ = prunekit.l1_unstructured(model.pooler.dense, "weight", 10)
        >>> folder = tempfile.mkdtemp(); model.save_pretrained(folder)
        >>> plain = transformers.BertModel.from_pretrained(folder)
        >>> with torch.no_grad():
        ...     _ = plain.pooler.dense.weight.add_(1)  # not the saved weights any more
        >>> try:
        ...     check_weights(read_masks(folder, plain), "masks")
        ... except ValueError as e:
        ...     print(str(e)[:72])
        masks: pooler.dense.weight has 10 non-zero entries where the saved mask
    """
    with torch.no_grad():
        for s in saved:
            if s.orig is not None:
                continue  # a scaling mask: its weight_orig is restored from the file
            w = reparam.stored(s.module, s.name).detach()  # as loaded: a dense load lands in weight_orig
            keep = s.mask if s.mask.dtype == torch.bool else s.mask != 0
            stray = int((w.ne(0) & ~keep).sum())
            if stray:
                raise ValueError(f"{source}: {s.path} has {stray} non-zero entries where the saved mask prunes it: "
                                 "the weights are not the ones the masks were saved with (the folder was saved "
                                 "again without prunekit, or the masks file was copied from another folder)")
            zeros = int(w.numel() - w.count_nonzero())
            if _dtype_name(w.dtype) == s.weight_dtype and zeros != s.weight_zeros:
                raise ValueError(f"{source}: {s.path} has {zeros} zeros, the masks file recorded {s.weight_zeros}: "
                                 "the weights are not the ones the masks were saved with")


def restore_masks(model: nn.Module, folder: Any) -> int:
    """Put the masks of ``folder``'s :data:`MASKS_FILE` back on ``model`` (loaded from that folder); return how many.

    ``model`` is what plain ``from_pretrained(folder)`` returned (its weights are the
    effective weights). Each saved mask is applied as ``prunekit.custom_from_mask``
    would (a tensor already masked gets the saved mask in place of its own, in place).
    Before anything changes the file is checked (:func:`read_masks`) and so is every
    weight: zero wherever its mask is, with the zero count recorded at save time -- so
    a masks file that does not belong to these weights is refused. All or nothing.
    A folder without a masks file restores nothing (returns 0).

    Examples:
        >>> import tempfile, torch, transformers, prunekit
        >>> cfg = transformers.BertConfig(vocab_size=32, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
        ...                               intermediate_size=16, max_position_embeddings=8)
        >>> model = transformers.BertModel(cfg)
        >>> _ = prunekit.ln_structured(model.pooler.dense, "weight", 2, n=2, dim=0)
        >>> folder = tempfile.mkdtemp(); model.save_pretrained(folder)
        >>> plain = transformers.BertModel.from_pretrained(folder)
        >>> prunekit.restore_masks(plain, folder), torch.equal(plain.pooler.dense.weight_mask,
        ...                                                    model.pooler.dense.weight_mask)
        (1, True)
    """
    if not is_module(model):
        raise TypeError(f"restore_masks() needs the nn.Module loaded from the folder, got {type(model).__name__}")
    if not os.path.lexists(os.path.join(os.fspath(folder), MASKS_FILE)):
        return 0
    saved = read_masks(folder, model)
    check_weights(saved, os.path.join(os.fspath(folder), MASKS_FILE))
    apply_saved(saved)
    return len(saved)


def apply_saved(saved: List[SavedMask]) -> None:
    """Install checked masks (from :func:`read_masks`), all or nothing: what :func:`restore_masks` does last.

    Examples:
        >>> import tempfile, transformers, prunekit
        >>> cfg = transformers.BertConfig(vocab_size=32, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
        ...                               intermediate_size=16, max_position_embeddings=8)
        >>> model = transformers.BertModel(cfg)
        >>> _ = prunekit.l1_unstructured(model.pooler.dense, "weight", 10)
        >>> folder = tempfile.mkdtemp(); model.save_pretrained(folder)
        >>> plain = transformers.BertModel.from_pretrained(folder)
        >>> apply_saved(read_masks(folder, plain)); prunekit.is_pruned(plain)
        True
    """
    undo: List[Callable[[], None]] = []
    try:
        for s in saved:
            with torch.no_grad():
                if reparam.is_masked(s.module, s.name):
                    buf = reparam.get_mask(s.module, s.name)
                    old = buf.clone()
                    undo.append(lambda buf=buf, old=old: buf.copy_(old))
                    buf.copy_(s.mask.to(buf.dtype))
                    drop_cache(s.module, s.name)
                else:
                    undo.append(Snapshot(s.module).restore)
                    methods.apply_mask(s.module, s.name, s.mask, mask_dtype=s.mask.dtype)
                if s.orig is not None:
                    target = reparam.stored(s.module, s.name)
                    old_orig = target.detach().clone()
                    undo.append(lambda target=target, old=old_orig: target.detach().copy_(old))
                    target.detach().copy_(s.orig)
                    drop_cache(s.module, s.name)
    except BaseException:
        with torch.no_grad():
            for fn in reversed(undo):
                fn()
        raise


# ----------------------------------------------------------------------------- saving
def _masks_path(folder: str) -> str:
    return os.path.join(folder, MASKS_FILE)


def _has_masks(model: nn.Module) -> bool:
    return next(iter(reparam.iter_masked(model)), None) is not None


def _write_masks_file(folder: str, tensors: Dict[str, Tensor], metadata: Dict[str, str]) -> None:
    from safetensors.torch import save_file

    from .io.writer import atomic_path

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
    if not masks:
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


def _original_save(cls: type) -> Callable[..., Any]:
    fn = cls.save_pretrained
    return getattr(fn, "_prunekit_original", fn)


_patched = False


def install_save_hooks() -> bool:
    """Make ``transformers.PreTrainedModel.save_pretrained`` write pruned models as this module says.

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
    the module docstring); as a function it also works before that.
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

    from .io.reader import read_json

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


# ----------------------------------------------------------------------------- loading into a pruned model
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
    carries masks; the masks come from :data:`MASKS_FILE` afterwards.
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
