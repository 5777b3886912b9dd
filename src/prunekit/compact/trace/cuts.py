"""Cuts of a channel dimension: ops that take part of it at positions written in the model's code.

``x[:, :k]``, ``x.narrow(1, s, n)``, ``x.split(k, 1)``, ``x.select(1, i)``, ``x.unbind(1)``: the
bounds are numbers the model computed from its original sizes, and compaction cannot rewrite
them. Removing a channel before a bound counted from the front (or after one counted from the
back) moves which channels the op takes, so those positions are *unsafe*: their units are
blocked. ``x[:, k:]`` keeps every channel after ``k`` free, ``x[:, -k:]`` every one before the
last ``k``. ``chunk`` and ``tensor_split`` into equal parts recompute their bounds from the size:
they stay right when every part loses as many channels, which the tracer checks once the
channels are grouped (:class:`Cut` with ``parts``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

__all__ = ["CUT_OPS", "Cut", "cuts"]

CUT_OPS = frozenset({"__getitem__", "narrow", "select", "split", "split_with_sizes", "chunk", "tensor_split", "unbind"})


@dataclass
class Cut:
    """One cut of dimension ``dim`` (of size ``n``): ``unsafe`` positions (bool, size ``n``), or
    ``parts`` equal parts whose channels must go in equal numbers from every part."""

    dim: int
    what: str
    unsafe: Optional[Tensor] = None
    parts: int = 0


def _all(n: int) -> Tensor:
    return torch.ones(n, dtype=torch.bool)


def _bounds(n: int, start: Optional[int], stop: Optional[int]) -> Tensor:
    """Unsafe positions of the range ``[start:stop]`` (Python slice bounds, ``None`` for open)."""
    unsafe = torch.zeros(n, dtype=torch.bool)
    if start is not None:
        if 0 < start:
            unsafe[: min(start, n)] = True  # counted from the front: nothing before it may go
        elif -n < start < 0:
            unsafe[n + start :] = True  # counted from the back: nothing after it may go
    if stop is not None:
        if 0 <= stop < n:
            unsafe[:stop] = True
        elif -n < stop < 0:
            unsafe[n + stop :] = True
    return unsafe


def _int(v: Any) -> Optional[int]:
    if isinstance(v, bool):
        return None
    if isinstance(v, int):
        return v
    if isinstance(v, Tensor) and v.dim() == 0 and not v.is_floating_point():
        return int(v)
    return None


def _index_dims(index: Any, ndim: int) -> List[Tuple[int, Any]]:
    """``x[index]``: the input dimension each element of ``index`` consumes, as ``(dim, element)``."""
    items = index if isinstance(index, tuple) else (index,)

    def width(i: Any) -> int:
        if i is None or i is Ellipsis or isinstance(i, bool):
            return 0
        if isinstance(i, Tensor) and i.dtype == torch.bool:
            return max(i.dim(), 1)
        return 1

    used = sum(width(i) for i in items)
    out: List[Tuple[int, Any]] = []
    d = 0
    for i in items:
        if i is Ellipsis:
            d += ndim - used
            continue
        for _ in range(width(i)):
            out.append((d, i))
            d += 1
    return out


def _getitem(x: Tensor, index: Any) -> List[Cut]:
    found: List[Cut] = []
    for d, i in _index_dims(index, x.dim()):
        n = x.shape[d]
        k = _int(i)
        if k is not None:
            found.append(Cut(d, f"index {k}", _bounds(n, k, None if k == -1 else k + 1)))
        elif isinstance(i, slice):
            start, stop, step = _int(i.start), _int(i.stop), _int(i.step)
            if (i.start is not None and start is None) or (i.stop is not None and stop is None):
                found.append(Cut(d, f"slice {i}", _all(n)))
            elif step not in (None, 1) and n > 1:
                found.append(Cut(d, f"slice {i}", _all(n)))
            else:
                found.append(Cut(d, f"[{'' if start is None else start}:{'' if stop is None else stop}]",
                                 _bounds(n, start, stop)))
        else:  # an index tensor or list: any position may be taken
            found.append(Cut(d, "an index tensor", _all(n)))
    return found


def _equal_parts(d: int, n: int, parts: int, what: str) -> Cut:
    if parts <= 1:
        return Cut(d, what, torch.zeros(n, dtype=torch.bool))
    if n % parts:
        return Cut(d, what, _all(n))
    return Cut(d, what, parts=parts)


def _front_bounds(d: int, n: int, bounds: Sequence[int], what: str) -> Cut:
    """Cuts at positions counted from the front; the last part runs to the end."""
    inner = [b for b in bounds if 0 < b < n]
    if any(b < 0 for b in bounds):
        return Cut(d, what, _all(n))
    return Cut(d, what, _bounds(n, None, max(inner)) if inner else torch.zeros(n, dtype=torch.bool))


def _arg(args: tuple, kwargs: dict, i: int, *keys: str, default: Any = None) -> Any:
    if len(args) > i:
        return args[i]
    for k in keys:
        if k in kwargs:
            return kwargs[k]
    return default


def cuts(name: str, args: tuple, kwargs: dict, out: Any) -> List[Cut]:
    """The cuts ``name(*args, **kwargs)`` (one of :data:`CUT_OPS`, returning ``out``) makes in its input.

    Examples:
        >>> import torch
        >>> x = torch.zeros(2, 6)
        >>> [(c.dim, c.what, c.unsafe.nonzero().view(-1).tolist()) for c in cuts("__getitem__", (x, (slice(None), slice(0, 4))), {}, None)]
        [(0, '[:]', []), (1, '[0:4]', [0, 1, 2, 3])]
        >>> [(c.what, c.parts) for c in cuts("chunk", (x, 2, 1), {}, x.chunk(2, 1))]
        [('chunk(2)', 2)]
    """
    x = args[0]
    if not isinstance(x, Tensor) or x.dim() == 0:
        return []
    if name == "__getitem__":
        return _getitem(x, args[1])
    dim = _int(_arg(args, kwargs, {"narrow": 1, "select": 1}.get(name, 2), "dim", default=0))
    if name == "unbind":
        dim = _int(_arg(args, kwargs, 1, "dim", default=0))
    if dim is None:
        return []
    d = dim % x.dim()
    n = x.shape[d]
    if name == "narrow":
        start, length = _int(_arg(args, kwargs, 2, "start")), _int(_arg(args, kwargs, 3, "length"))
        if start is None or length is None:
            return [Cut(d, "narrow", _all(n))]
        start %= max(n, 1)
        unsafe = torch.zeros(n, dtype=torch.bool)
        unsafe[: start + length] = True  # narrow's end is a number too: nothing before it may go
        return [Cut(d, f"narrow({start}, {length})", unsafe)]
    if name == "select":
        k = _int(_arg(args, kwargs, 2, "index"))
        return [Cut(d, f"index {k}", _all(n) if k is None else _bounds(n, k, None if k == -1 else k + 1))]
    if name == "unbind":
        return [Cut(d, "unbind", _all(n))] if n > 1 else []
    pieces = len(out) if isinstance(out, (tuple, list)) else 1
    if name == "chunk":
        asked = _int(_arg(args, kwargs, 1, "chunks"))
        if asked != pieces:  # fewer parts than asked: their size would not follow the channels
            return [Cut(d, f"chunk({asked})", _all(n))]
        return [_equal_parts(d, n, pieces, f"chunk({pieces})")]
    spec = _arg(args, kwargs, 1, "split_size_or_sections", "split_size", "split_sizes", "indices_or_sections",
                "sections", "indices", "tensor_indices_or_sections")
    if name in ("split", "split_with_sizes"):
        size = _int(spec)
        if size is not None:
            return [_front_bounds(d, n, list(range(size, n, size)), f"split({size})")]
        return [Cut(d, f"split({list(spec)})", _all(n))]  # sizes that must add up to the channels
    # tensor_split: a number of equal parts, or the indices where parts start
    sections = _int(spec)
    if sections is not None:
        return [_equal_parts(d, n, sections, f"tensor_split({sections})")]
    bounds = [int(b) for b in (spec.tolist() if isinstance(spec, Tensor) else spec)]
    return [_front_bounds(d, n, bounds, f"tensor_split({bounds})")]
