"""Plain (dense) safetensors files, written through the atomic writer."""

from __future__ import annotations

from typing import Any, Dict, Mapping, Optional

import torch

from .writer import atomic_path

__all__ = ["write_safetensors"]


def write_safetensors(model_or_state_dict: Any, path: Any, *, metadata: Optional[Mapping[str, str]] = None) -> None:
    """Write a state dict (or a module's) as one plain safetensors file, atomically.

    Tensors that share memory are each written whole (the file holds no aliases).

    Examples:
        >>> import os, tempfile, torch
        >>> from prunekit.io.checkpoint import read_plain_safetensors
        >>> p = os.path.join(tempfile.mkdtemp(), "m.safetensors")
        >>> write_safetensors(torch.nn.Linear(2, 3), p)
        >>> sorted(read_plain_safetensors(p))
        ['bias', 'weight']
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
    tensors: Dict[str, torch.Tensor] = {}
    for k, v in sd.items():
        if not isinstance(v, torch.Tensor):
            raise TypeError(f"write_safetensors: entry {k!r} is a {type(v).__name__}, not a tensor")
        tensors[k] = v.detach().to("cpu").contiguous().clone()
    with atomic_path(path) as tmp:
        save_file(tensors, tmp, metadata=dict(metadata) if metadata else None)
