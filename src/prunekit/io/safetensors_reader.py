"""The safetensors part of the reading boundary: a file's header validated against its real size, and its
tensors read one at a time without trusting any offset or shape the header claims.

``prunekit.io.reader`` re-exports every name here; read through it.
"""

from __future__ import annotations

import io
import math
import os
from typing import IO, Any, Dict, List, Tuple, Type, cast

import torch

from .errors import UnreadableFileError
from .reader import SAFETENSORS_HEADER_LIMIT, loads_json_strict, open_regular

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

    Examples:
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

    Examples:
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

    Examples:
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
    # every binary file (and BytesIO) has readinto, though typing.IO does not declare it
    readinto = cast(io.BufferedIOBase, f).readinto
    got = 0
    while got < n:
        k = readinto(view[got:])
        if not k:
            raise UnreadableFileError(f"{header.path}: truncated while reading tensor {key!r}")
        got += k
    return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).reshape(shape)


def read_safetensors(path: Any, *, error: Type[ValueError] = UnreadableFileError) -> "Tuple[Dict[str, torch.Tensor], Dict[str, str]]":
    """Read a whole (plain) safetensors file through the hostile reader: ``(tensors, metadata)``.

    Examples:
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
