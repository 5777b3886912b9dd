"""Handlers for ``torch.nn`` layers: Linear, Conv1d/2d/3d, BatchNorm, GroupNorm, LayerNorm, Embedding."""

from __future__ import annotations

from typing import Any, Dict, Optional

import torch
from torch import Tensor, nn

from ..weights import maybe
from .base import Entry, ModuleHandler, Slot, arg, entries, has_tensor, register_handler
from ..proofs.constants import affine_row_values, any_masked, scale_shift_values

__all__ = ["BatchNormHandler", "ConvHandler", "ConvTransposeHandler", "EmbeddingHandler", "GroupNormHandler", "LayerNormHandler", "LinearHandler"]


@register_handler(nn.Linear)
class LinearHandler(ModuleHandler[nn.Linear]):
    classifier = True

    def slots(self, m: nn.Linear) -> Dict[str, Slot]:
        out = entries(("weight", 0), ("bias", 0)) if has_tensor(m, "bias") else entries(("weight", 0))
        return {
            "in": Slot(m.in_features, entries(("weight", 1, 0, "in")), role="in"),
            "out": Slot(m.out_features, out, role="out"),
        }

    def trace(self, m, name, tracer, args, kwargs, output):
        x = arg(args, kwargs, 0, "input")
        tracer.bind(x, -1, tracer.slot(name, "in"))
        if _single_output(tracer, name, m.out_features):
            return
        values = affine_row_values(m, "weight", "bias", tracer.values_in(x, -1))
        tracer.emit(output, -1, tracer.slot(name, "out"), values)

    def attrs(self, m, sizes):
        return {"in_features": sizes["in"], "out_features": sizes["out"]}

    def fold_constant(self, m, slot):
        if slot == "in" and has_tensor(m, "bias"):
            return [("weight", 1, 0, "bias")]
        return "Linear has no bias to take the constant (bias=False)"


@register_handler(nn.Conv1d, nn.Conv2d, nn.Conv3d)
class ConvHandler(ModuleHandler[nn.modules.conv._ConvNd]):
    """Conv1d/2d/3d. Grouped and depthwise convs are pruned by whole groups."""

    classifier = True

    def slots(self, m: nn.modules.conv._ConvNd) -> Dict[str, Slot]:
        out = entries(("weight", 0), ("bias", 0)) if has_tensor(m, "bias") else entries(("weight", 0))
        ins = entries(("weight", 1, 0, "in")) if m.groups == 1 else []
        return {"in": Slot(m.in_channels, ins, role="in"), "out": Slot(m.out_channels, out, role="out")}

    def trace(self, m, name, tracer, args, kwargs, output):
        x = arg(args, kwargs, 0, "input")
        cdim = x.dim() - len(m.kernel_size) - 1
        ins, outs = tracer.slot(name, "in"), tracer.slot(name, "out")
        tracer.bind(x, cdim, ins)
        if m.groups == 1 and _single_output(tracer, name, m.out_channels, "out"):
            return
        if m.groups > 1:
            tracer.tie(torch.cat([ins.view(m.groups, -1), outs.view(m.groups, -1)], dim=1))
        values = affine_row_values(m, "weight", "bias", tracer.values_in(x, cdim), groups=m.groups,
                                   position_dependent=_zero_padded(m) is not None)
        tracer.emit(output, cdim, outs, values)

    def attrs(self, m, sizes):
        a = {"in_channels": sizes["in"], "out_channels": sizes["out"]}
        if m.groups > 1:
            a["groups"] = sizes["in"] // (m.in_channels // m.groups)
        return a

    def fold_constant(self, m, slot):
        if slot != "in" or m.groups != 1:
            return f"grouped convolution '{type(m).__name__}' reads its channels inside its groups"
        padded = _zero_padded(m)
        if padded:
            return padded
        if not has_tensor(m, "bias"):
            return f"{type(m).__name__} has no bias to take the constant (bias=False)"
        return [("weight", 1, 0, "bias")]


def _single_output(tracer: Any, name: str, n_out: int, slot: str = "out") -> bool:
    """A layer with one output channel: the channel is never removed (the layer would go), so its
    slot is blocked and its output left without channel labels -- a per-position scalar that may
    scale or gate other channels (``sigmoid(gate(x)) * y``) without coupling them together."""
    if n_out != 1:
        return False
    tracer.block(tracer.slot(name, slot), f"'{name}' has a single output channel, which is never removed")
    return True


def _zero_padded(m: nn.modules.conv._ConvNd) -> Optional[str]:
    """Why a constant input channel would not give a position-independent contribution, or None."""
    if m.padding_mode != "zeros":
        return None  # replicate/reflect/circular padding of a constant is the constant
    pad = m.padding
    if pad == "valid" or (isinstance(pad, tuple) and not any(pad)):
        return None
    if pad == "same" and all(k == 1 for k in m.kernel_size):
        return None
    return (f"{type(m).__name__} pads with zeros (padding={pad}), so a constant input contributes differently "
            "at the borders")


@register_handler(nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)
class ConvTransposeHandler(ModuleHandler[nn.modules.conv._ConvTransposeNd]):
    """ConvTranspose1d/2d/3d (weight ``in x out/groups x kernel``); grouped ones are blocked."""

    classifier = True

    def slots(self, m: nn.modules.conv._ConvTransposeNd) -> Dict[str, Slot]:
        out = entries(("weight", 1), ("bias", 0)) if has_tensor(m, "bias") else entries(("weight", 1))
        return {"in": Slot(m.in_channels, entries(("weight", 0, 0, "in")), role="in"),
                "out": Slot(m.out_channels, out, role="out")}

    def trace(self, m, name, tracer, args, kwargs, output):
        x = arg(args, kwargs, 0, "input")
        cdim = x.dim() - len(m.kernel_size) - 1
        ins, outs = tracer.slot(name, "in"), tracer.slot(name, "out")
        if m.groups > 1:
            reason = f"grouped {type(m).__name__} '{name}' is not supported"
            tracer.block(ins, reason)
            tracer.block(outs, reason)
            return
        tracer.bind(x, cdim, ins)
        # a masked output channel holds its bias everywhere (the kernel's overlap count varies, so
        # constant inputs do not give constant outputs)
        values = affine_row_values(m, "weight", "bias", None, out_axis=1, in_axis=0)
        tracer.emit(output, cdim, outs, values)

    def attrs(self, m, sizes):
        return {"in_channels": sizes["in"], "out_channels": sizes["out"]}


@register_handler(nn.modules.batchnorm._BatchNorm)
class BatchNormHandler(ModuleHandler[nn.modules.batchnorm._BatchNorm]):
    def slots(self, m: nn.modules.batchnorm._BatchNorm) -> Dict[str, Slot]:
        affine = ("weight", 0, 0, "norm"), ("bias", 0, 0, "norm")
        stats = ("running_mean", 0, 0, "buffer"), ("running_var", 0, 0, "buffer")
        e = entries(*(affine if m.affine else ()), *(stats if m.track_running_stats and m.running_mean is not None else ()))
        return {"features": Slot(m.num_features, e, role="norm")}

    def trace(self, m, name, tracer, args, kwargs, output):
        ids = tracer.slot(name, "features")
        x = arg(args, kwargs, 0, "input")
        tracer.bind(x, 1, ids)
        vin = tracer.values_in(x, 1)
        values = None
        if vin is not None or any_masked(m, "weight", "bias"):
            w, b = maybe(m, "weight"), maybe(m, "bias")
            running = m.running_mean is not None and not m.training
            values = scale_shift_values(w, b, vin, m.num_features, m.running_mean if running else None,
                                        m.running_var if running else None, m.eps)
            if vin is not None and not running:  # batch statistics: a constant channel normalizes to 0
                shift = b.to(torch.float64) if b is not None else torch.zeros(m.num_features, dtype=torch.float64)
                const = ~torch.isnan(vin)
                values = torch.where(const, shift, values if values is not None else torch.full_like(shift, float("nan")))
        tracer.emit(output, 1, ids, values)

    def attrs(self, m, sizes):
        return {"num_features": sizes["features"]}


@register_handler(nn.GroupNorm)
class GroupNormHandler(ModuleHandler[nn.GroupNorm]):
    """GroupNorm is pruned by whole groups, which leaves the other groups' statistics exact."""

    def slots(self, m: nn.GroupNorm) -> Dict[str, Slot]:
        e = [Entry("weight", 0, role="norm")] if m.affine else []
        if m.affine and has_tensor(m, "bias"):  # timm's GroupNorm1NoBias drops it
            e.append(Entry("bias", 0, role="norm"))
        return {"channels": Slot(m.num_channels, e, role="norm", tie=m.num_channels // m.num_groups)}

    def trace(self, m, name, tracer, args, kwargs, output):
        ids = tracer.slot(name, "channels")
        tracer.bind(arg(args, kwargs, 0, "input"), 1, ids)
        tracer.emit(output, 1, ids, _shift_where_unscaled(m, m.num_channels))

    def attrs(self, m, sizes):
        per = m.num_channels // m.num_groups
        return {"num_channels": sizes["channels"], "num_groups": sizes["channels"] // per}


@register_handler(nn.LayerNorm)
class LayerNormHandler(ModuleHandler[nn.LayerNorm]):
    """LayerNorm over the last dimension.

    Removing features changes the mean and variance it computes, so with
    ``exact=True`` (the default) its features are blocked; ``exact=False`` allows
    it (the compacted model then differs from the masked one).
    """

    def slots(self, m: nn.LayerNorm) -> Dict[str, Slot]:
        e = []
        if m.elementwise_affine:
            e.append(Entry("weight", 0, role="norm"))
            if has_tensor(m, "bias"):
                e.append(Entry("bias", 0, role="norm"))
        return {"features": Slot(m.normalized_shape[-1], e, role="norm")}

    def trace(self, m, name, tracer, args, kwargs, output):
        ids = tracer.slot(name, "features")
        x = arg(args, kwargs, 0, "input")
        tracer.bind(x, -1, ids)
        if len(m.normalized_shape) != 1:
            tracer.block(ids, f"LayerNorm '{name}' normalizes over several dimensions {tuple(m.normalized_shape)}")
            return
        if tracer.exact:
            tracer.block(
                ids,
                f"LayerNorm '{name}' normalizes over these features: removing some changes its statistics "
                "(pass exact=False to prune them anyway)",
            )
        tracer.emit(output, -1, ids, _shift_where_unscaled(m, m.normalized_shape[-1]))

    def attrs(self, m, sizes):
        return {"normalized_shape": (sizes["features"],)}


@register_handler(nn.Embedding)
class EmbeddingHandler(ModuleHandler[nn.Embedding]):
    def slots(self, m: nn.Embedding) -> Dict[str, Slot]:
        return {"dim": Slot(m.embedding_dim, [Entry("weight", 1)], role="out")}

    def trace(self, m, name, tracer, args, kwargs, output):
        ids = tracer.slot(name, "dim")
        if m.max_norm is not None:
            tracer.block(ids, f"Embedding '{name}' renormalizes rows (max_norm)")
        values = None
        if any_masked(m, "weight"):  # a masked column is zero for every token
            w = maybe(m, "weight")
            zero = ~(w != 0).any(dim=0)
            values = torch.where(zero, torch.zeros(w.shape[1], dtype=torch.float64), float("nan"))
        tracer.emit(output, -1, ids, values)

    def attrs(self, m, sizes):
        return {"embedding_dim": sizes["dim"]}


def _shift_where_unscaled(m: nn.Module, n: int) -> Optional[Tensor]:
    """A normalization's output where its scale is masked to zero: its shift (0 without one)."""
    if not any_masked(m, "weight", "bias"):
        return None
    return scale_shift_values(maybe(m, "weight"), maybe(m, "bias"), None, n)
