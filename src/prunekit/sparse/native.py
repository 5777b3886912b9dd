"""prunekit's compiled CPU sparse kernels: build, load and call them (optional).

The kernels (``csrc/linear.cpp``) compute ``x @ W.T + b`` for a weight ``W``
stored as CSR (int32 row pointers, int16 or int32 column indices) or as BSR
with the 4x1 / 1x4 blocks the training pruners produce. They differ from
torch's own CSR path (MKL) in three ways the source explains: no per-call
index conversion or transposed copies, a layout that keeps each chunk of the
input in cache, and threads taken from ATen's own OpenMP pool
(``benchmarks/bench_sparse.py --parts kernels`` compares the two on a given
machine; :func:`prunekit.sparse.sparsify_for_inference` measures every
policy in context and keeps the fastest).

They are built once per machine, by ``make kernels`` (``make test`` depends on
it) or ``prunekit.sparse.native.build()``, with
:mod:`torch.utils.cpp_extension` (g++, ninja, ``-O3 -march=native``). Nothing
is compiled at import or at run time: when the library is missing, stale or
built for another CPU, :func:`available` is ``False``,
:func:`unavailable_reason` says why and what to run, and prunekit uses
torch's kernels instead. ``PRUNEKIT_SPARSE_KERNELS=0`` disables them;
``PRUNEKIT_SPARSE_KERNELS_DIR`` moves the build directory.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import sys
import threading
from pathlib import Path
from typing import Optional

import torch

__all__ = ["available", "unavailable_reason", "build", "build_directory", "csr_linear", "bsr_linear"]

logger = logging.getLogger(__name__)

_NAME = "prunekit_sparse_kernels"
_SOURCE = Path(__file__).with_name("csrc") / "linear.cpp"
_CFLAGS = ("-O3", "-march=native", "-fopenmp", "-std=c++17")
_LDFLAGS = ("-fopenmp",)
_DTYPES = (torch.float32, torch.float64)

_lock = threading.Lock()
_state: dict = {"loaded": None, "reason": ""}


def build_directory() -> Path:
    """Where the compiled library lives: one folder per torch and Python version.

    Examples:
        >>> from prunekit.sparse import native
        >>> native.build_directory().name.startswith("torch-")
        True
    """
    root = os.environ.get("PRUNEKIT_SPARSE_KERNELS_DIR")
    base = Path(root) if root else _SOURCE.parent / "build"
    tag = f"torch-{torch.__version__.split('+')[0]}-py{sys.version_info[0]}{sys.version_info[1]}"
    return base / tag


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("flags"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _fingerprint() -> str:
    """What the binary depends on: the source, the flags, torch, and this CPU (-march=native)."""
    h = hashlib.sha256()
    h.update(_SOURCE.read_bytes())
    h.update(repr((_CFLAGS, _LDFLAGS, torch.__version__, platform.machine(), _cpu_flags())).encode())
    return h.hexdigest()


def _library_path() -> Path:
    return build_directory() / f"{_NAME}.so"


def _stamp_path() -> Path:
    return build_directory() / "fingerprint.txt"


def build(verbose: bool = False) -> Path:
    """Compile the kernels for this machine and load them; returns the library's path.

    Needs g++ and ninja. Raises ``RuntimeError`` (from :mod:`torch.utils.cpp_extension`)
    when the compiler fails.

    Examples:
        >>> from prunekit.sparse import native
        >>> native.build().name  # doctest: +SKIP
        'prunekit_sparse_kernels.so'
    """
    from torch.utils import cpp_extension

    directory = build_directory()
    directory.mkdir(parents=True, exist_ok=True)
    with _lock:
        # copies: cpp_extension.load appends its own flags to the lists it is given
        cpp_extension.load(name=_NAME, sources=[str(_SOURCE)], extra_cflags=list(_CFLAGS),
                           extra_ldflags=list(_LDFLAGS), build_directory=str(directory), is_python_module=False,
                           verbose=verbose)
        from ..io.writer import write_text

        write_text(_stamp_path(), _fingerprint())  # atomic: no temporary left, whatever happens
        _state["loaded"] = None  # load() checks the fresh stamp
    if not available():
        raise RuntimeError(f"prunekit.sparse.native: built {_library_path()} but could not load it: "
                           f"{unavailable_reason()}")
    return _library_path()


def _load() -> bool:
    if _state["loaded"] is not None:
        return _state["loaded"]
    with _lock:
        if _state["loaded"] is not None:
            return _state["loaded"]
        ok, reason = False, ""
        path = _library_path()
        if os.environ.get("PRUNEKIT_SPARSE_KERNELS", "1").strip().lower() in ("0", "off", "false", "no"):
            reason = "disabled by PRUNEKIT_SPARSE_KERNELS=0"
        elif hasattr(torch.ops, "prunekit_sparse") and hasattr(torch.ops.prunekit_sparse, "csr_linear"):
            ok = True  # already registered in this process (by build())
        elif not path.exists():
            reason = (f"not built ({path} is missing); run `make kernels` (or prunekit.sparse.native.build()) "
                      f"once on this machine")
        elif not _stamp_path().exists() or _stamp_path().read_text().strip() != _fingerprint():
            reason = (f"{path} was built from another source, torch or CPU; rebuild with `make kernels` (or "
                      f"prunekit.sparse.native.build())")
        else:
            try:
                torch.ops.load_library(str(path))
                ok = True
            except (OSError, RuntimeError) as exc:
                reason = f"{path} did not load: {exc}"
        _state["loaded"], _state["reason"] = ok, reason
        if not ok:
            logger.info("prunekit.sparse: compiled kernels unavailable (%s); torch's kernels are used", reason)
        return ok


def available() -> bool:
    """Whether the compiled kernels are built for this machine and loaded.

    Examples:
        >>> from prunekit.sparse import native
        >>> isinstance(native.available(), bool)
        True
    """
    return _load()


def unavailable_reason() -> str:
    """Why :func:`available` is ``False`` (``''`` when it is ``True``).

    Examples:
        >>> from prunekit.sparse import native
        >>> native.available() or native.unavailable_reason() != ""
        True
    """
    _load()
    return _state["reason"]


def supports(x: torch.Tensor) -> bool:
    """Whether the kernels take this input: built, a CPU float32/float64 tensor, no autograd needed."""
    return (x.device.type == "cpu" and x.dtype in _DTYPES and not (x.requires_grad and torch.is_grad_enabled())
            and available())


def csr_linear(x2d: torch.Tensor, crow: torch.Tensor, col: torch.Tensor, values: torch.Tensor,
               bias: Optional[torch.Tensor], out_features: int, threads: int = 0) -> torch.Tensor:
    """``x2d @ W.T + bias`` for ``W`` in CSR; ``threads=0`` uses torch's thread count, 1 runs serially."""
    return torch.ops.prunekit_sparse.csr_linear(x2d.contiguous(), crow, col, values, bias, out_features, threads)


def bsr_linear(x2d: torch.Tensor, brow: torch.Tensor, bcol: torch.Tensor, values: torch.Tensor,
               bias: Optional[torch.Tensor], out_features: int, block: tuple, threads: int = 0) -> torch.Tensor:
    """``x2d @ W.T + bias`` for ``W`` in BSR with ``block`` = (4, 1) or (1, 4)."""
    return torch.ops.prunekit_sparse.bsr_linear(x2d.contiguous(), brow, bcol, values.reshape(-1), bias,
                                                out_features, block[0], block[1], threads)
