"""Shrink: a pretrained Hugging Face model made into a smaller dense one from calibration data.

Width (hidden size, heads, key/value groups, FFN neurons, experts) and depth (whole
layers) are removed by importance measured on calibration batches; the result is a
plain Hugging Face model whose config describes its new shapes.
"""

from .depth import block_influence, layer_loss_importance, remove_layers, skipped_layers
from .experts import (ExpertImportance, dropped_experts, expert_ffn_importance, expert_importance, keep_top,
                      moe_layers, remove_experts, shrink_expert_ffn)
from .families import FAMILIES, ShrinkFamily, family_of, layer_list

__all__ = ["FAMILIES", "ExpertImportance", "ShrinkFamily", "block_influence", "dropped_experts",
           "expert_ffn_importance", "expert_importance", "family_of", "keep_top", "layer_list",
           "layer_loss_importance", "moe_layers", "remove_experts", "remove_layers", "shrink_expert_ffn",
           "skipped_layers"]
