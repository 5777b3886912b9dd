"""The ``prunekit`` command (also ``python -m prunekit``).

Subcommands: ``demo``, ``inspect``, ``prune``, ``compact``, ``sparsify``, ``oneshot``, ``shrink``; each has
``--help`` with examples and ``--json`` for machine-readable output. Exit codes:
0 success, 1 failure while working, 2 bad arguments (missing file, unknown
method, amount outside [0, 1], a pickle without ``--trust-pickle``), 130
interrupted. A file the hostile reader refuses (not a regular file, too large, malformed,
damaged, unsigned when a key is given, needing unpickling) exits 2 wherever it is read.
Errors are one line on stderr; ``--debug`` (before the subcommand)
adds the traceback above it and keeps the exit code.

Needs ``rich`` for tables and progress bars (``pip install prunekit[cli]``);
without it the output is plain text.
"""

from __future__ import annotations

import argparse
import logging
import sys
import traceback
from typing import Callable, List, Optional

from ._common import FAILURE, USAGE_ERROR, CliError, Parser, first_line

__all__ = ["main", "build_parser"]

_EPILOG = """\
examples:
  prunekit demo                       prune and compare: a CNN on scikit-learn's digits, MiniLM-L6 (< 3 min)
  prunekit demo --quick --out /tmp/d  a shorter version (~40 s)
  prunekit inspect model.safetensors  per-layer sparsity of a checkpoint
  prunekit prune --model torchvision.models:resnet18 --weights r18.pt \\
                 --method global_magnitude --amount 0.8 --out r18-80.safetensors
  prunekit compact --model mypkg.nets:make_cnn --weights cnn.pt --input-shape 1,3,32,32 \\
                 --amount 0.5 --out cnn-small.pt
  prunekit sparsify --model mypkg.nets:make_cnn --weights cnn-90.safetensors --input-shape 8,3,32,32
  prunekit shrink --model llama-folder --calibration texts.txt --target 0.5 --out llama-half

exit codes: 0 ok, 1 failed while working, 2 bad arguments.
"""


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``prunekit`` command (bad arguments raise a one-line ``CliError``).

    Examples:
        >>> from prunekit.cli import build_parser
        >>> args = build_parser().parse_args(["inspect", "model.safetensors", "--json"])
        >>> args.command, args.checkpoint, args.json, args.debug
        ('inspect', 'model.safetensors', True, False)
    """
    from . import _compact, _demo, _inspect, _oneshot, _prune, _shrink, _sparsify

    parser = Parser(
        prog="prunekit",
        description="Prune PyTorch models: inspect checkpoints, prune, compact, sparsify, and a demo.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    from prunekit import __version__

    parser.add_argument("--version", action="version", version=f"prunekit {__version__}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks of errors")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="log more (-v info, -vv debug)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    for mod in (_demo, _inspect, _prune, _compact, _sparsify, _oneshot, _shrink):
        mod.add_parser(sub)
    return parser


def _setup_logging(verbose: int) -> Callable[[], None]:
    """Send prunekit's log records to stderr; returns a function that undoes it."""
    level = logging.WARNING if verbose <= 0 else logging.INFO if verbose == 1 else logging.DEBUG
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    handler.setLevel(level)
    logger = logging.getLogger("prunekit")
    old_level = logger.level
    logger.addHandler(handler)
    if logger.getEffectiveLevel() > level:
        logger.setLevel(level)

    def undo() -> None:
        logger.removeHandler(handler)
        logger.setLevel(old_level)

    return undo


_MAX_LINE = 2000


def _fail(e: BaseException, code: int, debug: bool, line: str) -> int:
    """Report a failure as ``line`` on stderr (after the traceback with ``--debug``); returns ``code``.

    ``--debug`` adds the traceback but never changes the exit code.
    """
    if debug:
        traceback.print_exception(e, file=sys.stderr)
    if len(line) > _MAX_LINE:  # a message quoting a huge value from a file stays one readable line
        line = f"{line[:_MAX_LINE]}... ({len(line)} characters)"
    print(f"prunekit: error: {line}", file=sys.stderr)
    return code


def main(argv: Optional[List[str]] = None) -> int:
    """Run the command with ``argv`` (default: ``sys.argv[1:]``); returns the exit code.

    Errors are one line on stderr and an exit code (2 bad arguments, 1 a
    failure while working); nothing is raised.

    Examples:
        >>> from prunekit.cli import main
        >>> main(["inspect", "no-such-file.pt"])  # stderr: prunekit: error: checkpoint not found: no-such-file.pt
        2
        >>> main(["prune", "--model", "m:f", "--amount", "1.5"])  # stderr: ... amount 1.5 is out of range ...
        2
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = False  # known once the arguments parse: a bad argument is the user's, its traceback helps nobody
    try:
        parser = build_parser()
        try:
            args = parser.parse_args(argv)
        except SystemExit as e:  # --help / --version
            return int(e.code or 0) if not isinstance(e.code, str) else USAGE_ERROR
        debug = args.debug
        if args.command is None:
            parser.print_help()
            return USAGE_ERROR
        undo_logging = _setup_logging(args.verbose)
        try:
            return int(args.func(args) or 0)
        finally:
            undo_logging()
    except CliError as e:
        return _fail(e, e.code, debug, first_line(e))
    except ValueError as e:
        if _bad_input(e):  # a file refused by the file layer, wherever it was read: the user's input
            return _fail(e, USAGE_ERROR, debug, first_line(e))
        return _fail(e, FAILURE, debug, f"{type(e).__name__}: {first_line(e)}" + _hint(debug))
    except KeyboardInterrupt:
        print("prunekit: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return FAILURE
    except Exception as e:  # a failure while working: one line, the traceback only with --debug
        return _fail(e, FAILURE, debug, f"{type(e).__name__}: {first_line(e)}" + _hint(debug))


def _hint(debug: bool) -> str:
    return "" if debug else " (rerun with --debug for the traceback)"


def _bad_input(e: BaseException) -> bool:
    """Whether ``e`` is the file layer refusing a file (unreadable, damaged, unsigned, needs unpickling):
    the user's input, reported like a bad argument (exit 2), wherever in a command it surfaced."""
    from prunekit.io.errors import UnreadableFileError, UnsafeCheckpointError

    return isinstance(e, (UnreadableFileError, UnsafeCheckpointError))
