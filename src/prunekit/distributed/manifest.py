"""The integrity manifest of a distributed checkpoint folder: the size and SHA-256 of every file DCP wrote.

:func:`prunekit.distributed.save` writes ``prunekit-manifest.json`` beside
DCP's files, last and atomically, so a folder without it is an incomplete
save. It reads::

    {"format": "prunekit.distributed.checkpoint", "version": 1,
     "files": {".metadata": {"size": 1566, "sha256": "9f2c..."},
               "__0_0.distcp": {"size": 11036, "sha256": "4b1a..."}}}

Only DCP's own file names are allowed in it (``.metadata`` and
``__<rank>_<n>.distcp``): no folders, no ``..``, no links.

Loading checks each file twice, cheaply: its :class:`Stamp` (device, inode,
size, modification and change times, taken with ``lstat`` -- a link is
refused) when the load starts, and the SHA-256 of its bytes against the
manifest. Every later open compares the opened file's stamp with the first
one, so a file replaced or rewritten after it was hashed is refused rather
than read.

This module knows files and bytes only.
"""

from __future__ import annotations

import hashlib
import os
import re
import stat
from dataclasses import dataclass
from typing import IO, Dict, Iterable, Mapping, Tuple

from ..io.errors import UnreadableFileError
from ..io.reader import file_kind, read_json
from ..io.writer import write_json
from .errors import CorruptDistributedCheckpointError, DistributedCheckpointError

__all__ = [
    "MANIFEST_NAME",
    "METADATA_NAME",
    "Entry",
    "Stamp",
    "hash_file",
    "is_dcp_file",
    "open_stamped",
    "read_manifest",
    "read_stamped",
    "stamp_files",
    "verify_files",
    "write_manifest",
]

FORMAT = "prunekit.distributed.checkpoint"
VERSION = 1
MANIFEST_NAME = "prunekit-manifest.json"
METADATA_NAME = ".metadata"
MANIFEST_LIMIT = 64 * 1024 * 1024
_SHARD = re.compile(r"__[0-9]{1,9}_[0-9]{1,9}\.distcp")
_HEX = re.compile(r"[0-9a-f]{64}")
_CHUNK = 1 << 20


def is_dcp_file(name: str) -> bool:
    """Whether ``name`` is a file name DCP's file system writer gives (``.metadata``, ``__<r>_<n>.distcp``).

    Examples:
        >>> is_dcp_file(".metadata"), is_dcp_file("__1_0.distcp"), is_dcp_file("../x.distcp")
        (True, True, False)
    """
    return name == METADATA_NAME or _SHARD.fullmatch(name) is not None


@dataclass(frozen=True)
class Entry:
    """What the manifest says of one file: its size in bytes and the hex SHA-256 of its bytes."""

    size: int
    sha256: str


@dataclass(frozen=True)
class Stamp:
    """Which file a name pointed to, and in what state: changes when the file is replaced or written."""

    dev: int
    ino: int
    size: int
    mtime_ns: int
    ctime_ns: int

    @staticmethod
    def of(st: os.stat_result) -> "Stamp":
        return Stamp(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _digest(f: IO[bytes]) -> Tuple[int, str]:
    h = hashlib.sha256()
    size = 0
    while True:
        block = f.read(_CHUNK)
        if not block:
            return size, h.hexdigest()
        size += len(block)
        h.update(block)


def hash_file(path: str) -> Entry:
    """The :class:`Entry` of a regular file (a link or anything else is refused).

    Examples:
        >>> import os, tempfile
        >>> p = os.path.join(tempfile.mkdtemp(), "a.bin"); _ = open(p, "wb").write(b"abc")
        >>> hash_file(p).size, hash_file(p).sha256[:8]
        (3, 'ba7816bf')
    """
    with _open_nofollow(path) as f:
        size, digest = _digest(f)
    return Entry(size, digest)


def write_manifest(folder: str, files: Mapping[str, Entry]) -> None:
    """Write the manifest of ``folder`` (atomically: it appears whole or not at all).

    Examples:
        >>> import os, tempfile
        >>> d = tempfile.mkdtemp(); p = os.path.join(d, ".metadata"); _ = open(p, "wb").write(b"abc")
        >>> write_manifest(d, {".metadata": hash_file(p)})
        >>> read_manifest(d)[".metadata"].size
        3
    """
    for name in files:
        if not is_dcp_file(name):
            raise ValueError(f"{folder}: {name!r} is not a file name DCP writes; the manifest lists only DCP's files")
    doc = {"format": FORMAT, "version": VERSION,
           "files": {n: {"size": e.size, "sha256": e.sha256} for n, e in sorted(files.items())}}
    write_json(os.path.join(folder, MANIFEST_NAME), doc, indent=1)


def _bad(folder: str, why: str) -> CorruptDistributedCheckpointError:
    return CorruptDistributedCheckpointError(f"{folder}: {MANIFEST_NAME} {why}; save the checkpoint again")


def read_manifest(folder: str) -> Dict[str, Entry]:
    """The files the manifest of ``folder`` lists, checked for form (not yet against the files).

    Raises :class:`DistributedCheckpointError` when the folder has no manifest
    (an incomplete save, or a folder ``prunekit.distributed.save`` did not
    write) and :class:`CorruptDistributedCheckpointError` when it is malformed.
    """
    path = os.path.join(folder, MANIFEST_NAME)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        if not os.path.isdir(folder):
            raise DistributedCheckpointError(f"{folder}: no such checkpoint folder") from None
        raise DistributedCheckpointError(
            f"{folder}: no {MANIFEST_NAME}: the folder is an incomplete save (it is written last) or was not "
            "written by prunekit.distributed.save; save the checkpoint with prunekit.distributed.save") from None
    except OSError as e:
        raise DistributedCheckpointError(f"{folder}: cannot read {MANIFEST_NAME}: {e.strerror or e}") from None
    if not stat.S_ISREG(st.st_mode):
        raise _bad(folder, f"is {'a symbolic link' if stat.S_ISLNK(st.st_mode) else file_kind(st.st_mode)}, "
                   "not a regular file")
    try:
        doc = read_json(path, limit=MANIFEST_LIMIT, what="checkpoint manifest")
    except (UnreadableFileError, OSError) as e:
        raise _bad(folder, f"cannot be read ({e})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or set(doc) != {"format", "version", "files"}:
        raise _bad(folder, f"is not a manifest (it must hold exactly format={FORMAT!r}, version and files)")
    if doc["version"] != VERSION or type(doc["version"]) is not int:
        raise _bad(folder, f"has version {doc['version']!r}; this prunekit reads version {VERSION}")
    files = doc["files"]
    if not isinstance(files, dict) or METADATA_NAME not in files:
        raise _bad(folder, f"lists no {METADATA_NAME}")
    out: Dict[str, Entry] = {}
    for name, listed in files.items():
        if not is_dcp_file(name):
            raise _bad(folder, f"lists {name!r}, which is not a file name DCP writes")
        if (not isinstance(listed, dict) or set(listed) != {"size", "sha256"} or type(listed["size"]) is not int
                or listed["size"] < 0 or not isinstance(listed["sha256"], str)
                or _HEX.fullmatch(listed["sha256"]) is None):
            raise _bad(folder, f"has a malformed entry for {name!r} (it needs a size and a hex sha256)")
        out[name] = Entry(listed["size"], listed["sha256"])
    return out


def stamp_files(folder: str, files: Mapping[str, Entry]) -> Dict[str, Stamp]:
    """The :class:`Stamp` of every listed file; a missing, linked, non-regular or resized file is refused."""
    stamps: Dict[str, Stamp] = {}
    for name, entry in sorted(files.items()):
        path = os.path.join(folder, name)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            raise CorruptDistributedCheckpointError(
                f"{folder}: {name} is missing (the manifest lists it); the checkpoint is incomplete") from None
        except OSError as e:
            raise DistributedCheckpointError(f"{folder}: cannot read {name}: {e.strerror or e}") from None
        if not stat.S_ISREG(st.st_mode):
            kind = "a symbolic link" if stat.S_ISLNK(st.st_mode) else file_kind(st.st_mode)
            raise CorruptDistributedCheckpointError(f"{folder}: {name} is {kind}, not a regular file")
        if st.st_size != entry.size:
            raise CorruptDistributedCheckpointError(
                f"{folder}: {name} has {st.st_size} bytes, the manifest says {entry.size} (truncated or altered)")
        stamps[name] = Stamp.of(st)
    return stamps


def _open_nofollow(path: str) -> IO[bytes]:
    flags = (os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
             | getattr(os, "O_BINARY", 0))
    fd = os.open(path, flags)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnreadableFileError(f"{path}: not a regular file ({file_kind(st.st_mode)})")
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def open_stamped(folder: str, name: str, stamp: Stamp) -> IO[bytes]:
    """Open ``folder/name`` for reading if it is still the file :func:`stamp_files` saw, unchanged."""
    path = os.path.join(folder, name)
    try:
        f = _open_nofollow(path)
    except (OSError, UnreadableFileError) as e:
        raise CorruptDistributedCheckpointError(
            f"{folder}: {name} cannot be opened any more ({getattr(e, 'strerror', None) or e}); it was replaced "
            "while the checkpoint was being loaded") from None
    try:
        if Stamp.of(os.fstat(f.fileno())) != stamp:
            raise CorruptDistributedCheckpointError(
                f"{folder}: {name} changed while the checkpoint was being loaded; load it again when nothing "
                "writes to the folder")
        return f
    except BaseException:
        f.close()
        raise


def _check(folder: str, name: str, entry: Entry, size: int, digest: str) -> None:
    if size != entry.size or digest != entry.sha256:
        raise CorruptDistributedCheckpointError(
            f"{folder}: {name} does not match the manifest (its SHA-256 differs: the file was altered or damaged "
            "after it was saved); the checkpoint cannot be trusted")


def verify_files(folder: str, files: Mapping[str, Entry], stamps: Mapping[str, Stamp], names: Iterable[str]) -> None:
    """Hash each of ``names`` and compare with the manifest; each must still carry its stamp after hashing."""
    for name in names:
        with open_stamped(folder, name, stamps[name]) as f:
            size, digest = _digest(f)
            if Stamp.of(os.fstat(f.fileno())) != stamps[name]:
                raise CorruptDistributedCheckpointError(
                    f"{folder}: {name} changed while it was being verified; load it again when nothing writes "
                    "to the folder")
        _check(folder, name, files[name], size, digest)


def read_stamped(folder: str, name: str, entry: Entry, stamp: Stamp) -> bytes:
    """The bytes of ``folder/name``, read once, checked against the manifest (for ``.metadata``)."""
    with open_stamped(folder, name, stamp) as f:
        data = f.read(entry.size + 1)
    _check(folder, name, entry, len(data), hashlib.sha256(data).hexdigest())
    return data
