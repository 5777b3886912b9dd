"""One handler per layer type, behind a registry users can extend.

:mod:`.base` holds the interface (:class:`Slot`, :class:`Entry`, :class:`ModuleHandler`,
:class:`TracerAPI`, :func:`register_handler`); the other modules register the built-in
handlers when this package is imported: :mod:`.torch_nn` (Linear, Conv, norms,
Embedding) and :mod:`.attention` (``nn.MultiheadAttention``, Hugging Face attention).
"""

from .attention import BertSelfAttentionHandler, MultiheadAttentionHandler
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
    "ConvHandler",
    "EmbeddingHandler",
    "Entry",
    "GroupNormHandler",
    "HandlerRegistry",
    "LayerNormHandler",
    "LinearHandler",
    "ModuleHandler",
    "MultiheadAttentionHandler",
    "REGISTRY",
    "Slot",
    "TracerAPI",
    "register_handler",
]
