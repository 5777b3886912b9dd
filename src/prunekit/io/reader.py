"""The one hostile-input reader: every file prunekit reads is opened here.

Every file is treated as if a stranger wrote it:

* only regular files are read: a FIFO, a device (``/dev/zero``), a socket or a
  directory is refused *before* a byte is read (a FIFO is opened non-blocking,
  so it cannot hang the caller);
* reads are bounded: a file's size is checked before anything is allocated
  (a config over 1 MiB, a text over 64 MiB, a key over its limit is refused,
  never cut short), and a safetensors header is checked against the file's
  real size before it is parsed;
* JSON is parsed strictly: duplicate keys, ``NaN``/``Infinity`` and absurd
  nesting are errors, not silently accepted;
* YAML is parsed safely (no Python objects) by libyaml's C parser when pyyaml
  has it, and its node graph is checked before anything is built: aliases
  that expand past a bound, recursive aliases, deep nesting, duplicate keys
  and absurd numbers are errors;
* nothing here unpickles: ``torch.save`` files are read by
  :mod:`prunekit.io.checkpoint`, with ``weights_only=True`` unless the caller
  trusts the file and asks for no key;
* every refusal is an :class:`~prunekit.io.errors.UnreadableFileError` (a
  ``ValueError``) whose message starts with the path and says why.

This module knows files and bytes only; it imports nothing from prunekit
outside :mod:`prunekit.io`.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import stat
from typing import IO, Any, Dict, List, Optional, Sequence, Tuple, Type, cast


from .errors import UnreadableFileError

__all__ = [
    "TEXT_LIMIT",
    "CONFIG_LIMIT",
    "YAML_MAX_VALUES",
    "read_bytes",
    "loads_yaml_strict",
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

    Examples:
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

    Examples:
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

    Examples:
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

    Examples:
        >>> import os, tempfile
        >>> p = os.path.join(tempfile.mkdtemp(), "a.txt"); _ = open(p, "w").write("hi")
        >>> read_text(p)
        'hi'
    """
    path = os.fspath(path)
    data = read_bytes(path, limit=limit, what=what)
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

    Examples:
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

    Examples:
        >>> import os, tempfile
        >>> p = os.path.join(tempfile.mkdtemp(), "c.json"); _ = open(p, "w").write('{"sparsity": 0.9}')
        >>> read_json(p)
        {'sparsity': 0.9}
    """
    path = os.fspath(path)
    return loads_json_strict(read_text(path, limit=limit, what=what), path)


def read_bytes(path: Any, *, limit: int, what: str = "file") -> bytes:
    """Read a whole regular file of at most ``limit`` bytes; a larger one is refused, never cut short.

    The size is checked (``fstat``) before anything is allocated, and the read
    stops at ``limit + 1`` bytes whatever the file claims.

    Examples:
        >>> import os, tempfile
        >>> p = os.path.join(tempfile.mkdtemp(), "k.key"); _ = open(p, "wb").write(b"s3cret")
        >>> read_bytes(p, limit=64, what="key file")
        b's3cret'
        >>> try:
        ...     read_bytes(p, limit=4, what="key file")
        ... except UnreadableFileError as e:
        ...     print(str(e)[len(p):])
        : larger than 4 bytes (6 bytes); a key file is never that large
    """
    path = os.fspath(path)
    with open_regular(path, what=what) as f:
        size = os.fstat(f.fileno()).st_size
        if size > limit:
            raise UnreadableFileError(f"{path}: larger than {limit} bytes ({size} bytes); a {what} is never that large")
        data = f.read(size + 1)  # a file still growing is caught below
        if len(data) > size:
            data += f.read(limit + 1 - len(data))
    if len(data) > limit:
        raise UnreadableFileError(f"{path}: larger than {limit} bytes; a {what} is never that large")
    return data


# ----------------------------------------------------------------------------- YAML
CONFIG_LIMIT = 1024 * 1024  # a pruning or Neural Compressor config is kilobytes, never a megabyte
YAML_MAX_VALUES = 100_000  # values a config may hold, aliases expanded
_MAX_NUMBER_CHARS = 100  # a YAML 1.1 sexagesimal int ("1:2:3:...") costs quadratic time in its length
_YAML_NUMBERS = ("tag:yaml.org,2002:int", "tag:yaml.org,2002:float")
_YAML_MERGE = "tag:yaml.org,2002:merge"
_YAML_LOADERS: Dict[Tuple[Tuple[str, ...], int], Any] = {}


def _clip(text: str, n: int = 200) -> str:
    return text if len(text) <= n else text[:n] + "..."


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return lines[0] if lines else type(e).__name__


def _yaml_loader(mapping_tags: Tuple[str, ...], max_depth: int = _MAX_DEPTH) -> Any:
    """A safe loader class (libyaml's C parser when pyyaml has it) that builds a dict for each tag given.

    libyaml refuses nesting past 1,000 levels itself; pyyaml's pure-Python
    scanner costs time in proportion to the nesting level for every token, so
    without libyaml a flow collection deeper than ``max_depth`` is refused as
    it is scanned.
    """
    import yaml

    loader = _YAML_LOADERS.get((mapping_tags, max_depth))
    if loader is None:
        base = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
        body: Dict[str, Any] = {}
        if base is yaml.SafeLoader:
            def fetch_flow_collection_start(ld: Any, token_class: Any) -> Any:
                if ld.flow_level >= max_depth:
                    raise yaml.scanner.ScannerError(None, None, f"nested deeper than {max_depth} levels",
                                                    ld.get_mark())
                return base.fetch_flow_collection_start(ld, token_class)

            body["fetch_flow_collection_start"] = fetch_flow_collection_start
        loader = cast(Any, type("PrunekitYamlLoader", (base,), body))  # pyyaml is untyped: its loaders are Any

        def as_dict(ld: Any, node: Any) -> Dict[Any, Any]:
            if not isinstance(node, yaml.MappingNode):
                raise yaml.constructor.ConstructorError(None, None, f"{node.tag} needs a mapping of keys",
                                                        node.start_mark)
            return dict(ld.construct_mapping(node, deep=True))

        for tag in mapping_tags:
            loader.add_constructor(tag, as_dict)
        _YAML_LOADERS[(mapping_tags, max_depth)] = loader
    return loader


def _yaml_reason(e: BaseException) -> str:
    """What a pyyaml error says, in one short line with its place in the file."""
    problem = ", ".join(str(p) for p in (getattr(e, "context", None), getattr(e, "problem", None)) if p)
    mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
    if not problem:
        problem = _first_line(e)
    where = f", line {mark.line + 1} column {mark.column + 1}" if mark is not None else ""
    return _clip(str(problem)) + where


def _check_yaml_graph(root: Any, where: str, max_values: int, max_depth: int,
                      error: Type[ValueError]) -> None:
    """Refuse a composed YAML document before it is built: alias bombs, recursion, depth, duplicate keys.

    Works on pyyaml's node graph (each anchored node once), iteratively, so its
    cost is bounded by the file's size whatever the aliases expand to.
    """
    import yaml

    size: Dict[int, int] = {}
    height: Dict[int, int] = {}
    on_path: set = set()
    stack: List[Tuple[Any, bool]] = [(root, False)]

    def line(node: Any) -> str:
        return f"line {node.start_mark.line + 1}"

    while stack:
        node, finished = stack.pop()
        nid = id(node)
        if isinstance(node, yaml.MappingNode):
            kids = [n for pair in node.value for n in pair]
        elif isinstance(node, yaml.SequenceNode):
            kids = node.value
        else:
            kids = []
        if finished:
            on_path.discard(nid)
            n = 1 + sum(size[id(k)] for k in kids)
            h = 1 + max((height[id(k)] for k in kids), default=0)
            if n > max_values:
                how = " through aliases (a 'billion laughs' document?)" if len(size) + 1 < n else ""
                raise error(f"{where}: expands to more than {max_values} values{how}; refusing it")
            if h > max_depth:
                raise error(f"{where}: not valid YAML (nested deeper than {max_depth} levels, {line(node)})")
            size[nid], height[nid] = n, h
            continue
        if nid in size:
            continue
        if nid in on_path:
            raise error(f"{where}: an alias refers to a value that contains it ({line(node)}); "
                        "a recursive document is never a config")
        if isinstance(node, yaml.ScalarNode):
            if node.tag in _YAML_NUMBERS and len(node.value) > _MAX_NUMBER_CHARS:
                raise error(f"{where}: a number {len(node.value)} characters long ({line(node)}); "
                            f"write at most {_MAX_NUMBER_CHARS}")
        elif isinstance(node, yaml.MappingNode):
            seen: set = set()
            for k, _ in node.value:
                if isinstance(k, yaml.ScalarNode) and k.tag != _YAML_MERGE:
                    if (k.tag, k.value) in seen:
                        raise error(f"{where}: not valid YAML (duplicate key {_clip(k.value, 80)!r}, {line(k)}); "
                                    "keep one")
                    seen.add((k.tag, k.value))
        on_path.add(nid)
        stack.append((node, True))
        stack.extend((k, False) for k in kids if id(k) not in size)


def loads_yaml_strict(text: str, where: str, *, error: Type[ValueError] = UnreadableFileError,
                      max_values: int = YAML_MAX_VALUES, max_depth: int = _MAX_DEPTH,
                      mapping_tags: Sequence[str] = ()) -> Any:
    """Parse one YAML document safely and strictly; every problem is ``error`` naming ``where``.

    ``yaml.safe_load`` semantics (no Python objects), through libyaml's C parser
    when pyyaml has it. Before anything is built, the document is refused if
    its aliases expand it past ``max_values`` values (a "billion laughs"
    file), if an alias refers to its own container, if it nests deeper than
    ``max_depth`` levels, if a mapping repeats a key, or if a number is absurdly
    long. ``mapping_tags`` are local tags (such as ``"!Pruner"``) read as
    plain dicts. An empty document is ``None``.

    Examples:
        >>> loads_yaml_strict("sparsity: 0.9\\nnames: [fc1, fc2]\\n", "c.yaml")
        {'sparsity': 0.9, 'names': ['fc1', 'fc2']}
        >>> try:
        ...     loads_yaml_strict("a: &x [1, 1]\\nb: &y [*x, *x]\\nc: [*y, *y]", "c.yaml", max_values=10)
        ... except UnreadableFileError as e:
        ...     print(e)
        c.yaml: expands to more than 10 values through aliases (a 'billion laughs' document?); refusing it
    """
    try:
        import yaml
    except ImportError:
        raise ImportError("reading a YAML file needs pyyaml: pip install 'prunekit[yaml]'") from None
    loader = _yaml_loader(tuple(mapping_tags), max_depth)(text)
    try:
        try:
            node = loader.get_single_node()
        except yaml.YAMLError as e:
            raise error(f"{where}: not valid YAML ({_yaml_reason(e)})") from None
        except RecursionError:
            raise error(f"{where}: not valid YAML (nested too deeply)") from None
        if node is None:
            return None
        _check_yaml_graph(node, where, max_values, max_depth, error)
        try:
            return loader.construct_document(node)
        except yaml.YAMLError as e:
            raise error(f"{where}: not valid YAML ({_yaml_reason(e)})") from None
        except RecursionError:  # pragma: no cover - the depth was checked above
            raise error(f"{where}: not valid YAML (nested too deeply)") from None
        except (ValueError, OverflowError) as e:  # a timestamp, number or binary value pyyaml cannot build
            raise error(f"{where}: not valid YAML ({_clip(_first_line(e))})") from None
        except (TypeError, AttributeError, KeyError, IndexError) as e:  # an explicit tag on a value it cannot take
            raise error(f"{where}: not valid YAML (a tagged value pyyaml cannot build: "
                        f"{type(e).__name__} {_clip(_first_line(e))})") from None
    finally:
        loader.dispose()


def read_yaml(path: Any, *, limit: int = CONFIG_LIMIT, what: str = "YAML file",
              max_values: int = YAML_MAX_VALUES, mapping_tags: Sequence[str] = ()) -> Any:
    """Read a YAML config through the hostile reader (an empty file is ``{}``).

    A regular file of at most ``limit`` bytes (1 MiB by default: a config is
    kilobytes), UTF-8, parsed by :func:`loads_yaml_strict` (safe, strict, alias
    bombs refused before they expand).

    Examples:
        >>> import os, tempfile
        >>> p = os.path.join(tempfile.mkdtemp(), "c.yaml"); _ = open(p, "w").write("target_sparsity: 0.9\\n")
        >>> read_yaml(p)
        {'target_sparsity': 0.9}
    """
    path = os.fspath(path)
    text = read_text(path, limit=limit, what=what)
    data = loads_yaml_strict(text, path, max_values=max_values, mapping_tags=mapping_tags)
    return {} if data is None else data


def read_config(path: Any, *, what: str = "config file", limit: int = CONFIG_LIMIT,
                mapping_tags: Sequence[str] = ()) -> Any:
    """Read a configuration file: strict JSON for ``.json``, YAML otherwise; at most ``limit`` bytes.

    Examples:
        >>> import os, tempfile
        >>> p = os.path.join(tempfile.mkdtemp(), "p.json"); _ = open(p, "w").write('{"pattern": "2:4"}')
        >>> read_config(p)
        {'pattern': '2:4'}
    """
    path = os.fspath(path)
    if path.endswith(".json"):
        return read_json(path, limit=limit, what=what)
    return read_yaml(path, limit=limit, what=what, mapping_tags=mapping_tags)


# the safetensors part of the boundary lives in its own module; its names are part of this one's
from .safetensors_reader import (  # noqa: E402,F401
    SAFETENSORS_ITEMSIZE,
    SAFETENSORS_TAGS,
    SafetensorsHeader,
    looks_like_safetensors,
    read_safetensors,
    read_safetensors_header,
    read_safetensors_tensor,
)
