"""PEFT LoRA on a pruned base: adapters whose update keeps the base's zeros, merged or not.

Merging a LoRA adapter into a pruned ``Linear`` keeps it sparse: PEFT writes
``weight += delta`` through the pruned name, which lands in ``weight_orig``
at the unpruned entries (prunekit's write rule), so the merged weight is
``(W + ΔW) ⊙ M`` -- the adapter's update at pruned entries is dropped. An
adapter trained the usual way computes ``W ⊙ M + ΔW`` (the dense update)
before the merge, so the merged model's output differs from the unmerged
one's by ``(ΔW ⊙ (1 − M)) x``.

:func:`mask_lora_updates` makes the adapters of pruned layers compute the
masked update ``ΔW ⊙ M`` in their forward pass too (and train it: gradients
reach ``lora_A``/``lora_B`` only through unpruned entries), so the unmerged
model computes exactly what the merged one will, and merging changes no
output. It installs a LoRA variant (PEFT's own extension point for DoRA and
friends) on each adapter of a pruned layer; the cost is one ``out x in``
product per forward (the adapter is no longer applied as two thin matmuls).
To merge densely on purpose (the base no longer pruned), call
``prunekit.remove(layer.base_layer, "weight")`` before merging.

Examples:
    >>> import torch, prunekit
    >>> from torch import nn
    >>> import peft
    >>> from prunekit.compat.peft import mask_lora_updates
    >>> _ = torch.manual_seed(0)
    >>> base = nn.Sequential(nn.Linear(8, 8))
    >>> _ = prunekit.l1_unstructured(base[0], "weight", 0.5)
    >>> model = peft.get_peft_model(base, peft.LoraConfig(r=2, target_modules=["0"], init_lora_weights=False))
    >>> mask_lora_updates(model)
    1
    >>> x = torch.randn(3, 8)
    >>> with torch.no_grad():
    ...     unmerged = model(x)
    ...     merged = model.merge_and_unload()(x)
    >>> torch.allclose(unmerged, merged, atol=1e-6), int((base[0].weight == 0).sum())
    (True, 32)
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn
from torch.nn import functional as F

from .. import reparam

__all__ = ["mask_lora_updates"]


def _mask(module: Any) -> Tensor:
    mask = reparam.get_mask(module.get_base_layer(), "weight")
    if mask is None:
        raise ValueError(f"{type(module).__name__}: its base layer is no longer pruned; the masked LoRA update needs "
                         "the base's weight_mask (prune it again, or remove the adapter's variant)")
    return mask


def _delta(module: Any, adapter: str) -> Tensor:
    """The adapter's update ``ΔW`` in the weight's layout, masked like the base weight (autograd keeps it)."""
    delta = module.get_delta_weight(adapter)
    mask = _mask(module)
    return delta * (mask if mask.dtype == delta.dtype else mask.to(delta.dtype))


def _variant_class() -> type:
    from peft.tuners.lora.layer import LoraVariant

    class MaskedLoraVariant(LoraVariant):
        """LoRA whose update is masked like its pruned base (``prunekit.compat.peft``)."""

        @staticmethod
        def init(module: Any, adapter_name: str, **kwargs: Any) -> None:
            _mask(module)

        @staticmethod
        def merge_safe(module: Any, active_adapter: str, orig_weight: Tensor) -> Tensor:
            return orig_weight + _delta(module, active_adapter).to(orig_weight.dtype)

        @staticmethod
        def merge_unsafe(module: Any, active_adapter: str, orig_weight: Tensor) -> None:
            orig_weight.data += _delta(module, active_adapter).to(orig_weight.dtype)

        @staticmethod
        def unmerge(module: Any, active_adapter: str, orig_weight: Tensor) -> Tensor:
            return orig_weight - _delta(module, active_adapter).to(orig_weight.dtype)

        @staticmethod
        def forward(module: Any, active_adapter: str, x: Tensor, result: Tensor, **kwargs: Any) -> Tensor:
            dropout = module.lora_dropout[active_adapter]
            out = F.linear(dropout(x), _delta(module, active_adapter))
            if module.lora_bias.get(active_adapter, False):
                out = out + module.lora_B[active_adapter].bias * module.scaling[active_adapter]
            return result + out.to(result.dtype)

    return MaskedLoraVariant


def mask_lora_updates(model: nn.Module) -> int:
    """Make every LoRA adapter of a pruned ``Linear`` in ``model`` compute (and train) the masked update.

    Call it after ``peft.get_peft_model`` (and after adding adapters), before
    training or evaluating the unmerged model. Returns how many adapters it
    changed. Adapters that already use a LoRA variant (DoRA, ...) or layers
    whose weights are merged are refused with a ``ValueError``, nothing
    changed. See the module docstring (and its example).
    """
    from peft.tuners.lora.layer import Linear as LoraLinear

    todo = []
    for name, module in model.named_modules():
        if not isinstance(module, LoraLinear) or reparam.get_mask(module.get_base_layer(), "weight") is None:
            continue
        if module.merged:
            raise ValueError(f"{name}: adapters {module.merged_adapters} are merged into the pruned base; "
                             "unmerge them first (model.unmerge_adapter())")
        for adapter in module.lora_A:
            variant = module.lora_variant.get(adapter)
            if variant is not None and type(variant).__name__ != "MaskedLoraVariant":
                raise ValueError(f"{name}: adapter {adapter!r} already uses the LoRA variant {type(variant).__name__}; "
                                 "mask_lora_updates supports plain LoRA only")
            if variant is None:
                todo.append((module, adapter))
    variant_cls = _variant_class()
    done = []
    try:  # all or nothing, an interrupt included
        for module, adapter in todo:
            done.append((module, adapter))
            module.lora_variant[adapter] = variant_cls()
        return len(todo)
    except BaseException:
        for module, adapter in done:
            module.lora_variant.pop(adapter, None)
        raise

