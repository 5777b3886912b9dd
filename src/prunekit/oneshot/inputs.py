"""What each layer to prune reads: its input, seen by a hook, as rows of real tokens.

* :func:`input_taps` -- for the time of a ``with``, ``fn(target, x, tokens)`` is called with the
  input each target is about to multiply: a forward pre-hook's first argument for a module of its
  own (``tokens`` is ``None``), or, for an expert's slice of a 3-D experts parameter, the rows of the
  tokens routed to that expert and their flat token indices (:func:`prunekit.oneshot.experts.tapped`);
* :func:`token_rows` -- such an input as 2-D rows with the padding left out.

Examples:
    >>> import torch
    >>> from torch import nn
    >>> from prunekit.oneshot.layers import Target
    >>> lin = nn.Linear(3, 2)
    >>> seen = []
    >>> with input_taps([(Target("fc", 0, lin), lambda t, x, tokens: seen.append((t.name, tuple(x.shape))))]):
    ...     _ = lin(torch.ones(4, 3))
    >>> seen
    [('fc', (4, 3))]
    >>> token_rows(torch.ones(1, 3, 2), torch.tensor([[True, False, True]]), None).shape
    torch.Size([2, 2])
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

from torch import Tensor, nn

from .blocks import pre_hooks
from .experts import Routes, Tap, tapped
from .layers import Target

__all__ = ["Seen", "input_taps", "token_rows"]

#: ``fn(target, x, tokens)``: ``x`` the target's input, ``tokens`` the flat token indices of its rows (experts)
Seen = Callable[[Target, Tensor, Optional[Tensor]], None]


@contextlib.contextmanager
def input_taps(pairs: Sequence[Tuple[Target, Seen]], block: Optional[nn.Module] = None,
               record: Optional[Routes] = None, replay: Optional[Routes] = None) -> Iterator[None]:
    """``fn(target, x, tokens)`` called with each target's input for the ``with`` body.

    Experts modules (targets with ``expert`` set) run an eager loop for the time of the body;
    ``record``/``replay`` keep or follow their routing by the module's name in ``block`` (see
    :func:`~prunekit.oneshot.experts.tapped`)."""
    plain: List[Tuple[nn.Module, Callable[..., None]]] = []
    experts: Dict[int, Tuple[nn.Module, Dict[Tuple[str, int], List[Tuple[Target, Seen]]]]] = {}
    for t, fn in pairs:
        if t.expert is None:
            plain.append((t.module, _pre_hook(t, fn)))
        else:
            experts.setdefault(id(t.module), (t.module, {}))[1].setdefault((t.tensor, t.expert), []).append((t, fn))
    names = {id(m): n for n, m in block.named_modules()} if block is not None else {}
    modules = {names.get(id(m), str(k)): (m, _tap(table)) for k, (m, table) in experts.items()}
    with pre_hooks(plain), tapped(modules, record, replay):
        yield


def _pre_hook(t: Target, fn: Seen) -> Callable[..., None]:
    def hook(_m: nn.Module, args: Tuple[Any, ...]) -> None:
        fn(t, args[0], None)
    return hook


def _tap(table: Dict[Tuple[str, int], List[Tuple[Target, Seen]]]) -> Tap:
    def tap(tensor: str, expert: int, x: Tensor, tokens: Tensor) -> None:
        for t, fn in table.get((tensor, expert), ()):
            fn(t, x, tokens)
    return tap


def token_rows(x: Tensor, mask: Optional[Tensor], tokens: Optional[Tensor]) -> Tensor:
    """``x`` as 2-D rows of features without the padding (``mask`` true = a real token, ``(batch, seq)``).

    ``tokens``: the flat token index of each row of a 2-D ``x`` (an expert's routed rows); without
    it, ``x`` is ``(batch, seq, ...)`` or already flat ``(batch * seq, features)``."""
    f = x.shape[-1]
    if mask is None:
        return x.reshape(-1, f)
    flat = mask.reshape(-1).to(x.device)
    if tokens is not None:
        return x[flat[tokens.to(x.device)]]
    if tuple(x.shape[:-1]) == tuple(mask.shape) or (x.dim() == 2 and x.shape[0] == flat.numel()):
        return x.reshape(-1, f)[flat]
    return x.reshape(-1, f)
