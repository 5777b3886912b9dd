"""One-shot pruning's rollback without a second copy of the model: each block's originals kept on disk.

Before a block's weights change, :class:`OriginalsSpool` writes them (one
tensor at a time, no copy in memory) as one safetensors file into a scratch
file that has no name (:func:`prunekit.io.writer.unnamed_file`: nothing is
left behind, whatever ends the process), and hands back the undo step that
reads them back into the very same tensors. The steps go into the call's
:class:`~prunekit.transaction.Transaction` with the modules' structure, so a
failure in block ``k`` -- ``KeyboardInterrupt`` included -- restores blocks
``k, k-1, ..., 0`` from their files and the model is what it was. The files
are closed, and their space freed, by :meth:`~OriginalsSpool.close` or as soon as
the spool is no longer referenced (a successful call just drops it: nothing runs
between its last change and its return that a failure could cut short).

Memory: nothing beyond the tensor being written or read; disk: the bytes of
the layers whose values change (every pruned layer with ``masks="bake"``).

Examples:
    >>> import torch
    >>> lin = torch.nn.Linear(3, 2)
    >>> before = lin.weight.detach().clone()
    >>> with OriginalsSpool() as spool:
    ...     undo = spool.keep({"w": lin.weight})
    ...     with torch.no_grad():
    ...         _ = lin.weight.zero_()
    ...     undo()
    >>> torch.equal(lin.weight, before)
    True
"""

from __future__ import annotations

import os
import tempfile
import weakref
from typing import IO, Any, Callable, Dict, List, Optional

import torch
from torch import Tensor

from ..io.plain import stream_safetensors
from ..io.reader import read_safetensors_header, read_safetensors_tensor
from ..io.writer import unnamed_file

__all__ = ["OriginalsSpool"]


class OriginalsSpool:
    """Scratch files (no name, in ``directory``; default the system's temporary folder) holding the
    originals of tensors about to change in place; :meth:`keep` returns the step that puts them back."""

    def __init__(self, directory: Optional[Any] = None) -> None:
        self.directory = os.fspath(directory) if directory is not None else tempfile.gettempdir()
        if not os.path.isdir(self.directory):
            raise ValueError(f"scratch_dir={self.directory!r} is not a folder; give an existing folder (on a disk "
                             "with room for the pruned layers' original weights)")
        self._files: List[IO[bytes]] = []
        self.bytes = 0
        weakref.finalize(self, _close_all, self._files)  # dropped unclosed: the files still go

    def keep(self, tensors: Dict[str, Tensor]) -> Callable[[], None]:
        """Write ``tensors`` (name -> the tensor itself) to a new scratch file; return the undo step that
        copies the written values back into the same tensor objects."""
        f = unnamed_file(self.directory)
        self._files.append(f)
        self.bytes += stream_safetensors(f, {name: t.detach() for name, t in tensors.items()})
        targets = dict(tensors)

        def restore() -> None:
            header = read_safetensors_header(f, f"<scratch file in {self.directory}>")
            with torch.no_grad():
                for name, t in targets.items():
                    t.detach().copy_(read_safetensors_tensor(f, header, name))

        return restore

    def close(self) -> None:
        """Close every scratch file (their space is freed)."""
        _close_all(self._files)

    def __enter__(self) -> "OriginalsSpool":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _close_all(files: List[IO[bytes]]) -> None:
    while files:
        files.pop().close()
