"""Handlers for Hugging Face layer types that are not ``torch.nn`` classes: GPT-2's
``Conv1D`` (a Linear with its weight transposed) and RMS norms (Llama, Mistral,
Qwen2, T5 and their relatives). Matched by class name and attributes, so
``transformers`` is never imported here."""

from __future__ import annotations

from typing import Any, Dict, List, Union

from torch import nn

from .base import ModuleHandler, Slot, TracerAPI, arg, entries, has_tensor, register_handler
from ..proofs.constants import Fold, affine_row_values

__all__ = ["Conv1DHandler", "RMSNormHandler"]


def _is_conv1d(m: nn.Module) -> bool:
    w = getattr(m, "weight", None)
    return (
        type(m).__name__ == "Conv1D"
        and isinstance(getattr(m, "nf", None), int)
        and isinstance(getattr(m, "nx", None), int)
        and w is not None
        and tuple(w.shape) == (m.nx, m.nf)
    )


@register_handler(predicate=_is_conv1d)
class Conv1DHandler(ModuleHandler[Any]):
    """GPT-2's ``Conv1D(nf, nx)``: ``y = x @ weight + bias`` with ``weight`` of shape ``(nx, nf)``."""

    classifier = True

    def slots(self, m: Any) -> Dict[str, Slot]:  # duck-typed: _is_conv1d checked nx, nf and weight
        out = entries(("weight", 1), ("bias", 0)) if has_tensor(m, "bias") else entries(("weight", 1))
        return {"in": Slot(m.nx, entries(("weight", 0, 0, "in")), role="in"), "out": Slot(m.nf, out, role="out")}

    def trace(self, m: nn.Module, name: str, tracer: TracerAPI, args: tuple, kwargs: dict, output: Any) -> None:
        x = arg(args, kwargs, 0, "x")
        tracer.bind(x, -1, tracer.slot(name, "in"))
        values = affine_row_values(m, "weight", "bias" if has_tensor(m, "bias") else None, tracer.values_in(x, -1),
                                   out_axis=1, in_axis=0)
        tracer.emit(output, -1, tracer.slot(name, "out"), values)

    def attrs(self, m: nn.Module, sizes: Dict[str, int]) -> Dict[str, Any]:
        return {"nx": sizes["in"], "nf": sizes["out"]}

    def fold_constant(self, m: nn.Module, slot: str) -> Union[str, List[Fold]]:
        if slot == "in" and has_tensor(m, "bias"):
            return [("weight", 0, 1, "bias")]
        return "Conv1D has no bias to take the constant"


def _is_rms_norm(m: nn.Module) -> bool:
    name = type(m).__name__
    w = getattr(m, "weight", None)
    eps = getattr(m, "variance_epsilon", getattr(m, "eps", None))
    return (
        (name.endswith("RMSNorm") or name == "T5LayerNorm")
        and isinstance(w, nn.Parameter)
        and w.dim() == 1
        and isinstance(eps, float)
        and not list(m.children())
    )


@register_handler(predicate=_is_rms_norm)
class RMSNormHandler(ModuleHandler[Any]):
    """RMS normalization over the last dimension (``weight * x / rms(x)``).

    Removing features changes the root mean square it divides by, so with
    ``exact=True`` (the default) its features are blocked; ``exact=False`` prunes
    them anyway and :func:`~prunekit.compact.compact` reports the output error.
    """

    def slots(self, m: Any) -> Dict[str, Slot]:  # duck-typed: _is_rms_norm checked its weight
        return {"features": Slot(m.weight.shape[0], entries(("weight", 0, 0, "norm")), role="norm")}

    def trace(self, m: nn.Module, name: str, tracer: TracerAPI, args: tuple, kwargs: dict, output: Any) -> None:
        ids = tracer.slot(name, "features")
        tracer.bind(arg(args, kwargs, 0, "hidden_states"), -1, ids)
        if tracer.exact:
            tracer.block(
                ids,
                f"RMSNorm '{name}' normalizes over these features: removing some changes its statistics "
                "(pass exact=False to prune them anyway; compact() then reports the output error)",
            )
        # no constants claimed: some RMS norms scale by (1 + weight), where a masked weight is not zero
        tracer.emit(output, -1, ids)

    def attrs(self, m: nn.Module, sizes: Dict[str, int]) -> Dict[str, Any]:
        return {"hidden_size": sizes["features"]} if isinstance(getattr(m, "hidden_size", None), int) else {}
