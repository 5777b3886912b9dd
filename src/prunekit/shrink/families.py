"""Where a Hugging Face family keeps what shrinking changes: its block list and config keys.

The records are :class:`prunekit.compact.hf_config.HFFamily`, in one table keyed by
``config.model_type`` (:data:`prunekit.compact.hf_config.FAMILIES`); shrinking serves the
families whose block list it knows. Every shrinking axis (hidden size, depth, experts) looks its
family up here and raises a :class:`ValueError` naming the family when it is not known, so an
unsupported model is an error, never a silently wrong one.
"""

from __future__ import annotations

from typing import Dict, Tuple

from torch import nn

from ..compact.hf_config import FAMILIES as CONFIG_FAMILIES
from ..compact.hf_config import HFFamily

__all__ = ["FAMILIES", "family_of", "layer_list"]


#: model_type -> family, for the families whose blocks shrinking knows (``layers``); the one table is
#: :data:`prunekit.compact.hf_config.FAMILIES`: add a family there
FAMILIES: Dict[str, HFFamily] = {k: f for k, f in CONFIG_FAMILIES.items() if f.layers}


def family_of(model: nn.Module, what: str = "prunekit.shrink") -> Tuple[str, HFFamily]:
    """``(model_type, family)`` of a Hugging Face model; ``ValueError`` naming the family if unknown.

    Examples:
        >>> import transformers
        >>> cfg = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
        ...                                num_hidden_layers=2, num_attention_heads=2)
        >>> name, family = family_of(transformers.LlamaForCausalLM(cfg))
        >>> name, family.layers, family.layers_key, family.moe
        ('llama', ('layers',), 'num_hidden_layers', False)
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
                         f"families: {known} (add one to prunekit.compact.hf_config.FAMILIES)")
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
                     "its layout differs from its family's (add its path to prunekit.compact.hf_config.FAMILIES)")
