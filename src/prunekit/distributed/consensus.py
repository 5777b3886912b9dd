"""Every rank of a checkpoint save or load agrees on each step: all succeeded, or all raise.

:func:`agree` is one ``all_gather_object`` of ``None`` (this rank's step
succeeded) or a one-line description of its error. If any rank failed, every
rank raises: a rank raises its own error, the others a
:class:`~prunekit.distributed.errors.DistributedCheckpointError` naming the
rank that failed and why. Without a process group (or with one rank) it
raises the local error, if any.
"""

from __future__ import annotations

from typing import Any, List, Optional, Tuple

import torch.distributed as dist

from ..errors import first_line
from .errors import CorruptDistributedCheckpointError, DistributedCheckpointError, UnsafeDistributedCheckpointError

__all__ = ["agree", "world"]


_KINDS = {"corrupt": CorruptDistributedCheckpointError, "unsafe": UnsafeDistributedCheckpointError}


def _kind(error: BaseException) -> str:
    for kind, cls in _KINDS.items():
        if isinstance(error, cls):
            return kind
    return "other"


def world() -> Tuple[int, int]:
    """``(rank, world size)`` of the default process group; ``(0, 1)`` without one.

    Examples:
        >>> world()
        (0, 1)
    """
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def agree(error: Optional[BaseException], folder: str, payload: Any = None) -> List[Any]:
    """Raise on every rank if any rank's step failed (``error`` is this rank's, or ``None``). Collective.

    Returns every rank's ``payload`` (in rank order) when all succeeded. A
    ``KeyboardInterrupt`` on this rank is told to the others and raised here
    as it is; a failure to exchange (a rank gone, a timeout) is raised as a
    :class:`DistributedCheckpointError`.

    Examples:
        >>> agree(None, "ckpt", payload=3)   # one process: nothing failed
        [3]
        >>> try:
        ...     agree(ValueError("ckpt: broken"), "ckpt")
        ... except ValueError as e:
        ...     print(e)
        ckpt: broken
    """
    mine = None if error is None else (_kind(error), first_line(error, with_type=not isinstance(error, DistributedCheckpointError)))
    size = world()[1]
    said: List[Any] = [(mine, payload)]
    if size > 1:
        said = [None] * size
        try:
            dist.all_gather_object(said, (mine, payload))
        except Exception as e:
            if error is not None:
                raise error from None
            raise DistributedCheckpointError(
                f"{folder}: the ranks could not agree ({first_line(e, with_type=True)}); nothing was changed") from None
    if error is not None:
        raise error
    for rank, (failed, _) in enumerate(said):
        if failed is not None:
            kind, why = failed
            prefix = "" if why.startswith(folder) else f"{folder}: "
            raise _KINDS.get(kind, DistributedCheckpointError)(
                f"{prefix}{why} (on rank {rank}); nothing was changed on any rank")
    return [p for _, p in said]
