"""Handlers for ``torch.nn`` layers: Linear, Conv1d/2d/3d, BatchNorm, GroupNorm, LayerNorm, Embedding."""

from __future__ import annotations

from typing import Dict

import torch
from torch import nn

from .base import Entry, ModuleHandler, Slot, arg, entries, has_tensor, register_handler

__all__ = ["BatchNormHandler", "ConvHandler", "EmbeddingHandler", "GroupNormHandler", "LayerNormHandler", "LinearHandler"]


@register_handler(nn.Linear)
class LinearHandler(ModuleHandler):
    classifier = True

    def slots(self, m: nn.Module) -> Dict[str, Slot]:
        out = entries(("weight", 0), ("bias", 0)) if has_tensor(m, "bias") else entries(("weight", 0))
        return {
            "in": Slot(m.in_features, entries(("weight", 1, 0, "in")), role="in"),
            "out": Slot(m.out_features, out, role="out"),
        }

    def trace(self, m, name, tracer, args, kwargs, output):
        tracer.bind(arg(args, kwargs, 0, "input"), -1, tracer.slot(name, "in"))
        tracer.emit(output, -1, tracer.slot(name, "out"))

    def attrs(self, m, sizes):
        return {"in_features": sizes["in"], "out_features": sizes["out"]}


@register_handler(nn.Conv1d, nn.Conv2d, nn.Conv3d)
class ConvHandler(ModuleHandler):
    """Conv1d/2d/3d. Grouped and depthwise convs are pruned by whole groups."""

    classifier = True

    def slots(self, m: nn.Module) -> Dict[str, Slot]:
        out = entries(("weight", 0), ("bias", 0)) if has_tensor(m, "bias") else entries(("weight", 0))
        ins = entries(("weight", 1, 0, "in")) if m.groups == 1 else []
        return {"in": Slot(m.in_channels, ins, role="in"), "out": Slot(m.out_channels, out, role="out")}

    def trace(self, m, name, tracer, args, kwargs, output):
        x = arg(args, kwargs, 0, "input")
        cdim = x.dim() - len(m.kernel_size) - 1
        ins, outs = tracer.slot(name, "in"), tracer.slot(name, "out")
        tracer.bind(x, cdim, ins)
        if m.groups > 1:
            tracer.tie(torch.cat([ins.view(m.groups, -1), outs.view(m.groups, -1)], dim=1))
        tracer.emit(output, cdim, outs)

    def attrs(self, m, sizes):
        a = {"in_channels": sizes["in"], "out_channels": sizes["out"]}
        if m.groups > 1:
            a["groups"] = sizes["in"] // (m.in_channels // m.groups)
        return a


@register_handler(nn.modules.batchnorm._BatchNorm)
class BatchNormHandler(ModuleHandler):
    def slots(self, m: nn.Module) -> Dict[str, Slot]:
        affine = ("weight", 0, 0, "norm"), ("bias", 0, 0, "norm")
        stats = ("running_mean", 0, 0, "buffer"), ("running_var", 0, 0, "buffer")
        e = entries(*(affine if m.affine else ()), *(stats if m.track_running_stats and m.running_mean is not None else ()))
        return {"features": Slot(m.num_features, e, role="norm")}

    def trace(self, m, name, tracer, args, kwargs, output):
        ids = tracer.slot(name, "features")
        tracer.bind(arg(args, kwargs, 0, "input"), 1, ids)
        tracer.emit(output, 1, ids)

    def attrs(self, m, sizes):
        return {"num_features": sizes["features"]}


@register_handler(nn.GroupNorm)
class GroupNormHandler(ModuleHandler):
    """GroupNorm is pruned by whole groups, which leaves the other groups' statistics exact."""

    def slots(self, m: nn.Module) -> Dict[str, Slot]:
        e = [Entry("weight", 0, role="norm"), Entry("bias", 0, role="norm")] if m.affine else []
        return {"channels": Slot(m.num_channels, e, role="norm", tie=m.num_channels // m.num_groups)}

    def trace(self, m, name, tracer, args, kwargs, output):
        ids = tracer.slot(name, "channels")
        tracer.bind(arg(args, kwargs, 0, "input"), 1, ids)
        tracer.emit(output, 1, ids)

    def attrs(self, m, sizes):
        per = m.num_channels // m.num_groups
        return {"num_channels": sizes["channels"], "num_groups": sizes["channels"] // per}


@register_handler(nn.LayerNorm)
class LayerNormHandler(ModuleHandler):
    """LayerNorm over the last dimension.

    Removing features changes the mean and variance it computes, so with
    ``exact=True`` (the default) its features are blocked; ``exact=False`` allows
    it (the compacted model then differs from the masked one).
    """

    def slots(self, m: nn.Module) -> Dict[str, Slot]:
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
        tracer.emit(output, -1, ids)

    def attrs(self, m, sizes):
        return {"normalized_shape": (sizes["features"],)}


@register_handler(nn.Embedding)
class EmbeddingHandler(ModuleHandler):
    def slots(self, m: nn.Module) -> Dict[str, Slot]:
        return {"dim": Slot(m.embedding_dim, [Entry("weight", 1)], role="out")}

    def trace(self, m, name, tracer, args, kwargs, output):
        ids = tracer.slot(name, "dim")
        if m.max_norm is not None:
            tracer.block(ids, f"Embedding '{name}' renormalizes rows (max_norm)")
        tracer.emit(output, -1, ids)

    def attrs(self, m, sizes):
        return {"embedding_dim": sizes["dim"]}
