"""The one hostile-input reader: every file prunekit reads is opened here.

Every file is treated as if a stranger wrote it:

* only regular files are read: a FIFO, a device (``/dev/zero``), a socket or a
  directory is refused *before* a byte is read (a FIFO is opened non-blocking,
  so it cannot hang the caller);
* reads are bounded: a text file over its limit is refused, and a safetensors
  header is checked against the file's real size before it is parsed;
* JSON is parsed strictly: duplicate keys, ``NaN``/``Infinity`` and absurd
  nesting are errors, not silently accepted;
* every refusal is an :class:`~prunekit.io.errors.UnreadableFileError` (a
  ``ValueError``) whose message starts with the path and says why.

This module knows files and bytes only; it imports nothing from prunekit
outside :mod:`prunekit.io`.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import stat
from typing import IO, Any, Dict, List, Optional, Tuple, Type

import torch

from .errors import UnreadableFileError

__all__ = [
    "TEXT_LIMIT",
    "file_kind",
    "loads_json_strict",
    "open_regular",
    "open_in_folder",
    "read_json",
    "read_text",
    "read_yaml",
    "read_config",
    "SafetensorsHeader",
    "read_safetensors_header",
    "read_safetensors_tensor",
    "SAFETENSORS_TAGS",
    "read_safetensors",
    "looks_like_safetensors",
]

TEXT_LIMIT = 64 * 1024 * 1024  # configs, descriptions, reports: far below this
SAFETENSORS_HEADER_LIMIT = 100 * 1024 * 1024  # the safetensors library's own limit
_MAX_DEPTH = 64


def file_kind(mode: int) -> str:
    """A word for what a ``st_mode`` is ("a directory", "a FIFO (named pipe)", ...).

    Example:
        >>> import os
        >>> file_kind(os.stat("/dev/null").st_mode), file_kind(os.stat("/").st_mode)
        ('a character device', 'a directory')
    """
    for test, word in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISREG, "a regular file")):
        if test(mode):
            return word
    return "not a regular file"  # pragma: no cover


def open_regular(path: Any, *, error: Type[ValueError] = UnreadableFileError, what: str = "file") -> IO[bytes]:
    """Open ``path`` for binary reading, refusing anything but a regular file before reading it.

    A FIFO is opened non-blocking (so a pipe with no writer cannot hang the
    caller) and then refused, like a device or a directory. Raises ``error``
    (an :class:`UnreadableFileError` by default) naming the path, or
    ``FileNotFoundError`` naming it when nothing is there.

    Example:
        >>> import os, tempfile
        >>> d = tempfile.mkdtemp(); os.mkfifo(os.path.join(d, "pipe"))
        >>> try:
        ...     open_regular(os.path.join(d, "pipe"))
        ... except UnreadableFileError as e:
        ...     print(str(e)[len(d):])
        /pipe: not a regular file (a FIFO (named pipe)); give a file
    """
    path = os.fspath(path)
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise FileNotFoundError(f"{what} not found: {path}") from None
    except IsADirectoryError:  # pragma: no cover - Linux opens directories read-only
        raise error(f"{path}: not a regular file (a directory); give a {what}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise error(f"{path}: not a regular file ({file_kind(st.st_mode)}); give a {what}")
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def open_in_folder(folder: Any, name: Any, *, dir_fd: Optional[int] = None,
                   error: Type[ValueError] = UnreadableFileError, what: str = "file") -> IO[bytes]:
    """Open the file ``name`` of ``folder`` like :func:`open_regular`, refusing every way out of the folder.

    ``name`` usually comes from a hostile index (a ``weight_map``): it must be one
    plain file name -- not absolute, no ``/`` or ``\\``, not ``.`` or ``..``, no
    NUL -- and a symbolic link is refused, not followed (it could lead anywhere),
    as is anything but a regular file (a FIFO is opened non-blocking, so it cannot
    hang the caller). With ``dir_fd``, an open descriptor of ``folder``, the name is
    looked up in that very folder even if ``folder`` has been replaced since.
    Raises ``error`` naming the path and why, or ``FileNotFoundError``.

    Example:
        >>> import os, tempfile
        >>> d = tempfile.mkdtemp(); _ = open(os.path.join(d, "config.json"), "w").write("{}")
        >>> open_in_folder(d, "config.json").read()
        b'{}'
        >>> try:
        ...     open_in_folder(d, "../secret.safetensors")
        ... except UnreadableFileError as e:
        ...     print(str(e)[len(d):])
        : file name '../secret.safetensors' is not a plain file name inside the folder; refusing it
    """
    folder = os.fspath(folder)
    seps = {"/", "\\", os.sep, os.altsep or "/"}
    if (not isinstance(name, str) or name in ("", ".", "..") or "\0" in name or any(c in name for c in seps)
            or len(name) > 255):
        raise error(f"{folder}: {what} name {name!r} is not a plain file name inside the folder; refusing it")
    where = os.path.join(folder, name)
    nofollow = getattr(os, "O_NOFOLLOW", 0)
    flags = (os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0)
             | nofollow)
    try:
        if not nofollow and os.path.islink(where):  # pragma: no cover - systems without O_NOFOLLOW
            raise OSError(errno.ELOOP, "is a symbolic link", where)
        fd = os.open(name, flags, dir_fd=dir_fd) if dir_fd is not None else os.open(where, flags)
    except FileNotFoundError:
        raise FileNotFoundError(errno.ENOENT, f"{what} not found", where) from None
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.EMLINK):  # O_NOFOLLOW on a link (EMLINK on some BSDs)
            raise error(f"{where}: a symbolic link; prunekit reads only the folder's own files, never what a "
                        "link points at (copy the folder with `cp -rL` to read the targets)") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise error(f"{where}: not a regular file ({file_kind(st.st_mode)}); give a {what}")
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        with contextlib.suppress(OSError):
            os.close(fd)
        raise


def read_text(path: Any, *, limit: int = TEXT_LIMIT, what: str = "file") -> str:
    """Read a UTF-8 text file of at most ``limit`` bytes from a regular file.

    Example:
        >>> import os, tempfile
        >>> p = os.path.join(tempfile.mkdtemp(), "a.txt"); _ = open(p, "w").write("hi")
        >>> read_text(p)
        'hi'
    """
    path = os.fspath(path)
    with open_regular(path, what=what) as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise UnreadableFileError(f"{path}: larger than {limit} bytes; a {what} is never that large")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UnreadableFileError(f"{path}: not UTF-8 text (byte {e.start}); give a text {what}") from None


def _no_duplicates(pairs: List[Tuple[str, Any]]) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate key {k!r}")
        out[k] = v
    return out


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _depth(obj: Any, limit: int) -> None:
    stack = [(obj, 1)]
    while stack:
        o, d = stack.pop()
        if d > limit:
            raise ValueError(f"nested deeper than {limit} levels")
        if isinstance(o, dict):
            stack.extend((v, d + 1) for v in o.values())
        elif isinstance(o, list):
            stack.extend((v, d + 1) for v in o)


def loads_json_strict(text: Any, where: str, *, error: Type[ValueError] = UnreadableFileError,
                      max_depth: int = _MAX_DEPTH) -> Any:
    """Parse JSON strictly: duplicate keys, ``NaN``/``Infinity`` and deep nesting are ``error``.

    Example:
        >>> loads_json_strict('{"a": [1, 2]}', "x.json")
        {'a': [1, 2]}
        >>> try:
        ...     loads_json_strict('{"a": 1, "a": 2}', "x.json")
        ... except UnreadableFileError as e:
        ...     print(e)
        x.json: not valid JSON (duplicate key 'a')
    """
    try:
        obj = json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_no_constant)
        _depth(obj, max_depth)
    except RecursionError:
        raise error(f"{where}: not valid JSON (nested too deeply)") from None
    except json.JSONDecodeError as e:
        raise error(f"{where}: not valid JSON ({e.msg}, line {e.lineno} column {e.colno})") from None
    except (ValueError, TypeError) as e:
        raise error(f"{where}: not valid JSON ({e})") from None
    return obj


def read_json(path: Any, *, limit: int = TEXT_LIMIT, what: str = "JSON file") -> Any:
    """Read a JSON file through the hostile reader (regular file, bounded, strict).

    Example:
        >>> import os, tempfile
        >>> p = os.path.join(tempfile.mkdtemp(), "c.json"); _ = open(p, "w").write('{"sparsity": 0.9}')
        >>> read_json(p)
        {'sparsity': 0.9}
    """
    path = os.fspath(path)
    return loads_json_strict(read_text(path, limit=limit, what=what), path)


def read_yaml(path: Any, *, limit: int = TEXT_LIMIT, what: str = "YAML file", max_nodes: int = 1_000_000) -> Any:
    """Read a YAML file with ``yaml.safe_load`` through the hostile reader (an empty file is ``{}``).

    Aliases are allowed, but a document that expands to more than ``max_nodes``
    values (a "billion laughs" file) is refused.

    Example:
        >>> import os, tempfile
        >>> p = os.path.join(tempfile.mkdtemp(), "c.yaml"); _ = open(p, "w").write("target_sparsity: 0.9\\n")
        >>> read_yaml(p)
        {'target_sparsity': 0.9}
    """
    try:
        import yaml
    except ImportError:
        raise ImportError("reading a YAML file needs pyyaml: pip install 'prunekit[yaml]'") from None
    path = os.fspath(path)
    text = read_text(path, limit=limit, what=what)
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        lines = str(e).strip().splitlines()
        raise UnreadableFileError(f"{path}: not valid YAML ({lines[0] if lines else type(e).__name__})") from None
    except RecursionError:
        raise UnreadableFileError(f"{path}: not valid YAML (nested too deeply)") from None
    _count_nodes(data, max_nodes, path)
    return {} if data is None else data


def _count_nodes(obj: Any, limit: int, path: str) -> None:
    seen = 0
    stack = [obj]
    while stack:
        o = stack.pop()
        seen += 1
        if seen > limit:
            raise UnreadableFileError(f"{path}: expands to more than {limit} values (aliases?); refusing it")
        if isinstance(o, dict):
            stack.extend(o.keys())
            stack.extend(o.values())
        elif isinstance(o, (list, tuple)):
            stack.extend(o)


def read_config(path: Any, *, what: str = "config file") -> Any:
    """Read a configuration file: JSON for ``.json``, YAML otherwise (YAML also reads JSON).

    Example:
        >>> import os, tempfile
        >>> p = os.path.join(tempfile.mkdtemp(), "p.json"); _ = open(p, "w").write('{"pattern": "2:4"}')
        >>> read_config(p)
        {'pattern': '2:4'}
    """
    path = os.fspath(path)
    if path.endswith(".json"):
        return read_json(path, what=what)
    return read_yaml(path, what=what)


# ----------------------------------------------------------------------------- safetensors headers
class SafetensorsHeader:
    """A safetensors file's header, validated against the file's real size.

    ``tensors`` maps each name to ``(dtype tag, shape, (begin, end))`` in header
    order; ``metadata`` is the ``__metadata__`` dict of strings (or ``{}``);
    ``data_start`` is the file offset of the byte buffer.
    """

    __slots__ = ("path", "size", "data_start", "tensors", "metadata")

    def __init__(self, path: str, size: int, data_start: int, tensors: Dict[str, Tuple[str, List[int], Tuple[int, int]]],
                 metadata: Dict[str, str]) -> None:
        self.path = path
        self.size = size
        self.data_start = data_start
        self.tensors = tensors
        self.metadata = metadata


# bytes per element of every safetensors dtype tag (sub-byte types are not used by prunekit)
SAFETENSORS_ITEMSIZE = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E4M3FN": 1, "F8_E5M2FNUZ": 1, "F8_E4M3FNUZ": 1,
    "F8_E8M0": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8,
    "F64": 8, "C64": 8,
}


def looks_like_safetensors(head: bytes, size: int) -> bool:
    """Whether the first bytes of a file (of ``size`` bytes) start a safetensors header.

    Example:
        >>> looks_like_safetensors(b"\\x02\\x00\\x00\\x00\\x00\\x00\\x00\\x00{}", 10)
        True
        >>> looks_like_safetensors(b"PK\\x03\\x04", 1000)
        False
    """
    if len(head) < 9:
        return False
    n = int.from_bytes(head[:8], "little")
    return head[8:9] == b"{" and 2 <= n <= min(size - 8, SAFETENSORS_HEADER_LIMIT)


def read_safetensors_header(f: IO[bytes], path: str, *, error: Type[ValueError] = UnreadableFileError) -> SafetensorsHeader:
    """Parse and validate the header of a safetensors file open as ``f`` (a regular file).

    Checks what the format requires and what a hostile file could get wrong:
    the header length against the file's size, strict JSON (no duplicate
    names), known dtypes, non-negative integer shapes, byte ranges that match
    each shape, lie inside the file, do not overlap and cover the buffer
    exactly, and a metadata dict of strings. Work and memory are bounded by the
    header's size.

    Example:
        >>> import os, tempfile, torch
        >>> from safetensors.torch import save_file
        >>> p = os.path.join(tempfile.mkdtemp(), "a.safetensors")
        >>> save_file({"w": torch.zeros(2, 3)}, p, metadata={"k": "v"})
        >>> with open_regular(p) as f:
        ...     h = read_safetensors_header(f, p)
        >>> h.tensors, h.metadata
        ({'w': ('F32', [2, 3], (0, 24))}, {'k': 'v'})
    """
    size = os.fstat(f.fileno()).st_size
    f.seek(0)
    head = f.read(8)
    if len(head) < 8:
        raise error(f"{path}: truncated ({size} bytes), not a safetensors file")
    n = int.from_bytes(head, "little")
    if n < 2 or n > size - 8 or n > SAFETENSORS_HEADER_LIMIT:
        raise error(f"{path}: header length {n} does not fit a file of {size} bytes")
    raw = f.read(n)
    if len(raw) != n:  # pragma: no cover - the file shrank while being read
        raise error(f"{path}: truncated header")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise error(f"{path}: header is not UTF-8 (byte {8 + e.start})") from None
    header = loads_json_strict(text.rstrip(" "), f"{path}: header", error=error, max_depth=5)
    if not isinstance(header, dict):
        raise error(f"{path}: header is a JSON {type(header).__name__}, not an object")
    data_start = 8 + n
    buffer = size - data_start
    metadata = header.pop("__metadata__", None)
    if metadata is None:
        metadata = {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise error(f"{path}: __metadata__ must map strings to strings")
    tensors: Dict[str, Tuple[str, List[int], Tuple[int, int]]] = {}
    spans: List[Tuple[int, int, str]] = []
    for name, info in header.items():
        where = f"{path}: tensor {name!r}"
        if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
            raise error(f"{where}: header entry must hold exactly dtype, shape and data_offsets")
        dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
        if not isinstance(dtype, str) or dtype not in SAFETENSORS_ITEMSIZE:
            raise error(f"{where}: unknown dtype {dtype!r}")
        if not isinstance(shape, list) or not all(type(s) is int and 0 <= s for s in shape) or len(shape) > 64:
            raise error(f"{where}: bad shape {shape!r}")
        if (not isinstance(offsets, list) or len(offsets) != 2 or not all(type(o) is int for o in offsets)
                or not 0 <= offsets[0] <= offsets[1] <= buffer):
            raise error(f"{where}: byte range {offsets!r} lies outside the {buffer}-byte buffer "
                        "(the file is truncated or its header damaged)")
        nbytes = math.prod(shape) * SAFETENSORS_ITEMSIZE[dtype]
        if offsets[1] - offsets[0] != nbytes:
            raise error(f"{where}: byte range {offsets!r} holds {offsets[1] - offsets[0]} bytes, "
                        f"its shape {shape} of {dtype} needs {nbytes}")
        tensors[name] = (dtype, shape, (offsets[0], offsets[1]))
        spans.append((offsets[0], offsets[1], name))
    spans.sort()
    end = 0
    for begin, stop, name in spans:
        if begin != end:
            raise error(f"{path}: tensor {name!r} starts at byte {begin}, expected {end} "
                        "(entries overlap or leave a gap)")
        end = stop
    if end != buffer:
        raise error(f"{path}: the tensors cover {end} bytes of a {buffer}-byte buffer (truncated or padded)")
    return SafetensorsHeader(path, size, data_start, tensors, metadata)


# safetensors dtype tags that this torch knows
SAFETENSORS_TAGS: Dict[str, "torch.dtype"] = {
    tag: getattr(torch, name) for tag, name in (
        ("F64", "float64"), ("F32", "float32"), ("F16", "float16"), ("BF16", "bfloat16"), ("I64", "int64"),
        ("I32", "int32"), ("I16", "int16"), ("I8", "int8"), ("U8", "uint8"), ("BOOL", "bool"),
        ("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2"), ("F8_E4M3FNUZ", "float8_e4m3fnuz"),
        ("F8_E5M2FNUZ", "float8_e5m2fnuz"), ("C64", "complex64"), ("U16", "uint16"), ("U32", "uint32"),
        ("U64", "uint64"))
    if isinstance(getattr(torch, name, None), torch.dtype)
}


def read_safetensors_tensor(f: IO[bytes], header: SafetensorsHeader, key: str) -> "torch.Tensor":
    """Read one tensor of a validated safetensors file, once, from the open file ``f``.

    Example:
        >>> import os, tempfile, torch
        >>> from safetensors.torch import save_file
        >>> p = os.path.join(tempfile.mkdtemp(), "a.safetensors")
        >>> save_file({"w": torch.arange(6.0).reshape(2, 3)}, p)
        >>> with open_regular(p) as f:
        ...     read_safetensors_tensor(f, read_safetensors_header(f, p), "w").tolist()
        [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
    """
    tag, shape, (begin, end) = header.tensors[key]
    dtype = SAFETENSORS_TAGS.get(tag)
    if dtype is None:
        raise UnreadableFileError(f"{header.path}: tensor {key!r} has dtype {tag}, which this torch does not know")
    n = end - begin
    if n == 0:
        return torch.empty(shape, dtype=dtype)
    buf = bytearray(n)
    f.seek(header.data_start + begin)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = f.readinto(view[got:])
        if not k:
            raise UnreadableFileError(f"{header.path}: truncated while reading tensor {key!r}")
        got += k
    return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).reshape(shape)


def read_safetensors(path: Any, *, error: Type[ValueError] = UnreadableFileError) -> "Tuple[Dict[str, torch.Tensor], Dict[str, str]]":
    """Read a whole (plain) safetensors file through the hostile reader: ``(tensors, metadata)``.

    Example:
        >>> import os, tempfile, torch
        >>> from safetensors.torch import save_file
        >>> p = os.path.join(tempfile.mkdtemp(), "a.safetensors")
        >>> save_file({"b": torch.ones(2), "a": torch.zeros(1)}, p)
        >>> sorted(read_safetensors(p)[0])
        ['a', 'b']
    """
    path = os.fspath(path)
    with open_regular(path, error=error, what="safetensors file") as f:
        header = read_safetensors_header(f, path, error=error)
        tensors = {k: read_safetensors_tensor(f, header, k) for k in header.tensors}
    return tensors, dict(header.metadata)
