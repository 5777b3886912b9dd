"""The one atomic writer: every file prunekit writes goes through here.

A save behaves like a careful ``torch.save(obj, path)``:

* **atomic** -- the bytes go to a temporary file next to the target, are
  flushed and ``fsync``-ed, then ``os.replace`` moves the file into place and
  the directory is ``fsync``-ed; a reader sees the old file or the new one,
  never half of one;
* **permissions as the umask gives** -- a new file gets ``0o666 & ~umask``
  (``0644`` under umask ``022``), exactly what ``open(path, "wb")`` and so
  ``torch.save`` give; an existing file keeps its mode, as it would with
  ``open(path, "wb")``;
* **symlinks followed** -- saving to a link writes the file the link points
  to and keeps the link (a dangling link gets its target created);
* **nothing left behind** -- on any failure, ``KeyboardInterrupt`` included,
  the temporary file is removed and the target is untouched;
* **errors name your path** -- an ``OSError`` says ``path``, not the
  temporary name.

The temporary name is armed for removal *before* it exists: a
``KeyboardInterrupt`` at any point -- even between the system call that
creates the file and the next line -- leaves no ``.prunekit-tmp`` file behind.

:func:`prunekit.io.folders.atomic_folder` (also importable from here) does
the same for a whole folder. :func:`unnamed_file` gives scratch files
(spools) that have no name at all, so nothing can be left behind.

An existing target that is not a regular file (``/dev/null``, a FIFO) is
written in place, as ``open(path, "wb")`` would, never replaced.

A file-like object (``io.BytesIO``, an open file) is written directly: there is
no path to replace.

This module knows files and bytes only; it imports nothing from prunekit.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import secrets
import stat
from typing import IO, Any, Callable, Iterator, Optional, Union

__all__ = [
    "PathLike",
    "atomic_path",
    "atomic_write",
    "is_file_like",
    "resolve_target",
    "unnamed_file",
    "write_bytes",
    "write_json",
    "write_text",
    "write_with",
]

PathLike = Union[str, "os.PathLike[str]"]
_TMP_MARK = ".prunekit-tmp"
logger = logging.getLogger(__name__)


def is_file_like(target: Any) -> bool:
    """True for an object with a ``write`` method (written to directly, not replaced).

    Examples:
        >>> import io
        >>> is_file_like(io.BytesIO()), is_file_like("model.pt")
        (True, False)
    """
    return hasattr(target, "write") and not isinstance(target, (str, bytes, os.PathLike))


def resolve_target(path: PathLike) -> str:
    """The file a save to ``path`` really writes: ``path`` with every symlink followed.

    ``open(path, "wb")`` follows links, and so does prunekit: the link stays, its
    target gets the new content. A relative link resolves against the link's folder.

    Examples:
        >>> import os, tempfile
        >>> d = tempfile.mkdtemp()
        >>> os.symlink("real.pt", os.path.join(d, "link.pt"))
        >>> resolve_target(os.path.join(d, "link.pt")) == os.path.join(os.path.realpath(d), "real.pt")
        True
    """
    path = os.fspath(path)
    if isinstance(path, bytes):  # pragma: no cover - prunekit's API takes str paths
        path = os.fsdecode(path)
    if not path:
        raise FileNotFoundError(errno.ENOENT, "empty path; give the name of the file to write", path)
    return os.path.realpath(path)


def _oserror_for(exc: OSError, path: str) -> OSError:
    """The same error, naming the user's ``path`` instead of the temporary file."""
    new = type(exc)(exc.errno, exc.strerror or str(exc), path) if exc.errno is not None else type(exc)(
        f"{path}: {exc}")
    return new


def _fsync_dir(directory: str) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover - some filesystems refuse fsync on a directory
        pass
    finally:
        os.close(fd)


def _temp_name(target: str) -> str:
    """A fresh temporary name beside ``target``, keeping its extension."""
    directory, base = os.path.split(target)
    stem, ext = os.path.splitext(base)
    return os.path.join(directory, f".{stem}.{secrets.token_hex(4)}{_TMP_MARK}{ext}")


_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0)


@contextlib.contextmanager
def atomic_path(path: PathLike) -> Iterator[str]:
    """Give a temporary file name to write; on success it replaces ``path`` atomically.

    For writers that want a file name (``safetensors.torch.save_file``,
    ``matplotlib``'s ``savefig``): write the temporary file, by name, inside the
    ``with`` block. The temporary name keeps ``path``'s extension, so a writer
    that chooses the format by extension chooses the same one. On leaving the
    block the file is fsync-ed, given the permissions a fresh ``open(path, "wb")``
    would give, and moved over ``path``; on an exception (``KeyboardInterrupt``
    included, wherever it lands) it is removed and ``path`` is untouched.

    Examples:
        >>> import os, tempfile
        >>> path = os.path.join(tempfile.mkdtemp(), "notes.txt")
        >>> with atomic_path(path) as tmp:
        ...     with open(tmp, "w") as f:
        ...         _ = f.write("hello")
        >>> open(path).read(), os.listdir(os.path.dirname(path))
        ('hello', ['notes.txt'])
    """
    user_path = os.fspath(path)
    target = resolve_target(user_path)
    if os.path.isdir(target):
        raise IsADirectoryError(errno.EISDIR, "is a directory; give a file name", user_path)
    try:
        existing = os.stat(target)
    except FileNotFoundError:
        existing = None
    except OSError as exc:
        raise _oserror_for(exc, user_path) from None
    if existing is not None and not stat.S_ISREG(existing.st_mode):
        # a device, a FIFO, /dev/stdout: written in place, as open(path, "wb") would (never replaced)
        yield target
        return
    tmp: Optional[str] = None  # armed: whatever name this holds is removed on any failure
    try:
        fd = -1
        for _ in range(100):
            tmp = _temp_name(target)  # armed before the file exists
            try:
                # 0o666: the kernel applies the process umask, as open(path, "wb") does
                fd = os.open(tmp, _CREATE, 0o666)
                break
            except FileExistsError:  # pragma: no cover - 32 random bits collided: not ours to remove
                tmp = None
        if tmp is None:  # pragma: no cover
            raise FileExistsError(errno.EEXIST, "could not create a temporary file", target)
        try:
            # the mode the kernel gave a fresh 0o666 file under this umask; an existing file keeps its own
            mode = stat.S_IMODE(existing.st_mode if existing is not None else os.fstat(fd).st_mode)
        finally:
            os.close(fd)
    except OSError as exc:
        _remove_quietly(tmp)
        raise _oserror_for(exc, user_path) from None
    except BaseException:
        _remove_quietly(tmp)
        raise
    try:
        yield tmp
        try:
            if stat.S_IMODE(os.stat(tmp).st_mode) != mode:  # a writer may have re-created the file
                os.chmod(tmp, mode)
            fd = os.open(tmp, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, target)
        except OSError as exc:
            raise _oserror_for(exc, user_path) from None
        _fsync_dir(os.path.dirname(target))
    except BaseException:
        _remove_quietly(tmp)
        raise


def _remove_quietly(path: Optional[str]) -> None:
    """Remove a temporary file if it is there, finishing even when Ctrl-C lands in the middle."""
    if path is not None:
        _despite_interrupts(lambda: _unlink_if_there(path))


def _unlink_if_there(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def _despite_interrupts(step: Callable[[], None]) -> None:
    """Run an idempotent clean-up step to its end: a ``KeyboardInterrupt`` inside it runs it again, then is raised.

    An ``OSError`` (an interrupt inside ``shutil.rmtree`` can turn into one) is retried too,
    then logged, not raised: clean-up never hides the error that caused it.
    """
    interrupted: Optional[BaseException] = None
    failed: Optional[OSError] = None
    for _ in range(5):
        try:
            step()
            failed = None
            break
        except KeyboardInterrupt as exc:
            interrupted = exc
        except OSError as exc:
            failed = exc
    if failed is not None:
        logger.warning("prunekit.io.writer: clean-up failed: %s", failed)
    if interrupted is not None:
        raise interrupted


@contextlib.contextmanager
def atomic_write(path: PathLike, mode: str = "wb", *, encoding: Optional[str] = None) -> Iterator[IO[Any]]:
    """Open a file for writing that appears at ``path`` only when the block succeeds.

    ``mode`` is ``"wb"`` or ``"w"`` (text, UTF-8 unless ``encoding`` says otherwise).
    Everything :func:`atomic_path` promises holds: fsync before the rename, umask
    permissions, symlinks followed, no temporary file left on failure, errors
    naming ``path``.

    Examples:
        >>> import os, tempfile
        >>> path = os.path.join(tempfile.mkdtemp(), "data.bin")
        >>> with atomic_write(path) as f:
        ...     _ = f.write(b"\\x00\\x01")
        >>> open(path, "rb").read()
        b'\\x00\\x01'
    """
    if mode not in ("wb", "w"):
        raise ValueError(f"atomic_write: mode {mode!r} is not supported; use 'wb' (bytes) or 'w' (text)")
    user_path = os.fspath(path)
    with atomic_path(user_path) as tmp:
        try:
            f = open(tmp, mode, encoding=(encoding or "utf-8") if mode == "w" else None)
        except OSError as exc:
            raise _oserror_for(exc, user_path) from None
        with f:
            try:
                yield f
                f.flush()
            except OSError as exc:
                raise _oserror_for(exc, user_path) from None


def write_with(path_or_file: Any, writer: Callable[[Any], None]) -> None:
    """Call ``writer(file_object)`` on an atomic file at ``path_or_file`` (or on the object itself).

    The bridge for writers that take a file object, such as ``torch.save``:
    ``write_with(path, lambda f: torch.save(obj, f))``.

    Examples:
        >>> import io, os, tempfile, torch
        >>> path = os.path.join(tempfile.mkdtemp(), "t.pt")
        >>> write_with(path, lambda f: torch.save({"w": torch.ones(2)}, f))
        >>> torch.load(path, weights_only=True)["w"].tolist()
        [1.0, 1.0]
        >>> buf = io.BytesIO(); write_with(buf, lambda f: torch.save(1, f)); buf.tell() > 0
        True
    """
    if is_file_like(path_or_file):
        writer(path_or_file)
        return
    with atomic_write(path_or_file, "wb") as f:
        writer(f)


def write_bytes(path: PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically.

    Examples:
        >>> import os, tempfile
        >>> path = os.path.join(tempfile.mkdtemp(), "b.bin")
        >>> write_bytes(path, b"abc"); open(path, "rb").read()
        b'abc'
    """
    with atomic_write(path, "wb") as f:
        f.write(data)


def write_text(path: PathLike, text: str, *, encoding: str = "utf-8") -> None:
    """Write ``text`` to ``path`` atomically (UTF-8 by default).

    Examples:
        >>> import os, tempfile
        >>> path = os.path.join(tempfile.mkdtemp(), "t.txt")
        >>> write_text(path, "héllo"); open(path, encoding="utf-8").read()
        'héllo'
    """
    with atomic_write(path, "w", encoding=encoding) as f:
        f.write(text)


def _json_default(o: Any) -> Any:
    if isinstance(o, (tuple, set, frozenset)):
        return list(o)
    if hasattr(o, "item"):  # numpy / torch scalars
        return o.item()
    if hasattr(o, "tolist"):
        return o.tolist()
    return str(o)


def write_json(path_or_file: Any, data: Any, *, indent: Optional[int] = 2) -> None:
    """Write ``data`` as JSON atomically (tuples as lists, tensor scalars as numbers).

    The whole document is encoded before the file is touched, so data that
    cannot be encoded leaves ``path`` as it was.

    Examples:
        >>> import json, os, tempfile
        >>> path = os.path.join(tempfile.mkdtemp(), "r.json")
        >>> write_json(path, {"shape": (2, 3)}); json.load(open(path))
        {'shape': [2, 3]}
    """
    text = json.dumps(data, indent=indent, default=_json_default) + "\n"
    if is_file_like(path_or_file):
        path_or_file.write(text)
        return
    write_text(path_or_file, text)


# ----------------------------------------------------------------------------- scratch files without a name
_SCRATCH = os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0)


def unnamed_file(directory: PathLike) -> IO[bytes]:
    """A scratch file in ``directory``, open for reading and writing, that no name points at.

    Where the file system allows (Linux ``O_TMPFILE``) it never has a name; elsewhere it
    is created under a temporary name that is armed for removal before it exists and
    unlinked at once (on Windows, deleted when closed). Either way a crash, a
    ``KeyboardInterrupt`` or a forgotten ``close`` leaves nothing in ``directory``: the
    space is freed when the file is closed. For spools as large as a model, which belong
    beside the file they become, not in a small ``/tmp``.

    Examples:
        >>> import os, tempfile
        >>> d = tempfile.mkdtemp()
        >>> with unnamed_file(d) as f:
        ...     _ = f.write(b"spooled"); _ = f.seek(0)
        ...     f.read(), os.listdir(d)
        (b'spooled', [])
    """
    directory = os.fspath(directory)
    unnamed = getattr(os, "O_TMPFILE", 0)
    if unnamed:
        try:
            fd = os.open(directory, os.O_RDWR | unnamed | getattr(os, "O_CLOEXEC", 0), 0o600)
        except OSError as exc:
            # the file system (or the kernel) has no unnamed files: fall back to a name
            if exc.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL, errno.ENOTSUP):
                raise
        else:
            return _fdopen_or_close(fd)
    tmp: Optional[str] = None
    try:
        for _ in range(100):
            tmp = os.path.join(directory, f".spool.{secrets.token_hex(4)}{_TMP_MARK}")  # armed before it exists
            try:
                fd = os.open(tmp, _SCRATCH | getattr(os, "O_TEMPORARY", 0), 0o600)
                break
            except FileExistsError:  # pragma: no cover - 32 random bits collided: not ours to remove
                tmp = None
        else:  # pragma: no cover
            raise FileExistsError(errno.EEXIST, "could not create a scratch file", directory)
        try:
            if not getattr(os, "O_TEMPORARY", 0):
                os.unlink(tmp)  # POSIX: the open file lives on without a name
        except BaseException:
            os.close(fd)
            raise
        return _fdopen_or_close(fd)
    except BaseException:
        if not getattr(os, "O_TEMPORARY", 0):
            _remove_quietly(tmp)
        raise


def _fdopen_or_close(fd: int) -> IO[bytes]:
    try:
        return os.fdopen(fd, "w+b")
    except BaseException:
        # an interrupt after the file object was made: that object, dropped, closed the fd already
        with contextlib.suppress(OSError):
            os.close(fd)
        raise


def __getattr__(name: str) -> Any:
    if name == "atomic_folder":  # defined in prunekit.io.folders, which builds on this module
        from .folders import atomic_folder

        return atomic_folder
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
