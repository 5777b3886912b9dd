"""Which layers one-shot pruning prunes, and how their weights look as ``(out, in)`` matrices.

A target is a linear layer inside a block: ``nn.Linear`` (weight ``(out, in)``)
or Hugging Face's ``Conv1D`` (GPT-2; weight ``(in, out)``, used as ``x @ W``).
The solvers see every weight as ``(out, in)``; :class:`Target` converts.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, List, Optional, Sequence, Tuple, Union

from torch import Tensor, nn

from .. import reparam

__all__ = ["Target", "find_targets", "is_linear_like"]


def is_linear_like(module: nn.Module) -> bool:
    """``nn.Linear`` (or a subclass), or a ``Conv1D`` with a 2-D weight (GPT-2's linear layers).

    Examples:
        >>> from torch import nn
        >>> is_linear_like(nn.Linear(2, 3)), is_linear_like(nn.Conv1d(2, 3, 1))
        (True, False)
    """
    if isinstance(module, nn.Linear):
        return True
    return reparam.base_class(module).__name__ == "Conv1D" and hasattr(module, "nf") and _weight(module).dim() == 2


def _weight(module: nn.Module) -> Tensor:
    return reparam.stored(module, "weight")


@dataclass
class Target:
    """One layer to prune: its qualified name, block index and module."""

    name: str
    block: int
    module: nn.Module

    @property
    def transposed(self) -> bool:
        """True for ``Conv1D`` (weight stored ``(in, out)``)."""
        return not isinstance(self.module, nn.Linear)

    @property
    def param(self) -> Tensor:
        """The stored weight Parameter (``weight_orig`` when pruned)."""
        return _weight(self.module)

    def matrix(self, t: Optional[Tensor] = None) -> Tensor:
        """``t`` (default: the weight) as an ``(out, in)`` matrix (a view)."""
        t = self.param if t is None else t
        return t.t() if self.transposed else t

    def stored(self, matrix: Tensor) -> Tensor:
        """An ``(out, in)`` matrix in the stored layout."""
        return matrix.t() if self.transposed else matrix

    @property
    def in_features(self) -> int:
        return self.matrix().shape[1]

    @property
    def out_features(self) -> int:
        return self.matrix().shape[0]


Patterns = Union[None, str, Sequence[str]]


def _compile(p: Patterns, what: str) -> List["re.Pattern[str]"]:
    if p is None:
        return []
    if isinstance(p, str):
        p = [p]
    out = []
    for s in p:
        if not isinstance(s, str):
            raise TypeError(f"{what} must be a string or a list of strings (regular expressions), got {s!r}")
        try:
            out.append(re.compile(s))
        except re.error as e:
            raise ValueError(f"{what}: {s!r} is not a regular expression ({e})") from None
    return out


def find_targets(blocks: Iterable[Tuple[str, nn.Module]], targets: Patterns = None, ignore: Patterns = None,
                 prefix: str = "") -> List[Target]:
    """The linear layers inside ``blocks`` whose qualified name matches ``targets`` and not ``ignore``.

    ``targets``/``ignore``: regular expressions (``re.search``) over the
    qualified name, or class names of the layers (``"Linear"``); ``targets=None``
    takes every linear layer in the blocks.

    Examples:
        >>> from torch import nn
        >>> blocks = [("h.0", nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)))]
        >>> [t.name for t in find_targets(blocks, ignore=r"\\.1$")]
        ['h.0.0']
    """
    inc, exc = _compile(targets, "targets"), _compile(ignore, "ignore")
    out: List[Target] = []
    for bi, (bname, block) in enumerate(blocks):
        for lname, m in block.named_modules():
            if not is_linear_like(m):
                continue
            full = f"{prefix}{bname}.{lname}" if lname else f"{prefix}{bname}"
            cls = reparam.base_class(m).__name__
            if inc and not any(p.search(full) or p.fullmatch(cls) for p in inc):
                continue
            if any(p.search(full) or p.fullmatch(cls) for p in exc):
                continue
            out.append(Target(full, bi, m))
    return out
