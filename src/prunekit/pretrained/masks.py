"""The masks file of a Hugging Face model folder: what is written, and the hostile-input reader of it.

:func:`split_state_dict` turns a pruned state dict into its effective weights
plus masks; :data:`MASKS_FILE` holds each mask as a packed bitmask (or, for a
mask with values other than 0 and 1, the mask and its ``weight_orig`` whole)
with its shape, dtype and the number of zeros of its weight.
:func:`read_masks` reads and checks the file against a model,
:func:`check_weights` checks the loaded weights against it, and
:func:`restore_masks` / :func:`apply_saved` put the masks back.
"""

from __future__ import annotations

import json
import math
import os
from collections import OrderedDict
from functools import partial
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

import torch
from torch import Tensor, nn

from .. import methods, reparam
from .._backend import is_module
from ..reparam._internal import Snapshot, drop_cache, orig_and_mask

__all__ = ["MASKS_FILE", "SavedMask", "apply_saved", "check_weights", "read_masks", "restore_masks",
           "split_state_dict"]

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


def _held(s: SavedMask) -> Tensor:
    """The model's stored tensor for ``s`` (``name_orig`` once masked), which :func:`read_masks` found."""
    t = reparam.stored(s.module, s.name)
    if t is None:
        raise ValueError(f"masks: the model no longer has the tensor {s.path!r}; read the masks again")
    return t


def _bad(path: str, detail: str) -> ValueError:
    from ..io.errors import UnreadableFileError

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
    from ..io.reader import open_regular, read_safetensors_header, read_safetensors_tensor

    path = os.path.join(os.fspath(folder), MASKS_FILE)
    with open_regular(path, what="masks file") as f:
        header = read_safetensors_header(f, path)
        meta = header.metadata
        if meta.get("format") != _FORMAT:
            raise _bad(path, f"format {meta.get('format')!r} is not {_FORMAT!r}: not a prunekit masks file")
        if meta.get("version") != _VERSION:
            raise _bad(path, f"version {meta.get('version')!r} is not supported (this prunekit reads {_VERSION!r}); "
                             "upgrade prunekit")
        from ..io.reader import loads_json_strict

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
            if (module is None or not isinstance(current, Tensor)
                    or not (name in module._parameters or reparam.is_masked(module, name))):
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
    ``weight`` loads, see :func:`prunekit.pretrained.accept_dense_weights`). Also compares its number of zeros with the one
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
            w = _held(s).detach()  # as loaded: a dense load lands in weight_orig
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
    undo: List[Callable[[], object]] = []
    try:
        for s in saved:
            with torch.no_grad():
                if reparam.is_masked(s.module, s.name):
                    buf = orig_and_mask(s.module, s.name)[1]
                    undo.append(partial(buf.copy_, buf.clone()))
                    buf.copy_(s.mask.to(buf.dtype))
                    drop_cache(s.module, s.name)
                else:
                    undo.append(Snapshot(s.module).restore)
                    methods.apply_mask(s.module, s.name, s.mask, mask_dtype=s.mask.dtype)
                if s.orig is not None:
                    target = _held(s).detach()
                    undo.append(partial(target.copy_, target.clone()))
                    target.detach().copy_(s.orig)
                    drop_cache(s.module, s.name)
    except BaseException:
        with torch.no_grad():
            for fn in reversed(undo):
                fn()
        raise
