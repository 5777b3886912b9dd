"""Pure tensor math: tensors in, masks out. Nothing here knows about modules.

Amounts and counts (``amount``), exact k-smallest selection (``select``),
channel norms (``norms``) and the sparsity patterns -- blocks, channels,
N:M -- with their weight layout (``patterns``).
"""

from .amount import (
    compute_nparams_to_prune,
    validate_pruning_amount,
    validate_pruning_amount_init,
)
from .norms import channel_norms
from .patterns import ChannelPattern, NInMPattern, NxMPattern, Pattern, get_pattern
from .select import keep_mask_smallest, keep_mask_smallest_multi, select_lowest

__all__ = [
    "ChannelPattern",
    "NInMPattern",
    "NxMPattern",
    "Pattern",
    "channel_norms",
    "get_pattern",
    "compute_nparams_to_prune",
    "keep_mask_smallest",
    "keep_mask_smallest_multi",
    "select_lowest",
    "validate_pruning_amount",
    "validate_pruning_amount_init",
]
