"""What every sparse inference module shares: the base class, execution-policy names, thread control."""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch
from torch import nn

__all__ = ["SparseInferenceModule", "policy_name"]

_KERNELS = ("prunekit", "torch")


def _index_dtype(extent: int) -> torch.dtype:
    """int16 column indices while they fit (a third less memory traffic than int32), else int32."""
    return torch.int16 if extent <= 32768 else torch.int32


def _check_policy(owner: str, kernel: str, threads: int) -> None:
    if kernel not in _KERNELS:
        raise ValueError(f"{owner}: kernel={kernel!r}; use one of {_KERNELS}")
    if threads not in (0, 1):
        raise ValueError(f"{owner}: threads={threads!r}; use 0 (torch's thread count) or 1")


def policy_name(layout: str, kernel: str, threads: int) -> str:
    """The name of an execution policy: layout, ``-torch`` for torch's kernel, ``-1t`` for one thread.

    Examples:
        >>> from prunekit.sparse.modules import policy_name
        >>> policy_name("csr", "prunekit", 0), policy_name("csr", "torch", 1)
        ('csr', 'csr-torch-1t')
    """
    return (layout if kernel == "prunekit" else f"{layout}-torch") + ("-1t" if threads == 1 else "")


@contextlib.contextmanager
def _threads(n: int) -> Iterator[None]:
    """Run torch's kernels on ``n`` threads (0: leave torch's setting alone).

    ``torch.set_num_threads`` is process-wide: this is restored at once, but
    it is not meant for several Python threads running inference at the same
    time (prunekit's compiled kernels take the count as an argument instead).
    """
    current = torch.get_num_threads()
    if n == 0 or n == current:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(current)


class SparseInferenceModule(nn.Module):
    """Common base: keeps the replaced module (optionally) and rebuilds a dense twin."""

    _original: Optional[nn.Module]  # set with object.__setattr__: not a registered submodule

    def __init__(self, original: Optional[nn.Module]) -> None:
        super().__init__()
        # Not a registered submodule: it must not appear in state_dict() or
        # parameters() of the converted model.
        object.__setattr__(self, "_original", original)

    @property
    def original(self) -> Optional[nn.Module]:
        """The module this one replaced (``None`` when it was not kept)."""
        return self._original

    def to_dense_module(self) -> nn.Module:  # pragma: no cover - overridden
        raise NotImplementedError


def _dense_linear(weight: torch.Tensor, bias: Optional[torch.Tensor]) -> nn.Linear:
    lin = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device=weight.device,
                    dtype=weight.dtype)
    with torch.no_grad():
        lin.weight.copy_(weight)
        if bias is not None:
            lin.bias.copy_(bias)
    return lin
