"""Writing prunekit's compressed checkpoints: a whole state dict at once, or streamed tensor by tensor.

:func:`write_compressed` encodes every tensor of a model or state dict with
:mod:`.codec` and writes one safetensors file through prunekit's atomic writer
(:mod:`prunekit.io.writer`). :class:`CompressedWriter` writes the same file
one tensor at a time, spooling the stored bytes to unnamed files, for writers
that never hold the whole model (``prunekit.distributed.save_compressed``).

Writing needs the ``safetensors`` package (``pip install prunekit[io]``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
from collections import OrderedDict
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple, Union

import torch

from ... import _sharded, reparam
from ..._backend import require_torch
from ..layers import tied_aliases, tied_keys_of
from ..writer import PathLike, atomic_path, atomic_write, unnamed_file
from .codec import _RESERVED, _TAG_OF, _TAGS, _encode, _key_bytes, _metadata

__all__ = ["CompressedWriter", "drop_masked", "write_compressed"]

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------- #
# safetensors access (optional dependency, for writing)
# --------------------------------------------------------------------------- #
def _safetensors_torch() -> Any:
    try:
        import safetensors.torch as st
    except ImportError as exc:  # pragma: no cover - exercised only without the extra
        raise ImportError(
            "writing prunekit's compressed checkpoints needs the 'safetensors' package; "
            "install it with `pip install prunekit[io]` (or `pip install safetensors`)."
        ) from exc
    return st


def _safetensors_dtypes() -> frozenset:
    st = _safetensors_torch()
    table = getattr(st, "_TYPES", None)
    known = frozenset(table.values()) if isinstance(table, dict) and table else frozenset(_TAGS.values())
    return known & frozenset(_TAG_OF)  # dtypes both sides know


def _state_dict_of(obj: Any) -> "OrderedDict[str, torch.Tensor]":
    state_dict = getattr(obj, "state_dict", None)
    if callable(state_dict) and not isinstance(obj, Mapping):
        items = state_dict().items()
    elif isinstance(obj, Mapping):
        items = obj.items()
    else:
        raise TypeError(
            f"save_compressed: expected an nn.Module or a state dict (a mapping of names to tensors), "
            f"got {type(obj).__name__}. Pass `model` or `model.state_dict()`."
        )
    out: "OrderedDict[str, torch.Tensor]" = OrderedDict()
    for key, value in items:
        _check_entry(key, value)
        out[key] = value
    return out


def _check_entry(key: Any, value: Any) -> None:
    """Refuse a state dict entry the format cannot store: a key that is not a str or ends with a reserved
    suffix, a value that is not a tensor."""
    if not isinstance(key, str):
        raise TypeError(f"save_compressed: state dict keys must be str, got {key!r} ({type(key).__name__})")
    if not isinstance(value, torch.Tensor):
        raise TypeError(
            f"save_compressed: state dict entry {key!r} is a {type(value).__name__}, not a tensor; "
            "only tensors can be stored (drop or convert that entry first)."
        )
    if key.endswith(_RESERVED):
        raise ValueError(
            f"save_compressed: state dict key {key!r} ends with a suffix prunekit reserves "
            f"{_RESERVED}; rename that entry before saving."
        )


def drop_masked(sd: Mapping[str, torch.Tensor],
                apply: Optional[Callable[[str, torch.Tensor, torch.Tensor], Optional[torch.Tensor]]] = None
                ) -> "OrderedDict[str, torch.Tensor]":
    """``sd`` with every ``X_orig`` zeroed wherever its ``X_mask`` is zero (the effective weight is unchanged).

    ``apply(key, value, mask)`` applies one mask (default :func:`prunekit.reparam.masked` with the mask's
    zeros only, so kept values stay exact); :mod:`prunekit.distributed` passes its shard-local form.

    Examples:
        >>> import torch
        >>> sd = {"w_orig": torch.tensor([1.0, -2.0]), "w_mask": torch.tensor([0.0, 1.0])}
        >>> drop_masked(sd)["w_orig"].tolist()
        [0.0, -2.0]
    """
    apply = apply or (lambda _key, value, mask: reparam.masked(value.detach(), mask != 0))
    out = OrderedDict(sd)
    for key, value in sd.items():
        if not key.endswith("_orig"):
            continue
        mask = sd.get(key[: -len("_orig")] + "_mask")
        if mask is None or tuple(mask.shape) != tuple(value.shape):
            continue
        masked = apply(key, value, mask)
        if masked is not None:
            out[key] = masked
    return out


def write_compressed(
    model_or_state_dict: Any,
    path: PathLike,
    *,
    drop_masked_values: bool = False,
    keep_zero_sign: bool = True,
    key: Union[bytes, str, None] = None,
) -> None:
    """Save a (pruned) model or state dict as a prunekit compressed safetensors file.

    The writer of the ``"prunekit-compressed"`` entry of the table of encodings;
    :func:`prunekit.save_compressed` calls it for the default format.

    Sparse tensors are stored as a packed bitmask plus their non-zero values,
    pruning masks as a bitmask alone, everything else dense. Tied tensors
    (entries that are the very same tensor, such as a language model's
    ``lm_head.weight`` and its input embedding) are stored once, under the
    name ``transformers`` keeps, the other names recorded as aliases: loaded,
    they are one tensor again. The round trip
    through :func:`load_compressed` is bit-exact. The file is written by
    prunekit's atomic writer (:mod:`prunekit.io.writer`): a failed save never
    leaves a half-written checkpoint or a temporary file, a new file gets the
    umask's permissions, and a symlink at ``path`` keeps pointing at the new
    content.

    Args:
        model_or_state_dict: an ``nn.Module`` (its ``state_dict()`` is saved) or
            a mapping of names to tensors. A model that still carries pruning
            reparameterizations is saved with its ``name_orig`` and
            ``name_mask`` entries. Tensors in a sparse layout (COO, CSR)
            are saved, and load, as ordinary strided tensors.
        path: file to write (by convention ending in ``.safetensors``).
        drop_masked_values: when True, every ``X_orig`` entry that has an
            ``X_mask`` partner is stored with zeros where the mask is zero.
            The pruned weights ``X_orig * X_mask`` are unchanged (up to the
            sign of zero) and the file is much smaller, but the values the
            mask hides are gone, so a mask cannot later be relaxed.
        keep_zero_sign: store which zeros are ``-0.0`` (one bit per zero, only
            for tensors that hold one); False stores them as ``0.0``.
        key: a secret (bytes or str). When given, an HMAC-SHA-256 of the
            index is stored, and :func:`load_compressed` with the same key
            refuses a file that anyone without the key has altered.

    Examples:
        >>> import os, tempfile, torch
        >>> from prunekit.io.compressed import write_compressed, load_compressed
        >>> w = torch.randn(256, 256)
        >>> w[torch.rand_like(w) < 0.9] = 0
        >>> path = os.path.join(tempfile.mkdtemp(), "pruned.safetensors")
        >>> write_compressed({"weight": w}, path)
        >>> torch.equal(load_compressed(path)["weight"], w)
        True
        >>> os.path.getsize(path) < 0.2 * w.numel() * 4
        True
    """
    require_torch(model_or_state_dict, "prunekit.io (save_compressed)")
    secret = _key_bytes(key) if key is not None else None
    st = _safetensors_torch()
    native = _safetensors_dtypes()
    sd = _state_dict_of(model_or_state_dict)
    sharded = [k for k, v in sd.items() if _sharded.handler_for(v) is not None]
    if sharded:
        raise TypeError(
            f"save_compressed: {sharded[0]!r} (and {len(sharded) - 1} more) are DTensor shards; call "
            "prunekit.distributed.save_compressed(model, path) on every rank instead (it writes one file from "
            "rank 0, gathering one tensor at a time)"
        )
    if drop_masked_values:
        sd = drop_masked(sd)
    aliases = tied_aliases(sd, tied_keys_of(model_or_state_dict))
    index: List[Dict[str, Any]] = []
    tensors: Dict[str, torch.Tensor] = {}
    for name, t in sd.items():
        if name in aliases:  # a tied tensor: stored once, under the name kept; load_compressed ties it again
            index.append({"name": name, "encoding": "alias", "of": aliases[name]})
            continue
        entry, stored = _encode(name, t, native, keep_zero_sign)
        clash = set(stored) & set(tensors)
        if clash:
            raise ValueError(f"save_compressed: two entries would be stored under {sorted(clash)}; rename one")
        index.append(entry)
        tensors.update(stored)
    metadata = _metadata(index, secret)
    with atomic_path(path) as tmp:
        st.save_file(tensors, tmp, metadata=metadata)
    counts: Dict[str, int] = {}
    for e in index:
        counts[e["encoding"]] = counts.get(e["encoding"], 0) + 1
    logger.info("save_compressed: wrote %s (%d tensors: %s%s)", os.fspath(path), len(index), counts,
                ", signed" if secret is not None else "")


class CompressedWriter:
    """Write a compressed checkpoint one tensor at a time: memory holds one tensor, never the model.

    :meth:`add` encodes a tensor exactly as :func:`write_compressed` does and
    appends the stored bytes to a spool file beside ``path`` (one per element
    size, so every stored tensor ends up aligned, as safetensors lays them
    out; a spool has no name in the folder, so even a killed process leaves
    none behind); :meth:`close` writes the safetensors container -- header, then the
    spooled bytes, streamed -- through the atomic writer. The file holds what
    :func:`write_compressed` writes for the same tensors (the stored tensors
    may come in another order) and :func:`load_compressed` reads it the same
    way. On an exception inside ``with`` (or :meth:`abort`) nothing is
    written and the spools are removed. For writers that produce tensors one
    by one, such as ``prunekit.distributed.save_compressed`` gathering a
    sharded model.

    Examples:
        >>> import os, tempfile, torch
        >>> from prunekit.io.compressed import load_compressed
        >>> path = os.path.join(tempfile.mkdtemp(), "pruned.safetensors")
        >>> w = torch.randn(64, 64)
        >>> w[w.abs() < 1] = 0
        >>> with CompressedWriter(path) as out:
        ...     out.add("weight", w)
        ...     out.add("bias", torch.ones(64))
        >>> loaded = load_compressed(path)
        >>> list(loaded), torch.equal(loaded["weight"], w)
        (['weight', 'bias'], True)
    """

    def __init__(self, path: PathLike, *, keep_zero_sign: bool = True, key: Union[bytes, str, None] = None) -> None:
        self.path = os.fspath(path)
        self.keep_zero_sign = keep_zero_sign
        self._secret = _key_bytes(key) if key is not None else None
        _safetensors_torch()  # the optional dependency, checked before any work
        self._native = _safetensors_dtypes()
        self._directory = os.path.dirname(os.path.abspath(self.path))
        self._spools: Dict[int, Any] = {}  # element size -> [unnamed file, bytes written]
        self._layout: Dict[str, Tuple[int, str, List[int], int, int]] = {}
        self._index: List[Dict[str, Any]] = []
        self._closed = False

    def _spool(self, size: int) -> List[Any]:
        spool = self._spools.get(size)
        if spool is None:
            # a file without a name (prunekit.io.writer.unnamed_file): nothing to leave behind, ever
            spool = self._spools[size] = [unnamed_file(self._directory), 0]
        return spool

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Encode ``tensor`` and append it under ``name`` (the state dict's key)."""
        if self._closed:
            raise ValueError(f"CompressedWriter({self.path!r}) is closed; open a new one")
        _check_entry(name, tensor)
        entry, stored = _encode(name, tensor, self._native, self.keep_zero_sign)
        clash = set(stored) & set(self._layout)
        if clash or any(e["name"] == name for e in self._index):
            raise ValueError(f"save_compressed: two entries would be stored under {sorted(clash) or [name]}; "
                             "rename one")
        for key, t in stored.items():
            t = t.detach().to("cpu").contiguous()
            spool = self._spool(t.element_size())
            n = t.numel() * t.element_size()
            if n:
                spool[0].write(t.reshape(-1).view(torch.uint8).numpy().data)  # the bytes, not a copy
            self._layout[key] = (t.element_size(), _TAG_OF[t.dtype], list(t.shape), spool[1], spool[1] + n)
            spool[1] += n
        self._index.append(entry)

    def alias(self, name: str, of: str) -> None:
        """Record ``name`` as tied to the tensor already added as ``of``: nothing stored, one tensor on load.

        Examples:
            >>> import os, tempfile, torch
            >>> from prunekit.io.compressed import load_compressed
            >>> path = os.path.join(tempfile.mkdtemp(), "tied.safetensors")
            >>> with CompressedWriter(path) as out:
            ...     out.add("emb.weight", torch.ones(4, 2))
            ...     out.alias("head.weight", "emb.weight")
            >>> sd = load_compressed(path)
            >>> sd["head.weight"] is sd["emb.weight"]
            True
        """
        if self._closed:
            raise ValueError(f"CompressedWriter({self.path!r}) is closed; open a new one")
        if not isinstance(name, str) or name.endswith(_RESERVED) or any(e["name"] == name for e in self._index):
            raise ValueError(f"CompressedWriter.alias({name!r}, {of!r}): {name!r} is already added or not a name "
                             "prunekit can store; give each tensor one name")
        if not any(e["name"] == of and e["encoding"] != "alias" for e in self._index):
            raise ValueError(f"CompressedWriter.alias({name!r}, {of!r}): add {of!r} first (with add()); an alias "
                             "names a tensor stored in the file")
        self._index.append({"name": name, "encoding": "alias", "of": of})

    def close(self) -> None:
        """Write the file (atomically) and remove the spools."""
        if self._closed:
            raise ValueError(f"CompressedWriter({self.path!r}) is closed")
        metadata = _metadata(self._index, self._secret)
        sizes = sorted(self._spools, reverse=True)  # 8-byte elements first: every tensor aligned
        base, start = {}, 0
        for size in sizes:
            base[size] = start
            start += self._spools[size][1]
        header: Dict[str, Any] = {"__metadata__": metadata}
        for key, (size, tag, shape, begin, end) in self._layout.items():
            header[key] = {"dtype": tag, "shape": shape, "data_offsets": [base[size] + begin, base[size] + end]}
        raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
        raw += b" " * (-len(raw) % 8)
        try:
            with atomic_write(self.path, "wb") as f:
                f.write(len(raw).to_bytes(8, "little"))
                f.write(raw)
                for size in sizes:
                    spool = self._spools[size][0]
                    spool.flush()
                    spool.seek(0)
                    shutil.copyfileobj(spool, f, 1 << 20)
        finally:
            self.abort()
        logger.info("save_compressed: wrote %s (%d tensors, streamed%s)", self.path, len(self._index),
                    ", signed" if self._secret is not None else "")

    def abort(self) -> None:
        """Give up: remove the spools; nothing is written at ``path``."""
        self._closed = True
        while self._spools:
            _, spool = self._spools.popitem()
            with contextlib.suppress(OSError):
                spool[0].close()  # an unnamed file: closing it frees its space

    def __enter__(self) -> "CompressedWriter":
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.close()
        elif not self._closed:
            self.abort()
