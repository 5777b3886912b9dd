"""The table of encodings: every file format prunekit reads or writes is one entry.

An :class:`Encoding` names the format, the functions that write and read it
(as ``"module:function"`` strings, imported on first use, so an optional
dependency is needed only by the format that uses it), the pip extra it needs,
and how to recognise it from a :class:`Probe` of a file. A new format -- say
another library's checkpoint layout -- is one :func:`register_encoding` call.

:func:`save` and :func:`read` dispatch through the table;
:func:`prunekit.io.save_compressed` is ``save`` with prunekit's own
format as the default and :func:`prunekit.io.read_checkpoint` is ``read``
that returns a state dict and the kind of file it was.
"""

from __future__ import annotations

import importlib
import os
import stat
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Optional, Tuple

from .reader import SafetensorsHeader, looks_like_safetensors, open_regular, read_safetensors_header

__all__ = ["Encoding", "Probe", "ENCODINGS", "register_encoding", "encoding", "probe", "save", "read"]


@dataclass
class Probe:
    """What can be learnt about a path cheaply and safely, without decoding it.

    ``kind`` is ``"file"`` or ``"directory"``; for a file, ``head`` holds its
    first bytes and ``safetensors`` its validated safetensors header (or None
    when it is not one); for a directory, ``entries`` lists its names.
    """

    path: str
    kind: str
    size: int = 0
    head: bytes = b""
    safetensors: Optional[SafetensorsHeader] = None
    safetensors_error: Optional[str] = None
    entries: Tuple[str, ...] = ()


@dataclass(frozen=True)
class Encoding:
    """One file format: its name, writer, reader, extra and recogniser.

    ``writer(obj, path, **options)`` writes; ``reader(path, **options)`` returns a
    state dict (a mapping of names to tensors) or raises. ``claims(probe)`` says
    whether a file is in this format; the table is tried in order.
    """

    name: str
    summary: str
    writer: Optional[str] = None
    reader: Optional[str] = None
    claims: Optional[Callable[[Probe], bool]] = None
    extra: Optional[str] = None
    aliases: Tuple[str, ...] = field(default_factory=tuple)

    def _resolve(self, spec: Optional[str], verb: str) -> Callable[..., Any]:
        if spec is None:
            can = [n for n, e in ENCODINGS.items() if (e.writer if verb == "write" else e.reader)]
            raise ValueError(f"format {self.name!r} cannot be {verb}ten by prunekit; formats that can: {can}"
                             if verb == "write" else
                             f"format {self.name!r} cannot be read by prunekit; formats that can: {can}")
        module, _, attr = spec.partition(":")
        return getattr(importlib.import_module(module, __package__), attr)

    def write(self, obj: Any, path: Any, **options: Any) -> Any:
        return self._resolve(self.writer, "write")(obj, path, **options)

    def read(self, path: Any, **options: Any) -> Any:
        return self._resolve(self.reader, "read")(path, **options)


ENCODINGS: Dict[str, Encoding] = {}


def register_encoding(enc: Encoding, *, replace: bool = False) -> Encoding:
    """Add a format to the table (tried for reading after those already there).

    Examples:
        >>> from prunekit.io.formats import Encoding, register_encoding, ENCODINGS
        >>> enc = register_encoding(Encoding("example-npz", "numpy's npz (example)", reader="numpy:load"))
        >>> "example-npz" in ENCODINGS
        True
        >>> del ENCODINGS["example-npz"]
    """
    if not isinstance(enc, Encoding):
        raise TypeError(f"register_encoding: expected an Encoding, got {type(enc).__name__}")
    taken = {a: n for n, e in ENCODINGS.items() for a in (n, *e.aliases)}
    for name in (enc.name, *enc.aliases):
        if name in taken and not (replace and taken[name] == enc.name):
            raise ValueError(f"register_encoding: format name {name!r} is taken by {taken[name]!r}; "
                             "pick another name or pass replace=True")
    ENCODINGS[enc.name] = enc
    return enc


def encoding(name: str) -> Encoding:
    """The table entry for ``name`` (or one of its aliases).

    Examples:
        >>> encoding("prunekit").name
        'prunekit-compressed'
    """
    for n, e in ENCODINGS.items():
        if name == n or name in e.aliases:
            return e
    known = sorted(a for n, e in ENCODINGS.items() for a in (n, *e.aliases))
    raise ValueError(f"unknown format {name!r}; known formats: {known}")


def probe(path: Any) -> Probe:
    """Look at ``path`` safely: refuse non-regular files, read the head, validate a safetensors header.

    Examples:
        >>> import os, tempfile, torch
        >>> p = os.path.join(tempfile.mkdtemp(), "m.pt"); torch.save({"w": torch.ones(1)}, p)
        >>> pr = probe(p); pr.kind, pr.head[:2], pr.safetensors is None
        ('file', b'PK', True)
    """
    path = os.fspath(path)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise FileNotFoundError(f"checkpoint file not found: {path}; give the path of a .pt, .pth or "
                                ".safetensors file") from None
    if stat.S_ISDIR(st.st_mode):
        return Probe(path, "directory", entries=tuple(sorted(os.listdir(path))))
    with open_regular(path, what="checkpoint file") as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(64)
        header, err = None, None
        if looks_like_safetensors(head, size) or path.endswith(".safetensors"):
            try:
                header = read_safetensors_header(f, path)
            except ValueError as e:
                err = str(e)
    return Probe(path, "file", size=size, head=head, safetensors=header, safetensors_error=err)


def save(obj: Any, path: Any, *, format: str = "prunekit-compressed", **options: Any) -> Any:
    """Write ``obj`` at ``path`` in ``format`` (an entry of :data:`ENCODINGS`).

    Examples:
        >>> import os, tempfile, torch
        >>> p = os.path.join(tempfile.mkdtemp(), "m.safetensors")
        >>> save({"w": torch.zeros(8)}, p, format="safetensors")
        >>> read(p)[1]
        'safetensors'
    """
    return encoding(format).write(obj, path, **options)


def read(path: Any, *, format: Optional[str] = None, **options: Any) -> Tuple[Any, str]:
    """Read ``path``: in ``format``, or in the first format of the table that claims it; ``(data, format)``.

    Examples:
        >>> import os, tempfile, torch
        >>> p = os.path.join(tempfile.mkdtemp(), "m.pt"); torch.save({"w": torch.ones(2)}, p)
        >>> sd, kind = read(p); kind, sd["w"].tolist()
        ('torch', [1.0, 1.0])
    """
    if format is not None:
        enc = encoding(format)
        return enc.read(path, **options), enc.name
    pr = probe(path)
    for enc in ENCODINGS.values():
        if enc.reader and enc.claims is not None and enc.claims(pr):
            return enc.read(pr.path, **options), enc.name
    if pr.kind == "directory":
        raise IsADirectoryError(f"{pr.path} is a directory; give a checkpoint file (or a Hugging Face "
                                "folder in the compressed-tensors layout)")
    raise ValueError(f"{pr.path}: no format of prunekit's table reads this file")  # pragma: no cover
