"""Putting a finished checkpoint folder in place without ever losing the one it replaces.

A save writes into a fresh hidden folder beside the target
(``.<name>.<random>.prunekit-tmp``, made by :func:`make_temp`), and
:func:`install` moves it in place only when it is complete. An existing
checkpoint there is first renamed aside (``.<name>.<random>.prunekit-old``),
the new folder renamed in, and the old one removed; if the second rename
fails (``KeyboardInterrupt`` included) the old folder is renamed back. A
folder that holds anything but a checkpoint's files is never replaced.

This module knows folders and file names only.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import secrets
import shutil
import stat
from typing import List, Tuple

from .errors import DistributedCheckpointError
from .manifest import MANIFEST_NAME, is_dcp_file

__all__ = ["check_replaceable", "install", "make_temp", "remove_temp"]

logger = logging.getLogger(__name__)
_TMP = ".prunekit-tmp"
_OLD = ".prunekit-old"
_DCP_EXTRA = re.compile(r"(__[0-9]{1,9})?\.metadata(\.tmp)?")


def _is_checkpoint_file(name: str) -> bool:
    return is_dcp_file(name) or name == MANIFEST_NAME or _DCP_EXTRA.fullmatch(name) is not None


def check_replaceable(target: str) -> None:
    """Refuse ``target`` if it exists and is not a folder holding only a checkpoint's files (or nothing).

    Examples:
        >>> import os, tempfile
        >>> d = tempfile.mkdtemp(); _ = open(os.path.join(d, "notes.txt"), "w").write("mine")
        >>> try:
        ...     check_replaceable(d)
        ... except DistributedCheckpointError as e:
        ...     print("notes.txt" in str(e))
        True
    """
    try:
        st = os.stat(target)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(st.st_mode):
        raise DistributedCheckpointError(f"{target}: exists and is not a folder; give a folder for the checkpoint")
    with os.scandir(target) as entries:
        for entry in entries:
            if not (_is_checkpoint_file(entry.name) and entry.is_file(follow_symlinks=False)):
                raise DistributedCheckpointError(
                    f"{target}: holds {entry.name!r}, which is not a checkpoint file; saving replaces the whole "
                    "folder, so give an empty folder, a new one, or one that holds only a checkpoint")


def _fsync_dir(directory: str) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _sibling(target: str, mark: str) -> str:
    parent, base = os.path.split(target)
    return os.path.join(parent, f".{base}.{secrets.token_hex(4)}{mark}")


def make_temp(target: str) -> Tuple[str, List[str]]:
    """Make the hidden folder a save of ``target`` writes into; returns it and the parent folders it created."""
    parent = os.path.dirname(target)
    created: List[str] = []
    p = parent
    while p and not os.path.exists(p):
        created.append(p)
        p = os.path.dirname(p)
    try:
        for d in reversed(created):
            os.mkdir(d)
        for _ in range(100):
            tmp = _sibling(target, _TMP)
            try:
                os.mkdir(tmp)
                return tmp, created
            except FileExistsError:  # pragma: no cover - 32 random bits collided
                continue
        raise FileExistsError(f"{target}: could not create a temporary folder beside it")  # pragma: no cover
    except BaseException:
        remove_temp(None, created)
        raise


def remove_temp(tmp: "str | None", created: List[str]) -> None:
    """Remove a save's temporary folder and the (still empty) parent folders it created."""
    if tmp is not None:
        shutil.rmtree(tmp, ignore_errors=True)
    for d in created:
        with contextlib.suppress(OSError):
            os.rmdir(d)


def install(tmp: str, target: str) -> None:
    """Move the finished folder ``tmp`` to ``target``; an old checkpoint there is replaced, never lost."""
    parent = os.path.dirname(target)
    try:
        old_mode = stat.S_IMODE(os.stat(target).st_mode)
    except FileNotFoundError:
        old_mode = None
    if old_mode is None:
        os.rename(tmp, target)
        _fsync_dir(parent)
        return
    os.chmod(tmp, old_mode)
    aside = _sibling(target, _OLD)
    os.rename(target, aside)
    try:
        os.rename(tmp, target)
    except BaseException:
        os.rename(aside, target)
        raise
    _fsync_dir(parent)
    try:
        shutil.rmtree(aside)
    except OSError as e:  # the new checkpoint is in place; only the old copy is left behind
        logger.warning("%s: could not remove the replaced checkpoint %s: %s", target, aside, e)
