"""Mixture-of-experts layers of Hugging Face ``transformers`` 5: the router and the experts module.

Mixtral, Qwen2-MoE, Qwen3-MoE (and the other families built the same way) keep a
block's experts in one module with 3-D parameters -- ``gate_up_proj`` ``[E, 2*I, H]``
and ``down_proj`` ``[E, H, I]`` -- run per expert (indexing), batched or through
``torch._grouped_mm``, and choose them with a router holding a bare ``weight``
``[E, H]`` that returns ``(logits, scores, indices)``. Both are leaves of the trace,
matched by their attributes (``transformers`` is never imported here):

* the router reads the hidden size (``weight`` axis 1); its outputs are routing
  decisions, not channels, so they carry no channel labels;
* the experts module reads the hidden size (``gate_up_proj``'s input axis) and writes
  it (``down_proj``'s output axis). Its feed-forward neurons are described as one unit
  per neuron index -- gate row ``j``, up row ``I + j`` (the ``j``-th pair when the layout
  is interleaved) and ``down_proj`` column ``j`` of every expert -- and blocked: whole
  experts and expert FFN neurons (which may differ per expert) are removed by
  :mod:`prunekit.shrink` (``remove_experts``, ``shrink_expert_ffn``), which also
  updates the config.

``torch._grouped_mm`` (``transformers``' default experts implementation) needs rows of a
multiple of 16 bytes: keep the hidden size a multiple of 8 (``prune_groups(...,
round_to=8)``), or run the experts with ``config._experts_implementation = "eager"``;
otherwise the compacted model fails :func:`~prunekit.compact.compact`'s check and the
model is left as it was.
"""

from __future__ import annotations

from typing import Any, Dict

import torch
from torch import nn

from ... import reparam
from ...moe import ExpertsLayout, experts_layout, is_router
from .base import Entry, ModuleHandler, Slot, TracerAPI, arg, first, has_tensor, register_handler
from ..proofs.constants import affine_row_values

__all__ = ["ExpertsHandler", "RouterHandler"]


@register_handler(predicate=lambda m: experts_layout(m) is not None)
class ExpertsHandler(ModuleHandler):
    """The experts module of a ``transformers`` mixture-of-experts block (see the module docstring).

    Slots: ``in`` (hidden, read), ``out`` (hidden, written), ``up`` (the rows of ``gate_up_proj``
    or ``up_proj``) and ``down_in`` (``down_proj``'s columns), tied per neuron and blocked.
    """

    def slots(self, m: nn.Module) -> Dict[str, Slot]:
        lay = _layout(m)
        up_rows = [Entry(lay.up, lay.out_axis)]
        if has_tensor(m, f"{lay.up}_bias"):
            up_rows.append(Entry(f"{lay.up}_bias", 1))
        out_rows = [Entry("down_proj", lay.out_axis)]
        if has_tensor(m, "down_proj_bias"):
            out_rows.append(Entry("down_proj_bias", 1))
        return {
            "in": Slot(lay.hidden, [Entry(lay.up, lay.in_axis, 0, "in")], role="in"),
            "up": Slot((2 if lay.gated else 1) * lay.intermediate, up_rows, role="out"),
            "down_in": Slot(lay.intermediate, [Entry("down_proj", lay.in_axis, 0, "in")], role="in"),
            "out": Slot(lay.hidden, out_rows, role="out"),
        }

    def trace(self, m: nn.Module, name: str, tracer: TracerAPI, args: tuple, kwargs: dict, output: Any) -> None:
        lay = _layout(m)
        ids = {s: tracer.slot(name, s) for s in ("in", "up", "down_in", "out")}
        tracer.bind(arg(args, kwargs, 0, "hidden_states"), -1, ids["in"])
        n = lay.intermediate
        if not lay.gated:
            up = ids["up"].view(n, 1)
        elif lay.interleaved:  # gate and up rows alternate
            up = ids["up"].view(n, 2)
        else:  # all gate rows, then all up rows
            up = ids["up"].view(2, n).t()
        tracer.tie(torch.cat([up, ids["down_in"].view(n, 1)], dim=1))
        tracer.block(ids["down_in"], f"the FFN neurons of experts '{name}' are removed by "
                     "prunekit.shrink.shrink_expert_ffn (per expert, with the config), not by compaction")
        # routing scales and sums experts' outputs: a channel whose down_proj rows are zero in every
        # expert is zero (with per-expert biases it would depend on the routing)
        values = None
        if not has_tensor(m, "down_proj_bias"):
            values = affine_row_values(m, "down_proj", None, None, lay.out_axis, lay.in_axis)
        tracer.emit(first(output), -1, ids["out"], values)

    def attrs(self, m: nn.Module, sizes: Dict[str, int]) -> Dict[str, Any]:
        a: Dict[str, Any] = {}
        for attr, size in (("hidden_dim", sizes["in"]), ("hidden_size", sizes["in"]),
                           ("intermediate_dim", sizes["down_in"]), ("intermediate_size", sizes["down_in"])):
            v = getattr(m, attr, None)
            if isinstance(v, int) and not isinstance(v, bool):
                a[attr] = size
        return a


def _layout(m: nn.Module) -> ExpertsLayout:
    lay = experts_layout(m)
    if lay is None:
        raise RuntimeError(f"{type(m).__name__} is no longer a supported experts layout (was it changed after tracing?)")
    return lay


@register_handler(predicate=is_router)
class RouterHandler(ModuleHandler):
    """A mixture-of-experts router: only its hidden-size input is a slot; its logits, scores and
    expert indices are routing decisions, not channels (they carry no channel labels)."""

    def slots(self, m: nn.Module) -> Dict[str, Slot]:
        w = reparam.stored(m, "weight")
        if w is None:
            raise TypeError(f"router {type(m).__name__} has no weight (is_router accepts only modules with one)")
        return {"in": Slot(int(w.shape[1]), [Entry("weight", 1, 0, "in")], role="in")}

    def trace(self, m: nn.Module, name: str, tracer: TracerAPI, args: tuple, kwargs: dict, output: Any) -> None:
        tracer.bind(arg(args, kwargs, 0, "hidden_states"), -1, tracer.slot(name, "in"))

    def attrs(self, m: nn.Module, sizes: Dict[str, int]) -> Dict[str, Any]:
        v = getattr(m, "hidden_dim", None)
        return {"hidden_dim": sizes["in"]} if isinstance(v, int) and not isinstance(v, bool) else {}
