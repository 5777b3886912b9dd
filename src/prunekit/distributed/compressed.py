"""One compressed checkpoint file from a sharded model, written tensor by tensor.

:func:`save_compressed` walks the model's state dict in step on every rank.
For each entry the destination rank receives the whole tensor -- every other
rank sends its shard straight into the destination's buffer
(:func:`~prunekit.distributed.gather.iter_full`) -- encodes it with the
compressed format's own encoder and appends it to the file being written
(:class:`prunekit.io.compressed.CompressedWriter`), then lets it go. So the
destination holds one whole tensor at a time and the other ranks never hold
more than their shards; the file is the one ``prunekit.save_compressed``
writes for the unsharded model, readable by ``prunekit.load_compressed``.

After each tensor the destination tells every rank whether it was written,
so a failure there (a full disk, a bad name) stops every rank with an error
instead of leaving them waiting; nothing is left at ``path`` on failure.
"""

from __future__ import annotations

import os
from typing import Any, Mapping, Optional, Union

import torch
import torch.distributed as dist
from torch import Tensor, nn

from .. import reparam
from .gather import iter_full
from .layout import is_dtensor, piece_of, wrap

__all__ = ["save_compressed"]

PathLike = Union[str, "os.PathLike[str]"]


def _masked_shard(key: str, value: Tensor, mask: Tensor) -> Optional[Tensor]:
    """``reparam.masked`` on this rank's shard (nothing gathered); ``None`` (left as is) for a DTensor
    paired with a plain tensor."""
    if is_dtensor(value) and is_dtensor(mask):
        return wrap(reparam.masked(value.to_local().detach(), mask.to_local() != 0), piece_of(value, key))
    if not is_dtensor(value) and not is_dtensor(mask):
        return reparam.masked(value.detach(), mask != 0)
    return None


def save_compressed(model_or_state_dict: Union[nn.Module, Mapping[str, Tensor]], path: PathLike, *, dst: int = 0,
                    drop_masked_values: bool = False, keep_zero_sign: bool = True, key: Any = None) -> None:
    """Write one compressed checkpoint of a sharded (or plain) model from rank ``dst``. Collective.

    The options are :func:`prunekit.save_compressed`'s; ``path`` is written by
    rank ``dst`` only (the other ranks may pass anything). Load it in one
    process with ``prunekit.load_compressed(path)``.

    Example (a process group of one, a model without DTensors):
        >>> import os, tempfile, torch, torch.distributed as dist, prunekit
        >>> store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
        >>> dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        >>> m = prunekit.l1_unstructured(torch.nn.Linear(64, 64), "weight", 0.9)
        >>> path = os.path.join(tempfile.mkdtemp(), "m.safetensors")
        >>> prunekit.distributed.save_compressed(m, path)
        >>> torch.equal(prunekit.load_compressed(path)["weight_mask"], m.weight_mask)
        True
        >>> dist.destroy_process_group()
    """
    from ..io.compressed import CompressedWriter, drop_masked

    state = model_or_state_dict.state_dict() if isinstance(model_or_state_dict, nn.Module) else model_or_state_dict
    if drop_masked_values:
        state = drop_masked(state, _masked_shard)
    rank = dist.get_rank()
    writer = None
    failure: Union[BaseException, None] = None
    status = torch.zeros(1, dtype=torch.int64)
    try:
        if rank == dst:
            try:
                writer = CompressedWriter(path, keep_zero_sign=keep_zero_sign, key=key)
            except BaseException as e:  # noqa: BLE001 -- reported to every rank below
                failure = e
        for name, tensor in iter_full(state, dst):
            if writer is not None and failure is None:  # rank dst, writing
                try:
                    if tensor is None:  # iter_full gives rank dst every whole tensor
                        raise RuntimeError(f"save_compressed: rank {dst} was given no tensor for {name!r}")
                    writer.add(name, tensor)
                except BaseException as e:  # noqa: BLE001
                    failure = e
            del tensor
            status.fill_(0 if failure is None else 1)
            dist.broadcast(status, src=dst)
            if int(status):
                break
        if writer is not None and failure is None:
            try:
                writer.close()
                writer = None
            except BaseException as e:  # noqa: BLE001
                failure = e
        status.fill_(0 if failure is None else 1)
        dist.broadcast(status, src=dst)
    finally:
        if writer is not None:
            writer.abort()
    if failure is not None:
        raise failure
    if int(status):
        raise RuntimeError(f"save_compressed: rank {dst} failed to write {os.fspath(path)!r} (its error says why); "
                           "nothing was written")
