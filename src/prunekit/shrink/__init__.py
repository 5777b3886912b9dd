"""Shrink: a pretrained Hugging Face model made into a smaller dense one from calibration data.

Width (hidden size, heads, key/value groups, FFN neurons, experts) and depth (whole
layers) are removed by importance measured on calibration batches; the result is a
plain Hugging Face model whose config describes its new shapes.

* :func:`shrink` -- the verb (``prunekit.shrink``): search the mix of sizes for a target, apply it;
* :mod:`.width`, :mod:`.depth`, :mod:`.experts` -- the axes: importance, emulation, removal;
* :mod:`.search`, :mod:`.sizes` -- candidate sizes and their parameter/MAC counts;
* :func:`distill` -- recovery by knowledge distillation from the dense model (:mod:`.distillation`);
* :mod:`.calibration` -- batches and the objective candidates are scored by;
* :mod:`.families` -- where each family keeps its blocks and config keys (one table with compaction's).

The package itself is callable: ``prunekit.shrink(model, calibration, target=0.5)`` is :func:`shrink`.
"""

from .._callable import make_callable
from .api import ShrinkReport, shrink
from .depth import block_influence, layer_loss_importance, remove_layers, skipped_layers
from .distillation import DistillReport, distill
from .experts import (ExpertImportance, dropped_experts, expert_ffn_importance, expert_importance, keep_top,
                      moe_layers, remove_experts, shrink_expert_ffn)
from .families import FAMILIES, family_of, layer_list

__all__ = ["FAMILIES", "DistillReport", "ExpertImportance", "ShrinkReport", "block_influence",
           "distill", "dropped_experts", "expert_ffn_importance", "expert_importance", "family_of", "keep_top",
           "layer_list", "layer_loss_importance", "moe_layers", "remove_experts", "remove_layers", "shrink",
           "shrink_expert_ffn", "skipped_layers"]

make_callable(__name__, shrink)
