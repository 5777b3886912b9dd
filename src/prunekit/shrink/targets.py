"""What the dense model had where a refitted layer's output joins the residual stream.

A layer that reads removed units (``down_proj``, ``o_proj``, BERT's ``output.dense``) writes into the
residual stream: the next norm to run takes ``r + o``, the stream so far plus the layer's output.
Refitting the layer to reproduce its own output ``o`` leaves the error that earlier blocks left in
``r``. Refitting it to ``s_dense - r`` -- what the dense model had at that norm, less the stream the
shrunk model brings there -- makes up for that error too (the refit follows the teacher, as a
distillation step would, with no gradient).

* :func:`find_joins` -- each layer's join: the input of the first norm that runs after it, kept only
  where that input is ``r + o`` (checked by adding a perturbation to ``o``) and the join is the
  layer's alone;
* :func:`teacher_moments` -- for each layer, the moments of that least-squares fit, gathered batch by
  batch: the dense pass of a batch, then the shrunk pass of the same batch (nothing is kept between
  batches but the moments).

Under :func:`teacher_moments` the model runs dense inside the ``dense`` context the caller gives
(emulation hooks off); layers already refitted compute there with their original weights, which the
caller keeps in ``originals``.
"""

from __future__ import annotations

from typing import Any, Callable, ContextManager, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..transaction import run_then_clean
from .calibration import forward, token_mask, token_rows

__all__ = ["Moments", "find_joins", "teacher_moments"]

Reader = Any  # an nn.Linear or a transformers Conv1D (weight (in, out))
DenseView = Callable[[], ContextManager[Any]]
#: ``id(reader) -> (G = sum x x^T, C = sum t x^T, sum |t|^2, rows)``: float64, ``x`` with a constant 1 appended
Moments = Dict[int, Tuple[Tensor, Tensor, float, int]]
#: largest relative deviation of the join's change from the perturbation for the join to count as additive
ADDITIVE_TOLERANCE = 0.05


class _Stop(Exception):
    """Everything asked about has been seen: the rest of the model need not run."""


def _is_norm(module: nn.Module) -> bool:
    name = type(module).__name__
    return isinstance(module, (nn.LayerNorm, nn.GroupNorm)) or name.endswith("Norm") or "LayerNorm" in name \
        or "RMSNorm" in name


def _run(model: nn.Module, batch: Any) -> None:
    try:
        forward(model, batch)
    except _Stop:
        pass


def _hooked(body: Callable[[], Any], install: Callable[[List[Any]], None]) -> Any:
    """``body()`` with the hooks ``install`` registers (into the list it gets), removed however it ends."""
    handles: List[Any] = []

    def run() -> Any:
        install(handles)
        return body()

    return run_then_clean(run, lambda: [handles.pop().remove() for _ in list(handles)])


def find_joins(model: nn.Module, batch: Any, readers: List[Reader], dense: DenseView) -> Dict[int, nn.Module]:
    """``id(reader) -> norm`` for each reader whose output joins the stream additively at that norm's input.

    The model runs densely (inside ``dense()``) on ``batch``: once to find, for each reader, the first norm
    that runs after it; then once per reader with a random perturbation added to its output, to check that
    the norm's input moved by exactly that perturbation. Readers called more than once per forward, readers
    that share a join, and joins of another shape are left out (they keep the plain refit).

    Examples:
        >>> import contextlib, torch, transformers
        >>> cfg = transformers.BertConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        ...                               num_attention_heads=2)
        >>> torch.manual_seed(0); model = transformers.BertModel(cfg).eval()
        <torch._C.Generator object at ...>
        >>> down = model.encoder.layer[0].output.dense
        >>> joins = find_joins(model, {"input_ids": torch.randint(0, 32, (2, 6))}, [down], contextlib.nullcontext)
        >>> joins[id(down)] is model.encoder.layer[0].output.LayerNorm
        True
    """
    wanted = {id(r): r for r in readers}
    norms = [m for m in model.modules() if _is_norm(m)]
    order: List[Tuple[str, nn.Module]] = []
    calls: Dict[int, int] = {}

    def ran(m: nn.Module, args: Tuple[Any, ...], out: Any) -> None:
        order.append(("r", m))
        calls[id(m)] = calls.get(id(m), 0) + 1

    def normed(m: nn.Module, args: Tuple[Any, ...]) -> None:
        order.append(("n", m))

    def install_order(handles: List[Any]) -> None:
        handles.extend(r.register_forward_hook(ran) for r in readers)
        handles.extend(n.register_forward_pre_hook(normed) for n in norms)

    with dense():
        _hooked(lambda: forward(model, batch), install_order)
    joins: Dict[int, nn.Module] = {}
    for i, (kind, m) in enumerate(order):
        if kind == "r" and calls.get(id(m)) == 1:
            nxt = next((n for k, n in order[i + 1:] if k == "n"), None)
            if nxt is not None:
                joins[id(m)] = nxt
    shared = [n for n in joins.values() if sum(1 for o in joins.values() if o is n) > 1]
    joins = {k: n for k, n in joins.items() if not any(n is s for s in shared)}
    with dense():
        return {k: n for k, n in joins.items() if _additive(model, batch, wanted[k], n)}


def _additive(model: nn.Module, batch: Any, reader: Reader, norm: nn.Module) -> bool:
    """Whether adding ``d`` to ``reader``'s output adds exactly ``d`` to ``norm``'s input."""
    seen: Dict[str, Tensor] = {}
    delta: List[Optional[Tensor]] = [None]

    def at_norm(m: nn.Module, args: Tuple[Any, ...]) -> None:
        seen["s"] = args[0].detach()
        raise _Stop

    def perturb(m: nn.Module, args: Tuple[Any, ...], out: Tensor) -> Optional[Tensor]:
        seen["o"] = out.detach()
        if delta[0] is None:
            return None
        return out + delta[0]

    def once() -> Optional[Tensor]:
        _hooked(lambda: _run(model, batch), lambda h: h.extend([norm.register_forward_pre_hook(at_norm),
                                                                reader.register_forward_hook(perturb)]))
        return seen.get("s")

    base = once()
    if base is None or "o" not in seen or seen["o"].shape != base.shape:
        return False
    gen = torch.Generator().manual_seed(0)
    d = torch.randn(base.shape, generator=gen, dtype=torch.float32).to(base.device, base.dtype)
    step = d * base.float().std().clamp_min(1e-6).to(base.dtype)
    delta[0] = step
    moved = once()
    if moved is None:
        return False
    dev = float(((moved.float() - base.float()) - step.float()).norm() / step.float().norm().clamp_min(1e-30))
    return dev <= ADDITIVE_TOLERANCE


def _dense_output(weight: Tensor, bias: Optional[Tensor], conv1d: bool) -> Callable[..., Tensor]:
    """A forward hook making a reader compute with the given (original) weight and bias."""
    w = weight.T if conv1d else weight

    def hook(m: nn.Module, args: Tuple[Any, ...], out: Tensor) -> Tensor:
        return F.linear(args[0], w, bias)

    return hook


def teacher_moments(model: nn.Module, batches: List[Any], readers: List[Reader], joins: Dict[int, nn.Module],
                    originals: Dict[int, Tuple[Reader, Tensor, Optional[Tensor]]], dense: DenseView) -> Moments:
    """The moments of each reader's fit to ``t = s_dense - (s - o)`` on its inputs ``x`` (every reader in
    ``readers`` has a join in ``joins``).

    Per batch: the dense pass (inside ``dense()``; the readers in ``originals`` compute with the original
    weights kept there) records ``s_dense`` at each join; the shrunk pass then records the reader's input
    ``x`` (before any emulation hook zeroes it), its output ``o`` and the join's input ``s``. Padding is
    left out. Each pass stops once every join has been seen.

    Examples:
        >>> import contextlib, torch, transformers
        >>> cfg = transformers.BertConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        ...                               num_attention_heads=2)
        >>> torch.manual_seed(0); model = transformers.BertModel(cfg).eval()
        <torch._C.Generator object at ...>
        >>> down, batch = model.encoder.layer[0].output.dense, {"input_ids": torch.randint(0, 32, (2, 6))}
        >>> joins = find_joins(model, batch, [down], contextlib.nullcontext)
        >>> g, c, tt, rows = teacher_moments(model, [batch], [down], joins, {}, contextlib.nullcontext)[id(down)]
        >>> g.shape, c.shape, rows     # unchanged model: the target is the layer's own output
        (torch.Size([33, 33]), torch.Size([16, 33]), 12)
    """
    stats: Dict[int, List[Any]] = {id(r): [None, None, 0.0, 0] for r in readers}
    targets: Dict[int, Tensor] = {}
    mask: List[Optional[Tensor]] = [None]
    join_of = {id(r): joins[id(r)] for r in readers}
    by_norm: Dict[int, int] = {id(n): k for k, n in join_of.items()}

    def install_dense(handles: List[Any]) -> None:
        for reader, weight, bias in originals.values():
            handles.append(reader.register_forward_hook(_dense_output(weight, bias, not isinstance(reader, nn.Linear))))
        for n in join_of.values():
            handles.append(n.register_forward_pre_hook(at_dense_join))

    def at_dense_join(m: nn.Module, args: Tuple[Any, ...]) -> None:
        if by_norm[id(m)] not in targets:  # a norm that runs again later in the forward counts once
            targets[by_norm[id(m)]] = token_rows(args[0].detach(), mask[0])
        if len(targets) == len(join_of):
            raise _Stop

    inputs: Dict[int, Tensor] = {}
    outputs: Dict[int, Tensor] = {}
    done: set = set()

    def at_input(m: nn.Module, args: Tuple[Any, ...]) -> None:
        x = token_rows(args[0].detach(), mask[0])
        inputs[id(m)] = torch.cat([x, torch.ones(x.shape[0], 1, dtype=x.dtype, device=x.device)], 1)

    def at_output(m: nn.Module, args: Tuple[Any, ...], out: Tensor) -> None:
        outputs[id(m)] = token_rows(out.detach(), mask[0])

    def at_join(m: nn.Module, args: Tuple[Any, ...]) -> None:
        k = by_norm[id(m)]
        if k not in inputs or k not in targets:  # the norm ran before the reader, or runs again
            return
        x, t = inputs.pop(k), targets.pop(k) - token_rows(args[0].detach(), mask[0]) + outputs.pop(k)
        s = stats[k]
        s[0] = x.T @ x if s[0] is None else s[0].add_(x.T @ x)
        s[1] = t.T @ x if s[1] is None else s[1].add_(t.T @ x)
        s[2] += float((t * t).sum())
        s[3] += x.shape[0]
        done.add(k)
        if len(done) == len(join_of):
            raise _Stop

    def install_shrunk(handles: List[Any]) -> None:
        for r in readers:
            handles.append(r.register_forward_pre_hook(at_input, prepend=True))
            handles.append(r.register_forward_hook(at_output))
        for n in join_of.values():
            handles.append(n.register_forward_pre_hook(at_join))

    for batch in batches:
        mask[0] = token_mask(batch)
        targets.clear()
        with dense():
            _hooked(lambda: _run(model, batch), install_dense)
        done.clear()
        _hooked(lambda: _run(model, batch), install_shrunk)
    return {k: (v[0], v[1], v[2], v[3]) for k, v in stats.items() if v[0] is not None}

