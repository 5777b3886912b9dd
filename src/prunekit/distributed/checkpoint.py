"""Saving and loading pruned sharded models with ``torch.distributed.checkpoint`` (DCP), verified.

A pruned FSDP2 model's ``state_dict()`` holds ``name_orig`` and ``name_mask``
as DTensor shards, so ``dcp.save`` writes the masks with the weights, each
rank writing its own shards. :func:`save` does that for a model and,
optionally, its pruning state (:class:`~prunekit.training.PruningCallbacks`:
steps, schedule, scores and masks) and anything else you pass, into a fresh
folder beside the target; then it writes ``prunekit-manifest.json`` (size and
SHA-256 of every file DCP wrote, :mod:`~prunekit.distributed.manifest`),
last, and moves the folder in place (:mod:`~prunekit.distributed.folder`):
a failed save leaves no folder behind and an older checkpoint there intact.

:func:`load` is all or nothing on every rank. It checks the manifest and
every file against it, reads ``.metadata`` with an unpickler that knows only
DCP's metadata classes (:mod:`~prunekit.distributed.dcp_metadata`), loads
into a staged copy of this rank's state (:mod:`~prunekit.distributed.staging`)
and only when every rank has read everything does it change the model:
reparameterize what the checkpoint prunes, move the values in, remask, load
the pruning state. A failure anywhere -- on any rank, ``KeyboardInterrupt``
included -- changes no rank's model, and raises a
:class:`~prunekit.distributed.errors.DistributedCheckpointError` (a
``ValueError``) naming the folder and the reason on every rank. See
docs/distributed-checkpoints.md for what is checked and what is never loaded.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from typing import Any, Dict, Iterator, List, Mapping, Optional, Union

import torch.distributed as dist
from torch import nn

from ..errors import first_line
from .consensus import agree, world
from .errors import DistributedCheckpointError

__all__ = ["load", "save"]

PathLike = Union[str, "os.PathLike[str]"]
METADATA_LIMIT = 1 << 30  # DCP metadata is a few hundred bytes per tensor chunk


def _state(model: nn.Module, pruning: Optional[Any], extra: Mapping[str, Any]) -> Dict[str, Any]:
    state: Dict[str, Any] = {"model": model.state_dict()}
    if pruning is not None:
        state["pruning"] = pruning.state_dict()
    for key, value in extra.items():
        if key in ("model", "pruning"):
            raise ValueError(f"extra entry {key!r} would overwrite the {key} entry; name it differently")
        state[key] = value
    return state


def _no_dist() -> bool:
    return not (dist.is_available() and dist.is_initialized())


@contextlib.contextmanager
def _single_process_quiet() -> Iterator[None]:
    """Without a process group DCP warns that it assumes one process: that is what prunekit asks for."""
    with warnings.catch_warnings():
        if _no_dist():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def _from_dcp(e: BaseException, folder: str, doing: str) -> BaseException:
    """The error to raise for DCP's ``CheckpointException`` (a ``BaseException``): never that one itself."""
    rank = world()[0]
    failures = dict(getattr(e, "failures", None) or {})
    first = None
    for r in sorted(failures):
        exc = failures[r][0] if isinstance(failures[r], tuple) else failures[r]
        if r == rank and isinstance(exc, KeyboardInterrupt):
            return KeyboardInterrupt()
        if first is None or (r == rank and not isinstance(first[1], DistributedCheckpointError)):
            first = (r, exc)
    if first is None:
        return DistributedCheckpointError(f"{folder}: {doing} failed: {first_line(e, with_type=True)}")
    r, exc = first
    if isinstance(exc, DistributedCheckpointError):
        return type(exc)(str(exc) if r == rank else f"{exc} (on rank {r})")
    where = "" if r == rank else f" (on rank {r})"
    return DistributedCheckpointError(f"{folder}: {doing} failed{where}: {first_line(exc, with_type=True)}")


def _as_error(e: BaseException, folder: str, doing: str) -> BaseException:
    """``e`` as a :class:`DistributedCheckpointError` naming ``folder`` (interrupts and ours as they are)."""
    from torch.distributed.checkpoint.api import CheckpointException

    if isinstance(e, CheckpointException):
        return _from_dcp(e, folder, doing)
    if isinstance(e, DistributedCheckpointError) or not isinstance(e, Exception):
        return e
    return DistributedCheckpointError(f"{folder}: {doing} failed: {first_line(e, with_type=True)}")


def _owned(name: str, rank: int) -> bool:
    """Whether this rank hashes ``name`` after a save: the shards it wrote, and ``.metadata`` on rank 0."""
    from .manifest import METADATA_NAME

    return name.startswith(f"__{rank}_") if name != METADATA_NAME else rank == 0


def save(checkpoint_id: PathLike, model: nn.Module, pruning: Optional[Any] = None, **extra: Any) -> None:
    """Save ``model`` (masks included) and ``pruning`` with ``torch.distributed.checkpoint``. Collective.

    ``extra`` entries (e.g. an optimizer's state dict from
    ``torch.distributed.checkpoint.state_dict.get_state_dict``) are saved beside them.
    The folder gets a manifest of every file's size and SHA-256, written last;
    it appears (or replaces an older checkpoint) only once complete, and a
    folder holding anything but a checkpoint's files is never replaced.
    Works without a process group too (one process).

    Example (a process group of one, a model without DTensors):
        >>> import os, tempfile, torch, torch.distributed as dist, prunekit
        >>> store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
        >>> dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        >>> m = prunekit.l1_unstructured(torch.nn.Linear(4, 2), "weight", 3)
        >>> path = os.path.join(tempfile.mkdtemp(), "ckpt")
        >>> prunekit.distributed.save(path, m)
        >>> sorted(os.listdir(path))
        ['.metadata', '__0_0.distcp', 'prunekit-manifest.json']
        >>> fresh = torch.nn.Linear(4, 2)
        >>> prunekit.distributed.load(path, fresh)
        >>> torch.equal(fresh.weight_mask, m.weight_mask), torch.equal(fresh.weight, m.weight)
        (True, True)
        >>> dist.destroy_process_group()
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from . import folder as folders
    from .manifest import hash_file, is_dcp_file, write_manifest

    user = os.fspath(checkpoint_id)
    rank, size = world()
    error: Optional[BaseException] = None
    created: List[str] = []
    tmp, target = None, os.path.realpath(user) if user else user
    try:
        state = _state(model, pruning, extra)
        if rank == 0:
            if not user:
                raise DistributedCheckpointError("prunekit.distributed.save: empty path; give a folder name")
            folders.check_replaceable(target)
            tmp, created = folders.make_temp(target)
    except BaseException as e:
        error = _as_error(e, user, "saving")
    where = agree(error, user, payload=tmp)[0]
    try:
        try:
            with _single_process_quiet():
                dcp.save(state, storage_writer=dcp.FileSystemWriter(where, sync_files=True), no_dist=_no_dist())
        except CheckpointException as e:
            error = _from_dcp(e, user, "writing the checkpoint")
        except BaseException as e:
            error = _as_error(e, user, "writing the checkpoint")
        agree(error, user)
        entries = {}
        try:
            names = sorted(os.listdir(where))
            entries = {n: hash_file(os.path.join(where, n)) for n in names if _owned(n, rank)}
        except BaseException as e:
            error = _as_error(e, user, "hashing the written files")
        hashed = agree(error, user, payload=entries)
        if rank == 0:
            try:
                merged = {n: e for part in hashed for n, e in part.items()}
                odd = sorted(set(names) - set(merged))
                if odd or not all(is_dcp_file(n) for n in merged):
                    raise DistributedCheckpointError(f"{user}: DCP wrote files prunekit does not know: {odd}")
                write_manifest(where, merged)
                folders.install(where, target)
                tmp = None
            except BaseException as e:
                error = _as_error(e, user, "finishing the checkpoint")
        agree(error, user)
    except BaseException:
        if rank == 0:
            folders.remove_temp(tmp, created)
        raise


def load(checkpoint_id: PathLike, model: nn.Module, pruning: Optional[Any] = None, **extra: Any) -> None:
    """Load what :func:`save` wrote into ``model`` (pruned, or not yet) and ``pruning``. Collective.

    ``model`` is the same architecture, sharded the same way or not at all;
    tensors pruned in the checkpoint are reparameterized. ``pruning``
    (callbacks from :func:`prunekit.prepare_pruning` with the same config)
    gets its steps, schedule, scores and masks back. ``extra`` entries load in
    place as ``dcp.load`` loads them: tensors (also inside mappings and lists)
    are overwritten, mapping entries replaced, stateful objects (an optimizer)
    get ``load_state_dict``; a top-level non-tensor value cannot be given back
    (put it in a dict).

    Nothing changes unless every rank has verified and read everything: a
    missing, truncated or altered file, a crafted ``.metadata`` or entry, a
    checkpoint that does not fit the model, an interrupt -- each raises a
    :class:`~prunekit.distributed.errors.DistributedCheckpointError` (or the
    ``KeyboardInterrupt``) on every rank with every model as it was. See
    :func:`save` for an example.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from .dcp_io import SafeLoadPlanner, VerifiedReader
    from .dcp_metadata import read_metadata
    from .manifest import METADATA_NAME, read_manifest, read_stamped, stamp_files, verify_files
    from .staging import StagedLoad

    folder = os.path.realpath(os.fspath(checkpoint_id))
    rank, size = world()
    error: Optional[BaseException] = None
    files, stamps = {}, {}
    try:
        files = read_manifest(folder)
        stamps = stamp_files(folder, files)  # on every rank before any rank hashes
    except BaseException as e:
        error = _as_error(e, folder, "reading the manifest")
    agree(error, folder)
    meta = staged = None
    try:
        shards = sorted(n for n in files if n != METADATA_NAME)
        verify_files(folder, files, stamps, shards[rank::size])
        if files[METADATA_NAME].size > METADATA_LIMIT:
            raise DistributedCheckpointError(
                f"{folder}: {METADATA_NAME} has {files[METADATA_NAME].size} bytes; DCP metadata is never that large")
        data = read_stamped(folder, METADATA_NAME, files[METADATA_NAME], stamps[METADATA_NAME])
        meta = read_metadata(data, folder, files)
        staged = StagedLoad(folder)
        staged.add_model(model, meta.state_dict_metadata)
        if pruning is not None:
            staged.add_pruning(pruning, meta.state_dict_metadata)
        staged.add_extra(extra)
    except BaseException as e:
        error = _as_error(e, folder, "preparing the load")
    agree(error, folder)
    assert staged is not None
    try:
        with _single_process_quiet():
            dcp.load(staged.flat, storage_reader=VerifiedReader(folder, meta, stamps),
                     planner=SafeLoadPlanner(folder), no_dist=_no_dist())
    except CheckpointException as e:  # collective: every rank has it
        raise _from_dcp(e, folder, "reading the checkpoint") from None
    reached = False
    try:
        with staged.commit():
            reached = True
            agree(None, folder)
    except BaseException as e:
        if reached:
            raise
        agree(_as_error(e, folder, "loading into the model"), folder)
