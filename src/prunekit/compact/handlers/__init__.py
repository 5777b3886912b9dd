"""One handler per layer type, behind a registry users can extend.

:mod:`.base` holds the interface (:class:`Slot`, :class:`Entry`, :class:`ModuleHandler`,
:class:`TracerAPI`, :func:`register_handler`); the other modules register the built-in
handlers when this package is imported: :mod:`.torch_nn` (Linear, Conv, norms,
Embedding), :mod:`.attention` (``nn.MultiheadAttention``, BERT-style self-attention),
:mod:`.projection_attention` (Llama/Mistral/Qwen2 GQA, Phi-3, OPT, ViT, DistilBERT, T5,
GPT-2, cross-attention), :mod:`.hf_layers` (GPT-2's ``Conv1D``, RMS norms) and :mod:`.moe`
(mixture-of-experts routers and experts modules).
"""

from .attention import BertSelfAttentionHandler, MultiheadAttentionHandler
from .hf_layers import Conv1DHandler, RMSNormHandler
from .moe import ExpertsHandler, RouterHandler
from .projection_attention import Layout, ProjectionAttentionHandler, layout_of
from .base import REGISTRY, Entry, HandlerRegistry, ModuleHandler, Slot, TracerAPI, register_handler
from .torch_nn import (
    BatchNormHandler,
    ConvHandler,
    EmbeddingHandler,
    GroupNormHandler,
    LayerNormHandler,
    LinearHandler,
)

__all__ = [
    "BatchNormHandler",
    "BertSelfAttentionHandler",
    "Conv1DHandler",
    "ConvHandler",
    "EmbeddingHandler",
    "Entry",
    "ExpertsHandler",
    "GroupNormHandler",
    "HandlerRegistry",
    "LayerNormHandler",
    "Layout",
    "LinearHandler",
    "ModuleHandler",
    "MultiheadAttentionHandler",
    "ProjectionAttentionHandler",
    "REGISTRY",
    "RMSNormHandler",
    "RouterHandler",
    "Slot",
    "TracerAPI",
    "layout_of",
    "register_handler",
]
