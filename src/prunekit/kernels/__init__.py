"""Pure tensor math: tensors in, masks out. Nothing here knows about modules."""

from .amount import (
    compute_nparams_to_prune,
    validate_pruning_amount,
    validate_pruning_amount_init,
)
from .norms import channel_norms
from .select import keep_mask_smallest, keep_mask_smallest_multi, select_lowest

__all__ = [
    "channel_norms",
    "compute_nparams_to_prune",
    "keep_mask_smallest",
    "keep_mask_smallest_multi",
    "select_lowest",
    "validate_pruning_amount",
    "validate_pruning_amount_init",
]
