"""Plain (dense) safetensors files: whole files through the atomic writer, or streamed into an open file."""

from __future__ import annotations

import json
from typing import IO, Any, Dict, Mapping, Optional

import torch

from .layers import tied_aliases, tied_keys_of
from .reader import SAFETENSORS_TAGS
from .writer import atomic_path

__all__ = ["TIED_KEY", "write_safetensors", "stream_safetensors", "tensor_bytes", "tied_of", "SAFETENSORS_TAG_OF"]

#: torch dtype -> safetensors dtype tag
SAFETENSORS_TAG_OF: Dict["torch.dtype", str] = {dtype: tag for tag, dtype in SAFETENSORS_TAGS.items()}
#: the metadata entry of a plain safetensors file that lists its tied names: JSON ``{name: name stored}``
TIED_KEY = "tied_weights"


def write_safetensors(model_or_state_dict: Any, path: Any, *, metadata: Optional[Mapping[str, str]] = None) -> None:
    """Write a state dict (or a module's) as one plain safetensors file, atomically.

    Tied tensors (entries that are the very same tensor, such as a language
    model's ``lm_head.weight`` and its input embedding) are written once, under
    the name ``transformers`` keeps, as ``save_pretrained`` and safetensors'
    ``save_model`` do: ``from_pretrained`` and ``load_model`` tie them again,
    and the metadata entry :data:`TIED_KEY` lists them, so that
    :func:`prunekit.io.checkpoint.read_plain_safetensors` gives them back as one
    tensor. Tensors that merely overlap are each written whole.

    Examples:
        >>> import os, tempfile, torch
        >>> from prunekit.io.checkpoint import read_plain_safetensors
        >>> p = os.path.join(tempfile.mkdtemp(), "m.safetensors")
        >>> write_safetensors(torch.nn.Linear(2, 3), p)
        >>> sorted(read_plain_safetensors(p))
        ['bias', 'weight']
        >>> emb = torch.nn.Embedding(4, 2); head = torch.nn.Linear(2, 4, bias=False); head.weight = emb.weight
        >>> write_safetensors(torch.nn.ModuleDict({"emb": emb, "head": head}), p)
        >>> sd = read_plain_safetensors(p)
        >>> list(sd), sd["head.weight"] is sd["emb.weight"]
        (['emb.weight', 'head.weight'], True)
    """
    try:
        from safetensors.torch import save_file
    except ImportError:  # pragma: no cover - depends on the environment
        raise ImportError("writing safetensors files needs safetensors: pip install 'prunekit[io]'") from None
    sd = model_or_state_dict
    if callable(getattr(sd, "state_dict", None)) and not isinstance(sd, Mapping):
        sd = sd.state_dict()
    if not isinstance(sd, Mapping):
        raise TypeError(f"write_safetensors: expected a module or a state dict, got {type(sd).__name__}")
    bad = [k for k, v in sd.items() if not isinstance(v, torch.Tensor)]
    if bad:
        raise TypeError(f"write_safetensors: entry {bad[0]!r} is a {type(sd[bad[0]]).__name__}, not a tensor")
    aliases = tied_aliases(sd, tied_keys_of(model_or_state_dict))
    tensors = {k: v.detach().to("cpu").contiguous().clone() for k, v in sd.items() if k not in aliases}
    meta = dict(metadata) if metadata else {}
    if aliases:
        if TIED_KEY in meta:
            raise ValueError(f"write_safetensors: metadata={{{TIED_KEY!r}: ...}} is the entry that lists the tied "
                             f"tensors ({dict(aliases)}); name your entry otherwise")
        meta[TIED_KEY] = json.dumps(dict(aliases), separators=(",", ":"))
    with atomic_path(path) as tmp:
        save_file(tensors, tmp, metadata=meta or None)


def tied_of(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str], where: str) -> Dict[str, str]:
    """The tied names a plain safetensors file lists (:data:`TIED_KEY`), checked: name -> the name stored.

    Examples:
        >>> import torch
        >>> tied_of({"a": torch.ones(1)}, {"tied_weights": '{"b": "a"}'}, "m.safetensors")
        {'b': 'a'}
    """
    raw = metadata.get(TIED_KEY)
    if raw is None:
        return {}
    from .errors import UnreadableFileError
    from .reader import loads_json_strict

    tied = loads_json_strict(raw, f"{where}: metadata {TIED_KEY!r}", max_depth=2)
    if not isinstance(tied, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in tied.items()):
        raise UnreadableFileError(f"{where}: metadata {TIED_KEY!r} must be a JSON object of names (tied name -> "
                                  "stored name)")
    for k, v in tied.items():
        if k in tensors or v not in tensors:
            raise UnreadableFileError(f"{where}: metadata {TIED_KEY!r} ties {k!r} to {v!r}; the file "
                                      + (f"stores {k!r} itself" if k in tensors else f"has no tensor {v!r}"))
    return tied


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of ``t`` as safetensors stores them (row-major, little-endian), without a copy when ``t``
    is a contiguous CPU tensor.

    Examples:
        >>> import torch
        >>> bytes(tensor_bytes(torch.tensor([1], dtype=torch.int16)))
        b'\\x01\\x00'
    """
    t = t.detach()
    if t.device.type != "cpu":
        t = t.to("cpu")
    t = t.contiguous()
    if t.numel() == 0:
        return memoryview(b"")
    return t.reshape(-1).view(torch.uint8).numpy().data  # a memoryview of the bytes, not a copy


def stream_safetensors(f: IO[bytes], tensors: Mapping[str, torch.Tensor],
                       metadata: Optional[Mapping[str, str]] = None) -> int:
    """Write ``tensors`` as one safetensors file into the open binary file ``f`` (from its start), one
    tensor at a time: no copy of the whole is made, so a block as large as memory allows can be kept on
    disk. Returns the bytes written. Read it back with :func:`prunekit.io.reader.read_safetensors_header`
    and :func:`~prunekit.io.reader.read_safetensors_tensor` on the same file.

    Examples:
        >>> import tempfile, torch
        >>> from prunekit.io.reader import read_safetensors_header, read_safetensors_tensor
        >>> with tempfile.TemporaryFile() as f:
        ...     _ = stream_safetensors(f, {"w": torch.arange(4, dtype=torch.bfloat16)})
        ...     read_safetensors_tensor(f, read_safetensors_header(f, "<scratch>"), "w").tolist()
        [0.0, 1.0, 2.0, 3.0]
    """
    header: Dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    offset = 0
    for name, t in tensors.items():
        if t.dtype not in SAFETENSORS_TAG_OF:
            raise TypeError(f"stream_safetensors: tensor {name!r} has dtype {t.dtype}, which safetensors cannot store")
        n = t.numel() * t.element_size()
        header[name] = {"dtype": SAFETENSORS_TAG_OF[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)  # the data buffer starts 8-byte aligned, as the safetensors library writes it
    f.seek(0)
    f.write(len(raw).to_bytes(8, "little"))
    f.write(raw)
    for t in tensors.values():
        f.write(tensor_bytes(t))
    f.truncate()
    f.flush()
    return 8 + len(raw) + offset
