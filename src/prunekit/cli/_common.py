"""Shared pieces of the ``prunekit`` command: errors, argument parsing, loading, output."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import math
import os
import sys
from typing import Any, Dict, List, Literal, Mapping, Optional, Sequence, Tuple

from ..errors import first_line as first_line  # the one helper; the cli modules import it from here

USAGE_ERROR = 2
FAILURE = 1


class CliError(Exception):
    """A failure the command reports as one line; ``code`` 2 for bad arguments, 1 otherwise."""

    def __init__(self, message: str, code: int = USAGE_ERROR) -> None:
        super().__init__(message)
        self.code = code


class Parser(argparse.ArgumentParser):
    """argparse that reports a bad argument as one line (exit code 2) instead of usage + message."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise CliError(f"{message} (see '{self.prog} --help')", USAGE_ERROR)


# ----------------------------------------------------------------------------- argument types
def amount_type(text: str) -> float:
    """A sparsity amount: a fraction in [0, 1]."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"amount {text!r} is not a number; write a fraction such as 0.5") from None
    if not math.isfinite(value) or not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(
            f"amount {text} is out of range; write the fraction of weights to prune, in [0, 1], e.g. 0.5"
        )
    return value


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} must be an integer >= 1")
    return value


def shape_type(text: str) -> Tuple[int, ...]:
    """An input shape such as ``1,3,32,32`` (or ``1x3x32x32``)."""
    parts = text.replace("x", ",").replace(" ", "").split(",")
    try:
        shape = tuple(int(p) for p in parts if p != "")
    except ValueError:
        raise argparse.ArgumentTypeError(f"input shape {text!r}: write integers separated by commas, e.g. 1,3,32,32") from None
    if not shape or any(s < 1 for s in shape):
        raise argparse.ArgumentTypeError(f"input shape {text!r}: write positive integers, e.g. 1,3,32,32")
    return shape


def existing_file(path: str, what: str = "file") -> str:
    if not os.path.exists(path):
        raise CliError(f"{what} not found: {path}")
    if os.path.isdir(path):
        raise CliError(f"{what} {path} is a directory; give a file")
    return path


def writable_path(path: str, what: str = "output") -> str:
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise CliError(f"{what} folder does not exist: {parent}")
    if os.path.isdir(path):
        raise CliError(f"{what} {path} is a directory; give a file name")
    return path


# ----------------------------------------------------------------------------- loading models
def load_factory(spec: str, kwargs_json: Optional[str] = None) -> Any:
    """Build the model from ``package.module:function`` or ``path/to/file.py:function``."""
    from torch import nn

    if ":" not in spec:
        raise CliError(f"--model {spec!r}: write 'package.module:function' or 'path/to/file.py:function'")
    target, _, attr = spec.rpartition(":")
    if not target or not attr:
        raise CliError(f"--model {spec!r}: write 'package.module:function' or 'path/to/file.py:function'")
    kwargs: Dict[str, Any] = {}
    if kwargs_json:
        try:
            kwargs = json.loads(kwargs_json)
        except json.JSONDecodeError as e:
            raise CliError(f"--model-kwargs is not valid JSON ({e.msg}); write e.g. '{{\"num_classes\": 10}}'") from None
        if not isinstance(kwargs, dict):
            raise CliError("--model-kwargs must be a JSON object, e.g. '{\"num_classes\": 10}'")
    try:
        if target.endswith(".py") or os.sep in target:
            if not os.path.isfile(target):
                raise CliError(f"--model: no such file: {target}")
            name = "_prunekit_factory_" + os.path.splitext(os.path.basename(target))[0]
            spec_ = importlib.util.spec_from_file_location(name, target)
            if spec_ is None or spec_.loader is None:
                raise CliError(f"--model: cannot import {target}")
            module = importlib.util.module_from_spec(spec_)
            sys.modules[name] = module
            spec_.loader.exec_module(module)
        else:
            module = importlib.import_module(target)
    except CliError:
        raise
    except ImportError as e:
        raise CliError(f"--model {spec!r}: cannot import {target!r} ({e})") from None
    factory = module
    for part in attr.split("."):
        if not hasattr(factory, part):
            raise CliError(f"--model {spec!r}: {target!r} has no attribute {part!r}")
        factory = getattr(factory, part)
    if not callable(factory):
        raise CliError(f"--model {spec!r}: {attr!r} is not callable")
    try:
        model = factory(**kwargs)
    except TypeError as e:
        raise CliError(f"--model {spec!r}: calling {attr}(**{kwargs}) failed: {e}") from None
    if not isinstance(model, nn.Module):
        raise CliError(f"--model {spec!r}: {attr}() returned a {type(model).__name__}, not a torch.nn.Module")
    return model


KEY_ENV = "PRUNEKIT_KEY"
KEY_LIMIT = 64 * 1024  # a secret is tens of bytes; a larger "key file" is the wrong file


def read_key(key_file: Optional[str]) -> Optional[bytes]:
    """The secret that verifies signed checkpoints: the bytes of ``--key-file`` (exactly as stored), else
    the bytes of the ``PRUNEKIT_KEY`` environment variable (UTF-8 for text), else ``None``. Never a
    command-line value: other users of the machine can read a process's arguments. The key file goes
    through the hostile reader: a regular file of at most 64 KiB (a FIFO, a device or a larger file
    exits 2, never cut short)."""
    if key_file is not None:
        from prunekit.io.reader import read_bytes

        existing_file(key_file, "key file")
        try:
            key = read_bytes(key_file, limit=KEY_LIMIT, what="key file")
        except ValueError as e:
            raise CliError(_why(key_file, e)) from None
        except OSError as e:
            raise CliError(f"cannot read key file {key_file}: {e.strerror or e}") from None
        if not key:
            raise CliError(f"key file {key_file} is empty; it must hold the secret given to "
                           "save_compressed(..., key=...)")
        return key
    env = os.environ.get(KEY_ENV)
    if env is not None:
        if not env:
            raise CliError(f"{KEY_ENV} is set but empty; unset it or give the secret")
        return os.fsencode(env)  # the bytes as set (UTF-8 text, or whatever bytes the environment holds)
    return None


def read_state_dict(path: str, trust_pickle: bool, what: str = "weights file",
                    key: Optional[bytes] = None) -> Tuple[Dict[str, Any], str]:
    """Read a checkpoint (state dict, pruned, compressed, safetensors, or a compressed-tensors model
    folder) through :func:`prunekit.io.read_checkpoint`; returns ``(tensors, kind)``.

    With ``key``, only a signed prunekit checkpoint whose signature verifies is read (anything else is
    refused before it is read). Every unreadable file is a one-line :class:`CliError` (exit 2)."""
    from prunekit.report import UnsafeCheckpointError, read_checkpoint

    if not os.path.lexists(path):
        raise CliError(f"{what} not found: {path}")
    try:
        return read_checkpoint(path, trust_pickle=trust_pickle, key=key)
    except UnsafeCheckpointError as e:
        raise CliError(first_line(e)) from None
    except ImportError as e:  # an optional reader (compressed-tensors) is not installed
        raise CliError(f"cannot read {path}: {first_line(e)}", FAILURE) from None
    except (ValueError, OSError) as e:
        raise CliError(_why(path, e)) from None


def path_bytes(path: str) -> int:
    """The size of a file, or of the regular files directly inside a folder (a model folder)."""
    if not os.path.isdir(path):
        return os.path.getsize(path)
    with os.scandir(path) as it:
        return sum(e.stat().st_size for e in it if e.is_file(follow_symlinks=False))


def load_weights(model: Any, path: Optional[str], trust_pickle: bool) -> Optional[str]:
    """Load a weights file into ``model`` (dense or pruned, either way); returns the file's kind."""
    if path is None:
        return None
    import prunekit

    sd, kind = read_state_dict(path, trust_pickle)
    try:
        prunekit.load_state_dict(model, sd)
    except (ValueError, RuntimeError, TypeError) as e:
        raise CliError(f"weights {path} do not fit the model: {first_line(e)}") from None
    return kind


def add_model_args(p: argparse.ArgumentParser, weights_required: bool = False) -> None:
    """``--model``, ``--model-kwargs``, ``--weights``, ``--trust-pickle``, ``--json``: read by :func:`load_model`."""
    p.add_argument("--model", required=True, metavar="FACTORY",
                   help="function building the model: package.module:function or path/to/file.py:function")
    p.add_argument("--model-kwargs", metavar="JSON", help="keyword arguments for the factory, as a JSON object")
    p.add_argument("--weights", required=weights_required, metavar="FILE",
                   help="weights: .safetensors (plain or prunekit compressed) or a .pt state dict")
    p.add_argument("--trust-pickle", action="store_true",
                   help="allow full unpickling of a .pt file torch.load(weights_only=True) refuses (runs code!)")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")


def load_model(args: argparse.Namespace) -> Tuple[Any, Optional[str]]:
    """The model from ``--model``/``--model-kwargs`` with ``--weights`` loaded; returns ``(model, weights kind)``."""
    model = load_factory(args.model, args.model_kwargs)
    return model, load_weights(model, args.weights, args.trust_pickle)


def run_example(model: Any, shape: Sequence[int]) -> Tuple[Any, Any]:
    """Put ``model`` in eval mode and run it on a seeded random input of ``shape``; returns ``(input, output)``."""
    import torch

    model.eval()
    x = example_input(shape)
    try:
        with torch.no_grad():
            return x, model(x)
    except Exception as e:
        raise CliError(f"the model does not run on an input of shape {list(shape)}: {first_line(e)}") from None


def example_input(shape: Sequence[int]) -> Any:
    import torch

    g = torch.Generator().manual_seed(0)
    return torch.randn(*shape, generator=g)


def _why(path: str, e: BaseException) -> str:
    """One line saying why ``path`` could not be read (the path named once)."""
    msg = first_line(e)
    return msg if msg.startswith(str(path)) else f"cannot read {path}: {msg}"


# ----------------------------------------------------------------------------- output
def console(stderr: bool = False) -> Any:
    """A rich console (None when rich is not installed); wide enough for tables when piped."""
    try:
        from rich.console import Console
    except ImportError:
        return None
    stream = sys.stderr if stderr else sys.stdout
    width = None if stream.isatty() else 160
    return Console(file=stream, width=width, highlight=False, soft_wrap=False)


Justify = Literal["left", "right"]  # a column of print_table: text on the left, figures on the right


def print_table(title: str, columns: List[str], rows: List[List[str]], footer: Optional[List[str]] = None,
                justify: Optional[Sequence[Justify]] = None) -> None:
    """A table on stdout: rich when available, aligned plain text otherwise."""
    con = console()
    if not justify:
        right: List[Justify] = ["right"] * (len(columns) - 1)
        justify = ["left", *right]
    if con is not None:
        from rich.table import Table

        table = Table(title=title, show_footer=footer is not None, title_justify="left")
        for i, c in enumerate(columns):
            table.add_column(c, justify=justify[i], footer=(footer[i] if footer else ""), no_wrap=True)
        for r in rows:
            table.add_row(*r)
        need = con.measure(table, options=con.options.update_width(10_000)).maximum
        if need > con.width:  # never crop or elide figures: let a narrow terminal wrap the lines instead
            from rich.console import Console

            con = Console(file=con.file, width=need, highlight=False, soft_wrap=False)
        con.print(table)
        return
    body = [columns] + rows + ([footer] if footer else [])
    widths = [max(len(str(r[i])) for r in body) for i in range(len(columns))]
    print(title)
    for r in body:
        print("  ".join(str(c).ljust(w) if justify[i] == "left" else str(c).rjust(w)
                        for i, (c, w) in enumerate(zip(r, widths))))


def say(text: str) -> None:
    """One line on stdout, as written (no rich markup: ``prunekit[hf]`` or a path with brackets stays whole)."""
    con = console()
    if con is not None:
        con.print(text, markup=False)
    else:
        print(text)


def emit_json(data: Mapping[str, Any]) -> None:
    sys.stdout.write(json.dumps(data, indent=2, default=_json_default) + "\n")
    sys.stdout.flush()


def write_report(path: Optional[str], data: Mapping[str, Any]) -> None:
    """Write ``data`` as the JSON report at ``path`` (nothing when ``path`` is None), as ``--json`` prints it."""
    if path:
        from prunekit.io import write_json

        try:
            write_json(path, data)
        except OSError as e:
            raise CliError(f"cannot write {path}: {first_line(e)}", 1) from None


def _json_default(o: Any) -> Any:
    if isinstance(o, tuple):
        return list(o)
    if hasattr(o, "item"):
        return o.item()
    return str(o)


def pct(x: Optional[float], digits: int = 1) -> str:
    return "-" if x is None else f"{100 * x:.{digits}f}%"


def human_bytes(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    if n < 1024 ** 2:
        return f"{n / 1024:.1f} KiB"
    return f"{n / 1024 ** 2:.2f} MiB"


def human_count(n: float) -> str:
    if n >= 1e9:
        return f"{n / 1e9:.2f}G"
    if n >= 1e6:
        return f"{n / 1e6:.2f}M"
    if n >= 1e3:
        return f"{n / 1e3:.1f}k"
    return f"{int(n)}"


def print_report(report: Any, title: str) -> None:
    """The per-layer sparsity table of a :class:`prunekit.report.ModelReport`."""
    cols = ["layer", "shape", "sparsity", "zero channels", "2:4 fit", "4x1 blocks zero", "mask"]
    rows = []
    for e in report.layers:
        rows.append([
            e.name, "x".join(str(s) for s in e.shape), pct(e.sparsity),
            f"{e.zero_channels}/{e.channels}", pct(e.fits_2_4), pct(e.block_4x1_sparsity), "yes" if e.masked else "",
        ])
    footer = [
        f"total ({len(report.layers)} weights)", f"{human_count(report.numel_layers)} el.", pct(report.sparsity_layers),
        f"{report.zero_channels}/{report.channels}", pct(report.fits_2_4), pct(report.block_4x1_sparsity), "",
    ]
    print_table(title, cols, rows, footer, ["left", "right", "right", "right", "right", "right", "left"])
    say(f"all tensors: {report.numel_all:,} elements, {report.nonzero_all:,} non-zero "
        f"({pct(report.sparsity_all)} sparse)")
