"""Keep a compacted Hugging Face model a Hugging Face model: its config follows its new shapes.

After compaction every block may have fewer attention heads and feed-forward neurons.
When every block has the same sizes (``prune_groups(..., uniform=True)``, or local
pruning of equal blocks) and the family's config can express them, the model's
``config`` is updated (``intermediate_size``, ``num_attention_heads``,
``num_key_value_heads``, ``head_dim``, ...), so ``save_pretrained`` writes a model
that ``from_pretrained`` loads without prunekit. Otherwise the config is left as it
was and the reason is recorded in the compaction description (use
:func:`~prunekit.compact.save_compacted` for such models).
"""

from __future__ import annotations

import copy
import itertools
import logging
import math
import re
from dataclasses import dataclass, replace
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import Tensor, nn

from .. import reparam
from ..transaction import Transaction

from .handlers.projection_attention import layout_of

logger = logging.getLogger(__name__)

__all__ = ["FAMILIES", "HFFamily", "apply_config", "config_mismatch", "rescale_embeddings", "scaled_embeddings",
           "updated_config"]


@dataclass(frozen=True)
class HFFamily:
    """Where a Hugging Face family keeps its sizes: config keys, and the modules that have them.

    ``layers`` are the dotted paths (tried in order: transformers versions differ), from the base
    model (``model.base_model``), of the ``nn.ModuleList`` of its blocks (empty: not shrinkable);
    ``layers_key`` is the config key of their count; ``experts_key`` (the number of routed experts)
    and ``expert_ffn_key`` (each expert's FFN width) are set for mixtures of experts.
    """

    ffn_key: Optional[str]  # None: no dense FFN (routed experts keep their own keys)
    ffn_modules: Tuple[str, ...]  # regexes of the first FFN layers (their output size is the FFN size)
    heads_key: str
    kv_heads_key: Optional[str] = None
    head_dim_key: Optional[str] = None  # None: the head size is derived from hidden_size / heads
    attention: str = r"(self_attn|attention|attn|SelfAttention)$"
    hidden_key: str = "hidden_size"  # the residual stream's width (what its normalizations have)
    ffn_from_input: bool = False  # ffn_modules are the FFN's readers: their input size is the FFN size
    layers: Tuple[str, ...] = ()
    layers_key: str = "num_hidden_layers"
    experts_key: Optional[str] = None
    expert_ffn_key: Optional[str] = None

    @property
    def moe(self) -> bool:
        """Whether blocks may hold a sparse mixture of experts."""
        return self.experts_key is not None


_LLAMA = HFFamily("intermediate_size", (r"mlp\.gate_proj$", r"mlp\.up_proj$"), "num_attention_heads",
                  "num_key_value_heads", "head_dim", r"self_attn$", layers=("layers",))
_ATTENTION_ONLY = HFFamily(None, (), "num_attention_heads", "num_key_value_heads", "head_dim", r"self_attn$",
                           layers=("layers",))
_BERT = HFFamily("intermediate_size", (r"intermediate\.dense$",), "num_attention_heads", attention=r"attention\.self$",
                 layers=("encoder.layer", "layers"))
#: model_type -> family; add an entry to support another family (compaction's config and shrinking)
FAMILIES: Dict[str, HFFamily] = {
    "llama": _LLAMA,
    "mistral": _LLAMA,
    "qwen2": _LLAMA,
    "qwen3": _LLAMA,
    # routed experts keep their widths here (prunekit.shrink changes them, with the config); dense blocks
    # (mlp_only_layers) are listed too, so that a width they do not share leaves the config alone
    "qwen2_moe": replace(_LLAMA, ffn_key="shared_expert_intermediate_size",
                         ffn_modules=(r"mlp\.shared_expert\.gate_proj$", r"mlp\.shared_expert\.up_proj$",
                                      r"mlp\.gate_proj$"),
                         experts_key="num_experts", expert_ffn_key="moe_intermediate_size"),
    "phi3": replace(_LLAMA, ffn_modules=(r"mlp\.down_proj$",), ffn_from_input=True),  # gate_up_proj: two widths
    "mixtral": replace(_ATTENTION_ONLY, experts_key="num_local_experts", expert_ffn_key="intermediate_size"),
    "qwen3_moe": replace(_ATTENTION_ONLY, experts_key="num_experts", expert_ffn_key="moe_intermediate_size"),
    "gemma": _LLAMA,  # scaled embeddings follow a new hidden size: rescale_embeddings
    "gemma2": _LLAMA,
    "gemma3_text": _LLAMA,
    "opt": HFFamily("ffn_dim", (r"\.fc1$",), "num_attention_heads", attention=r"self_attn$", layers=("decoder.layers",)),
    "vit": replace(_BERT, ffn_modules=(r"mlp\.fc1$", r"intermediate\.dense$"), head_dim_key="head_dim",
                   attention=r"attention$"),
    "bert": _BERT,
    "roberta": _BERT,
    "distilbert": HFFamily("hidden_dim", (r"ffn\.lin1$",), "n_heads", attention=r"\.attention$", hidden_key="dim",
                           layers=("transformer.layer",), layers_key="n_layers"),
    "t5": HFFamily("d_ff", (r"DenseReluDense\.wi$", r"DenseReluDense\.wi_0$", r"DenseReluDense\.wi_1$"), "num_heads",
                   head_dim_key="d_kv", attention=r"layer\.0\.SelfAttention$", hidden_key="d_model"),
    "gpt2": HFFamily("n_inner", (r"mlp\.c_fc$",), "n_head", attention=r"\.attn$", hidden_key="n_embd", layers=("h",),
                     layers_key="n_layer"),
    # compaction's config updates (tests/compact/test_zoo_hf.py); without ``layers`` shrinking does not
    # serve them yet: give one with its tests (tests/helpers/shrink_models.py SPECS) to add them there
    "granite": replace(_LLAMA, layers=()),
    "cohere": replace(_LLAMA, layers=()),  # use_qk_norm: its per-head LayerNorms have a row per head
    "olmo2": replace(_LLAMA, layers=()),  # its q/k norms span every head: heads stay (the handler says why)
    "starcoder2": replace(_LLAMA, ffn_modules=(r"mlp\.c_fc$",), layers=()),
    "stablelm": replace(_LLAMA, head_dim_key=None, layers=()),  # the head size is hidden_size / heads
    "phi": replace(_LLAMA, ffn_modules=(r"mlp\.fc1$",), layers=()),
    "gpt_neox": HFFamily("intermediate_size", (r"mlp\.dense_h_to_4h$",), "num_attention_heads", attention=r"attention$"),
    "gptj": HFFamily("n_inner", (r"mlp\.fc_in$",), "n_head", attention=r"\.attn$", hidden_key="n_embd"),
    "falcon": HFFamily("ffn_hidden_size", (r"mlp\.dense_h_to_4h$",), "num_attention_heads",
                       attention=r"self_attention$"),
    # routed and shared experts both take moe_intermediate_size (x n_shared_experts): the dense blocks' FFN here
    "deepseek_v3": replace(_LLAMA, head_dim_key=None, layers=(), experts_key="n_routed_experts",
                           expert_ffn_key="moe_intermediate_size"),
}


def _out_features(m: nn.Module) -> Optional[int]:
    for attr in ("out_features", "nf"):
        v = getattr(m, attr, None)
        if isinstance(v, int):
            return v
    return None


def _in_features(m: nn.Module) -> Optional[int]:
    v = getattr(m, "in_features", None)
    return v if isinstance(v, int) else None


def _heads(m: nn.Module) -> Optional[Tuple[int, int, int]]:
    lay = layout_of(m)
    if lay is not None:
        return lay.heads, lay.kv_heads, lay.qk_dim
    n, d = getattr(m, "num_attention_heads", None), getattr(m, "attention_head_size", None)
    if isinstance(n, int) and isinstance(d, int):  # BERT-style self-attention
        return n, n, d
    return None


def _norm_sizes(named: List[Tuple[str, nn.Module]]) -> List[int]:
    """The widths of the model's LayerNorm/RMSNorm layers (in these families: the hidden size)."""
    out = []
    for _, m in named:
        w = getattr(m, "weight", None)
        name = type(m).__name__
        if (isinstance(m, nn.LayerNorm) or name.endswith(("LayerNorm", "RMSNorm"))) and isinstance(w, nn.Parameter) and w.dim() == 1:
            out.append(int(w.shape[0]))
    return out


#: config keys that repeat the hidden size in some families (OPT's embedding projection width)
_HIDDEN_ALIASES = ("word_embed_proj_dim",)


def _hidden_width(model: nn.Module) -> Optional[int]:
    """The residual stream's width: what the input embedding produces."""
    get = getattr(model, "get_input_embeddings", None)
    emb = get() if callable(get) else None
    if isinstance(emb, nn.Embedding):
        return int(emb.weight.shape[1])
    proj = getattr(emb, "projection", None)  # ViT-style patch embeddings
    if isinstance(proj, nn.Conv2d):
        return int(proj.weight.shape[0])
    return None


def _one(values: List[int], what: str) -> int:
    if not values:
        raise LookupError(f"no {what} found")
    if len(set(values)) != 1:
        raise LookupError(f"{what} differs between blocks ({sorted(set(values))}): not uniform")
    return values[0]


def updated_config(model: nn.Module) -> Tuple[Optional[Any], str]:
    """``(new config, "")`` for a compacted Hugging Face model, or ``(None, reason)``.

    The returned config is a copy; nothing is changed here.

    Examples:
        >>> import torch
        >>> updated_config(torch.nn.Linear(2, 2))
        (None, 'not a Hugging Face model (no config.model_type)')
    """
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if not isinstance(model_type, str) or not hasattr(config, "to_dict"):
        return None, "not a Hugging Face model (no config.model_type)"
    family = FAMILIES.get(model_type)
    if family is None:
        return None, f"config updates for model_type {model_type!r} are not known (add it to prunekit.compact.hf_config.FAMILIES)"
    named = list(model.named_modules())
    try:
        size = _in_features if family.ffn_from_input else _out_features
        ffn = None if family.ffn_key is None else _one(
            [s for n, m in named if any(re.search(p, n) for p in family.ffn_modules) for s in [size(m)] if s is not None],
            "feed-forward size")
        attention = [n for n, m in named if re.search(family.attention, n)]
        heads = [h for n, m in named if n in attention for h in [_heads(m)] if h is not None]
        if heads:
            n_heads = _one([h[0] for h in heads], "number of attention heads")
            kv_heads = _one([h[1] for h in heads], "number of key/value heads")
            head_dim = _one([h[2] for h in heads], "head size")
        else:  # an attention compaction does not know (fused, MLA): its heads never change
            n_heads = getattr(config, family.heads_key)
            kv_heads = getattr(config, family.kv_heads_key, n_heads) if family.kv_heads_key else n_heads
            head_dim = None
    except LookupError as exc:
        return None, str(exc)
    hidden = getattr(config, family.hidden_key, None)
    new_hidden = _hidden_width(model)
    if head_dim is None:
        head_dim = (new_hidden or 0) // max(n_heads, 1)
    # the residual stream's norms: not those inside attention (q/k norms of a head's or every head's size)
    outside = [(n, m) for n, m in named if not any(n.startswith(a + ".") for a in attention)]
    widths = sorted(set(_norm_sizes(outside)) - {head_dim})
    if new_hidden is None or widths not in ([], [new_hidden]):
        return None, (f"the hidden size is not one width ({family.hidden_key} {hidden}, input embedding "
                      f"{new_hidden}, normalizations {widths}); save with prunekit.compact.save_compacted")
    new = copy.deepcopy(config)
    changes: Dict[str, int] = {} if family.ffn_key is None or ffn is None else {family.ffn_key: ffn}
    if new_hidden != hidden:
        changes[family.hidden_key] = new_hidden
        if family.head_dim_key is not None:  # a config without it derives the head size from the hidden size
            changes[family.head_dim_key] = head_dim
        changes.update({k: new_hidden for k in _HIDDEN_ALIASES if getattr(config, k, None) == hidden})
    old_heads = getattr(config, family.heads_key)
    if n_heads != old_heads or (family.kv_heads_key and kv_heads != getattr(config, family.kv_heads_key, kv_heads)):
        if family.head_dim_key is None and n_heads * head_dim != new_hidden:
            return None, (f"{model_type}'s config derives the head size from {family.hidden_key} / {family.heads_key}, "
                          f"so it cannot say {n_heads} heads of {head_dim} with {family.hidden_key} {new_hidden}; "
                          "save with prunekit.compact.save_compacted")
        changes[family.heads_key] = n_heads
        if family.head_dim_key is not None:
            changes[family.head_dim_key] = head_dim
        if family.kv_heads_key:
            changes[family.kv_heads_key] = kv_heads
    elif family.head_dim_key is None and n_heads * head_dim != new_hidden:
        return None, (f"{model_type}'s config derives the head size from {family.hidden_key} / {family.heads_key}: "
                      f"{family.hidden_key} {new_hidden} with {n_heads} heads would be heads of "
                      f"{new_hidden / n_heads:g}, not {head_dim}; prune the heads with the hidden size (heads x head "
                      f"size = hidden size) or save with prunekit.compact.save_compacted")
    for key, value in changes.items():
        setattr(new, key, value)
    mismatch = config_mismatch(model, new)
    if mismatch:
        return None, mismatch
    logger.info("compact: %s config updated: %s", model_type, changes)
    return new, ""


def config_mismatch(model: nn.Module, config: Any) -> str:
    """Why ``type(model)(config)`` would not give ``model``'s tensors their shapes (``""`` when it would).

    The model is built on the meta device (no memory, no initialisation work): a config key the
    family's code does not read, or one it derives from others, shows up as a shape this model does
    not have, so ``from_pretrained`` would fail or load a different model.

    Examples:
        >>> import torch
        >>> config_mismatch(torch.nn.Linear(2, 3), None)  # not a config its class is built from: no answer
        ''
    """
    try:
        with torch.device("meta"):
            fresh = type(model)(config)
    except Exception as exc:  # a class not built from its config alone: nothing to compare with
        logger.info("compact: cannot build %s from its updated config to check it (%s)", type(model).__name__, exc)
        return ""
    for name, t in itertools.chain(fresh.named_parameters(), fresh.named_buffers()):
        owner, leaf = reparam.owner_of(fresh, name)
        if leaf in getattr(owner, "_non_persistent_buffers_set", ()):
            continue
        try:
            mine = reparam.stored(*reparam.owner_of(model, name))
        except AttributeError:
            mine = None
        if mine is None:
            continue  # a part this model was built without (ViTModel(config, add_pooling_layer=False))
        if tuple(mine.shape) != tuple(t.shape):
            return (f"the config cannot express this model's sizes: a {type(model).__name__} built from it has "
                    f"{name} {list(t.shape)}, this model {list(mine.shape)}; save with prunekit.compact.save_compacted")
    return ""


def scaled_embeddings(model: nn.Module) -> List[Any]:
    """Embeddings that scale their output by ``sqrt(hidden size)`` (Gemma's), which a new hidden size changes:
    ``nn.Embedding`` subclasses with a ``scalar_embed_scale`` number and an ``embed_scale`` buffer.

    Examples:
        >>> import torch
        >>> scaled_embeddings(torch.nn.Embedding(4, 2))
        []
    """
    return [m for m in model.modules() if isinstance(m, nn.Embedding) and hasattr(m, "scalar_embed_scale")
            and isinstance(getattr(m, "embed_scale", None), Tensor)]


def rescale_embeddings(model: nn.Module, old: int, new: int, txn: Optional[Transaction] = None) -> None:
    """Give scaled embeddings the scale a model of hidden size ``new`` is built with (``sqrt(new)``).

    ``from_pretrained`` builds the scale from the config's hidden size, so a compacted model must
    compute with that scale too. Each module is recorded in ``txn`` before it changes.

    Examples:
        >>> import torch
        >>> emb = torch.nn.Embedding(4, 2)
        >>> emb.scalar_embed_scale = 4.0; emb.register_buffer("embed_scale", torch.tensor(4.0), persistent=False)
        >>> rescale_embeddings(emb, 16, 9)
        >>> emb.scalar_embed_scale, float(emb.embed_scale)
        (3.0, 3.0)
    """
    for module in scaled_embeddings(model):
        if not math.isclose(float(module.scalar_embed_scale), math.sqrt(old), rel_tol=1e-6):
            raise ValueError(f"prunekit.compact: {type(module).__name__} scales by {module.scalar_embed_scale}, not by "
                             f"sqrt(hidden size {old}); its scale cannot follow the new hidden size {new}")
        if txn is not None:
            txn.module(module)
        module.scalar_embed_scale = math.sqrt(new)
        module._buffers["embed_scale"] = torch.tensor(math.sqrt(new), dtype=module.embed_scale.dtype,
                                                      device=module.embed_scale.device)


def apply_config(model: nn.Module, txn: Optional[Transaction] = None) -> str:
    """Give a Hugging Face model whose layers changed size a config of its new shapes, in place.

    Every module holding the model's config gets the updated copy, and scaled embeddings follow a
    new hidden size (:func:`rescale_embeddings`); each change is recorded in ``txn``. Returns ``""``,
    or the reason the config cannot say the new shapes (then nothing is changed).

    Examples:
        >>> import torch
        >>> apply_config(torch.nn.Linear(2, 2))
        'not a Hugging Face model (no config.model_type)'
    """
    new, reason = updated_config(model)
    if new is None:
        return reason
    old: Any = model.config  # a transformers config (updated_config read its model_type)
    key = FAMILIES[old.model_type].hidden_key
    if getattr(new, key) != getattr(old, key):
        rescale_embeddings(model, getattr(old, key), getattr(new, key), txn)
    for m in model.modules():
        if getattr(m, "config", None) is old:
            if txn is not None:
                txn.module(m)
            m.config = new
    return ""
