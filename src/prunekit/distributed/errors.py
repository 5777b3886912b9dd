"""The errors of distributed checkpoints (all ``ValueError``: a bad folder is bad input).

Every message starts with the checkpoint folder and says why it was refused.
A refusal raised on one rank is raised on every rank (the others name the
rank that failed), and no rank's model has changed.
"""

from __future__ import annotations

from ..io.errors import CorruptCheckpointError, UnreadableFileError, UnsafeCheckpointError

__all__ = ["CorruptDistributedCheckpointError", "DistributedCheckpointError", "UnsafeDistributedCheckpointError"]


class DistributedCheckpointError(UnreadableFileError):
    """A distributed checkpoint folder cannot be saved or loaded (its message names the folder and why).

    Examples:
        >>> import tempfile, torch, prunekit
        >>> from prunekit.distributed import DistributedCheckpointError
        >>> try:
        ...     prunekit.distributed.load(tempfile.mkdtemp(), torch.nn.Linear(2, 2))
        ... except DistributedCheckpointError as e:
        ...     print("no prunekit-manifest.json" in str(e))
        True
    """


class CorruptDistributedCheckpointError(DistributedCheckpointError, CorruptCheckpointError):
    """A file of the folder is missing, truncated, altered or changed while it was being loaded."""


class UnsafeDistributedCheckpointError(DistributedCheckpointError, UnsafeCheckpointError):
    """The folder asks for something prunekit never loads: a global outside DCP's metadata
    classes in ``.metadata``, or an entry that is not plain data (code would run to rebuild it)."""
