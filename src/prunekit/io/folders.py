"""Atomic folder replacement: a whole folder (a Hugging Face model folder) written like one file.

:func:`atomic_folder` gives a temporary folder beside the target to fill; on
success the two are swapped in one step, so the old folder is never lost and
readers never find the path missing. It builds on the file writer's pieces
(:mod:`prunekit.io.writer`: the temporary-name marker, directory fsync,
clean-up that survives ``KeyboardInterrupt``, errors that name the user's
path) and, like it, imports nothing else from prunekit.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import os
import secrets
import shutil
import sys
from typing import Any, Callable, Iterator, Optional, Tuple

from .writer import _TMP_MARK, PathLike, _despite_interrupts, _fsync_dir, _oserror_for, resolve_target

__all__ = ["atomic_folder"]

logger = logging.getLogger(__name__)

_RENAME_EXCHANGE = 2  # Linux renameat2 flag
_RENAME_SWAP = 2  # macOS renamex_np flag
_AT_FDCWD = -100
_SWAP_UNSUPPORTED = {errno.EINVAL, errno.ENOSYS, errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EXDEV}
_swap_fn: "list[Any]" = []


def _swap_function() -> Any:
    """libc's call that swaps two names in one step (``renameat2``/``renamex_np``), or None."""
    if not _swap_fn:
        fn: Optional[Callable[[bytes, bytes], int]] = None
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            if sys.platform.startswith("linux") and hasattr(libc, "renameat2"):
                raw = libc.renameat2
                raw.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
                raw.restype = ctypes.c_int
                fn = lambda a, b: raw(_AT_FDCWD, a, _AT_FDCWD, b, _RENAME_EXCHANGE)  # noqa: E731
            elif sys.platform == "darwin" and hasattr(libc, "renamex_np"):
                raw = libc.renamex_np
                raw.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_uint]
                raw.restype = ctypes.c_int
                fn = lambda a, b: raw(a, b, _RENAME_SWAP)  # noqa: E731
        except (OSError, AttributeError, TypeError):  # pragma: no cover - no C library to ask
            fn = None
        _swap_fn.append(fn)
    return _swap_fn[0]


def _exchange(a: str, b: str) -> bool:
    """Swap the names ``a`` and ``b`` (both exist) atomically; False where the system cannot."""
    fn = _swap_function()
    if fn is None:
        return False
    if fn(os.fsencode(a), os.fsencode(b)) == 0:
        return True
    err = ctypes.get_errno()
    if err in _SWAP_UNSUPPORTED:
        return False
    raise OSError(err, os.strerror(err), a, None, b)


def _ident(path: Optional[str]) -> Optional[Tuple[int, int]]:
    """(device, inode) of what ``path`` names itself (links not followed), or None when nothing is there."""
    if path is None:
        return None
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino


def _fsync_tree(folder: str) -> None:
    """fsync every file and folder under ``folder`` (links are not followed)."""
    for root, dirs, files in os.walk(folder, topdown=False):
        for name in files:
            p = os.path.join(root, name)
            if os.path.islink(p):
                continue
            fd = os.open(p, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0))
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(root)


def _remove_tree(path: Optional[str], ident: Optional[Tuple[int, int]]) -> None:
    """Remove the folder at ``path`` if it is still the one ``ident`` names (None: whatever is there)."""
    def step() -> None:
        if path is not None and os.path.lexists(path) and (ident is None or _ident(path) == ident):
            shutil.rmtree(path, ignore_errors=True)
            if os.path.lexists(path):  # pragma: no cover - permissions
                logger.warning("prunekit.io.writer: could not remove the temporary folder %s", path)

    _despite_interrupts(step)


@contextlib.contextmanager
def atomic_folder(path: PathLike) -> Iterator[str]:
    """Give a temporary folder to fill; on success it replaces the folder ``path`` in one step.

    The temporary folder is made beside ``path`` (same file system) with a name
    armed for removal before it exists. On leaving the block every file in it
    is fsync-ed; then, where ``path`` exists, the two folders are *swapped*
    atomically (Linux ``renameat2(RENAME_EXCHANGE)``, macOS
    ``renamex_np(RENAME_SWAP)``), so ``path`` always names a complete folder,
    old or new -- never missing, never half -- and the old one, moved to the
    temporary name, is removed. A file system that cannot swap (NFS, some FUSE
    mounts, Windows) gets two renames: the old folder aside, the new one in;
    ``path`` is missing between them, and a reader that finds it missing next
    to a ``.prunekit-tmp`` folder can wait for it.

    On an exception -- ``KeyboardInterrupt`` included, wherever it lands, even
    between the two renames or right after the swap -- the old folder is put
    back and the new one removed: the call fails and ``path`` is as it was. A
    ``path`` that is a symlink to a folder keeps the link; the folder it points
    to is replaced.

    Examples:
        >>> import os, tempfile
        >>> folder = os.path.join(tempfile.mkdtemp(), "export")
        >>> for text in ("old", "new"):
        ...     with atomic_folder(folder) as tmp:
        ...         with open(os.path.join(tmp, "config.json"), "w") as f:
        ...             _ = f.write(text)
        >>> open(os.path.join(folder, "config.json")).read(), os.listdir(os.path.dirname(folder))
        ('new', ['export'])
    """
    user = os.fspath(path)
    target = resolve_target(user)
    if os.path.lexists(target) and not os.path.isdir(target):
        raise FileExistsError(errno.EEXIST, "is a file, not a folder; give a folder name", user)
    parent, base = os.path.split(target)
    if not os.path.isdir(parent):
        raise FileNotFoundError(errno.ENOENT, f"the folder {parent} does not exist", user)
    tmp: Optional[str] = None  # the new folder while it is built; the old one after a swap
    aside: Optional[str] = None  # the old folder between two renames (no swap)
    new_id: Optional[Tuple[int, int]] = None
    old_id: Optional[Tuple[int, int]] = None
    done = False
    try:
        for _ in range(100):
            tmp = os.path.join(parent, f".{base}.{secrets.token_hex(4)}{_TMP_MARK}")  # armed before it exists
            try:
                os.mkdir(tmp, 0o777)
                break
            except FileExistsError:  # pragma: no cover - 32 random bits collided: not ours to remove
                tmp = None
        else:  # pragma: no cover
            raise FileExistsError(errno.EEXIST, "could not create a temporary folder", user)
        new_id = _ident(tmp)
        yield tmp
        try:
            _fsync_tree(tmp)
            old_id = _ident(target) if os.path.isdir(target) else None
            if old_id is None:
                os.rename(tmp, target)
            elif not _exchange(tmp, target):
                aside = os.path.join(parent, f".{base}.{secrets.token_hex(4)}{_TMP_MARK}")  # armed before
                os.rename(target, aside)
                os.rename(tmp, target)
            _fsync_dir(parent)
        except OSError as exc:
            raise _oserror_for(exc, user) from None
        done = True
    finally:
        if done:  # the new folder is in place: remove the old one, wherever it went
            _remove_tree(aside if aside is not None else tmp, old_id)
        else:
            _despite_interrupts(lambda: _put_back(target, tmp, aside, new_id, old_id))
            _remove_tree(tmp, new_id)


def _put_back(target: str, tmp: Optional[str], aside: Optional[str], new_id: Optional[Tuple[int, int]],
              old_id: Optional[Tuple[int, int]]) -> None:
    """Undo a folder replace at whatever step it stopped: the old folder at ``target``, the new one at ``tmp``.

    Decided from what the names hold now (device and inode), not from which line ran
    last, so an interrupt between a rename and the next statement is undone too.
    Idempotent: running it again changes nothing.
    """
    if tmp is None or new_id is None:
        return
    now = _ident(target)
    if now == new_id:  # the new folder got in: take it out again
        if old_id is None:
            os.rename(target, tmp)
        elif _ident(tmp) == old_id:  # swapped: swap back
            if not _exchange(tmp, target):  # pragma: no cover - it swapped a moment ago
                raise OSError(errno.EIO, "could not swap the folders back", target)
        elif aside is not None and _ident(aside) == old_id:
            os.rename(target, tmp)
            os.rename(aside, target)
    elif now is None and aside is not None and _ident(aside) == old_id:  # between the two renames
        os.rename(aside, target)
