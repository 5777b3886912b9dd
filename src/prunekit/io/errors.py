"""The errors of prunekit's file layer (all ``ValueError``: a bad file is bad input)."""

from __future__ import annotations

__all__ = [
    "UnreadableFileError",
    "CorruptCheckpointError",
    "CheckpointSignatureError",
    "UnsafeCheckpointError",
]


class UnreadableFileError(ValueError):
    """A file prunekit was asked to read is not what it must be (its message names the path and why).

    Raised for non-regular files (a FIFO, a device, a directory), files over a
    size limit and malformed JSON or YAML.

    Examples:
        >>> from prunekit.io import read_json
        >>> try:
        ...     read_json("/dev/zero")
        ... except UnreadableFileError as e:
        ...     print(str(e).split(":")[0], "|", "not a regular file" in str(e))
        /dev/zero | True
    """


class CorruptCheckpointError(UnreadableFileError):
    """The compressed checkpoint is damaged, truncated or not a prunekit file.

    Examples:
        >>> import os, tempfile, torch
        >>> from prunekit.sparse import save_compressed, load_compressed, CorruptCheckpointError
        >>> path = os.path.join(tempfile.mkdtemp(), "m.safetensors")
        >>> save_compressed({"w": torch.ones(64)}, path)
        >>> with open(path, "r+b") as f:
        ...     _ = f.truncate(os.path.getsize(path) - 3)
        >>> try:
        ...     load_compressed(path)
        ... except CorruptCheckpointError as e:
        ...     print("damaged" in str(e))
        True
    """


class CheckpointSignatureError(CorruptCheckpointError):
    """A signed checkpoint's HMAC does not verify: wrong key, missing signature, or altered file.

    Examples:
        >>> import os, tempfile, torch
        >>> from prunekit.io import save_compressed, load_compressed
        >>> path = os.path.join(tempfile.mkdtemp(), "m.safetensors")
        >>> save_compressed({"w": torch.ones(4)}, path, key=b"secret")
        >>> try:
        ...     load_compressed(path, key=b"guess")
        ... except CheckpointSignatureError as e:
        ...     print("signature does not verify" in str(e))
        True
    """


class UnsafeCheckpointError(ValueError):
    """The checkpoint needs full unpickling (arbitrary code) and the caller did not allow it."""
