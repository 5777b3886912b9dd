"""The public verbs of the file layer: save a (pruned) model in any format of the table."""

from __future__ import annotations

from typing import Any

from .formats import encoding

__all__ = ["save_compressed"]


def save_compressed(model_or_state_dict: Any, path: Any, *, format: str = "prunekit-compressed", **options: Any) -> Any:
    """Save a (pruned) model or state dict, compressed, in ``format`` (prunekit's own by default).

    Formats (entries of :data:`prunekit.io.ENCODINGS`):

    * ``"prunekit-compressed"`` (alias ``"prunekit"``, the default): one
      safetensors file, sparse tensors as bitmask + values, bit-exact and
      checksummed; options ``drop_masked_values``, ``keep_zero_sign``, ``key``
      (see :func:`prunekit.io.compressed.write_compressed`);
    * ``"compressed-tensors"``: a Hugging Face model folder in the layout
      vLLM serves, written by the ``compressed-tensors`` package (see
      :func:`prunekit.io.compressed_tensors.write_compressed_tensors`);
    * ``"safetensors"``: one plain (dense) safetensors file.

    Every file is written by prunekit's atomic writer.

    Examples:
        >>> import os, tempfile, torch
        >>> from prunekit.io import save_compressed, load_compressed
        >>> w = torch.randn(256, 256)
        >>> w[torch.rand_like(w) < 0.9] = 0
        >>> path = os.path.join(tempfile.mkdtemp(), "pruned.safetensors")
        >>> save_compressed({"weight": w}, path)
        >>> torch.equal(load_compressed(path)["weight"], w)
        True
        >>> os.path.getsize(path) < 0.2 * w.numel() * 4
        True
    """
    return encoding(format).write(model_or_state_dict, path, **options)
