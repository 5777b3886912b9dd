"""Where a Hugging Face family keeps what shrinking changes: its layer list and config keys.

One table, keyed by ``config.model_type``. Every shrinking axis (hidden size, depth,
experts) looks its family up here and raises a :class:`ValueError` naming the family
when it is not known, so an unsupported model is an error, never a silently wrong one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple

from torch import nn

__all__ = ["FAMILIES", "ShrinkFamily", "family_of", "layer_list"]


@dataclass(frozen=True)
class ShrinkFamily:
    """A family's layout as shrinking sees it.

    ``layers`` are the dotted paths (tried in order: transformers versions differ), from the
    base model (``model.base_model``), of the ``nn.ModuleList`` of its transformer blocks;
    ``layers_key`` is the config key of their count. ``experts_key`` (the number of routed
    experts) and ``expert_ffn_key`` (each expert's FFN width) are set for mixtures of experts.
    """

    layers: Tuple[str, ...]
    layers_key: str = "num_hidden_layers"
    experts_key: Optional[str] = None
    expert_ffn_key: Optional[str] = None

    @property
    def moe(self) -> bool:
        """Whether blocks may hold a sparse mixture of experts."""
        return self.experts_key is not None


_DECODER = ShrinkFamily(("layers",))
_QWEN_MOE = ShrinkFamily(("layers",), experts_key="num_experts", expert_ffn_key="moe_intermediate_size")
_ENCODER = ShrinkFamily(("encoder.layer", "layers"))

#: model_type -> layout; add an entry (and the axis rules of the other shrink modules) for a new family
FAMILIES: Dict[str, ShrinkFamily] = {
    "llama": _DECODER,
    "mistral": _DECODER,
    "qwen2": _DECODER,
    "qwen3": _DECODER,
    "gemma": _DECODER,
    "gemma2": _DECODER,
    "gemma3_text": _DECODER,
    "phi3": _DECODER,
    "gpt2": ShrinkFamily(("h",), layers_key="n_layer"),
    "opt": ShrinkFamily(("decoder.layers",)),
    "mixtral": ShrinkFamily(("layers",), experts_key="num_local_experts", expert_ffn_key="intermediate_size"),
    "qwen2_moe": _QWEN_MOE,
    "qwen3_moe": _QWEN_MOE,
    "bert": _ENCODER,
    "roberta": _ENCODER,
    "distilbert": ShrinkFamily(("transformer.layer",), layers_key="n_layers"),
    "vit": _ENCODER,
}


def family_of(model: nn.Module, what: str = "prunekit.shrink") -> Tuple[str, ShrinkFamily]:
    """``(model_type, family)`` of a Hugging Face model; ``ValueError`` naming the family if unknown.

    Examples:
        >>> import transformers
        >>> cfg = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
        ...                                num_hidden_layers=2, num_attention_heads=2)
        >>> family_of(transformers.LlamaForCausalLM(cfg))
        ('llama', ShrinkFamily(layers=('layers',), layers_key='num_hidden_layers', experts_key=None, expert_ffn_key=None))
    """
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if not isinstance(model_type, str):
        raise ValueError(f"{what}: {type(model).__name__} is not a Hugging Face model (it has no config.model_type); "
                         "shrink works on transformers models (AutoModel*.from_pretrained)")
    family = FAMILIES.get(model_type)
    if family is None:
        known = ", ".join(sorted(FAMILIES))
        raise ValueError(f"{what}: the family {model_type!r} ({type(model).__name__}) has no shrink handler; known "
                         f"families: {known} (add one to prunekit.shrink.families.FAMILIES)")
    return model_type, family


def _base(model: nn.Module) -> nn.Module:
    """The model that holds the blocks: ``model.base_model`` for heads such as ``*ForCausalLM``."""
    base = getattr(model, "base_model", None)
    return base if isinstance(base, nn.Module) else model


def layer_list(model: nn.Module, what: str = "prunekit.shrink") -> Tuple[str, nn.ModuleList]:
    """``(qualified name, ModuleList)`` of the model's transformer blocks.

    Examples:
        >>> import transformers
        >>> cfg = transformers.GPT2Config(vocab_size=32, n_embd=16, n_layer=3, n_head=2)
        >>> name, blocks = layer_list(transformers.GPT2LMHeadModel(cfg))
        >>> name, len(blocks)
        ('transformer.h', 3)
    """
    _, family = family_of(model, what)
    base = _base(model)
    prefix = next((n for n, m in model.named_modules() if m is base), "")
    for path in family.layers:
        try:
            blocks = base.get_submodule(path)
        except AttributeError:
            continue
        if isinstance(blocks, nn.ModuleList):
            return (f"{prefix}.{path}" if prefix else path), blocks
    raise ValueError(f"{what}: {type(model).__name__} has no block list at {' or '.join(map(repr, family.layers))}; "
                     "its layout differs from its family's (add its path to prunekit.shrink.families.FAMILIES)")
