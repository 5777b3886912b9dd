"""The keys of Neural Compressor's two config layouts, with the defaults Neural Compressor gave them."""

from __future__ import annotations

from typing import Any, Dict

__all__ = ["V1_KEYS", "V1_UNUSED", "V2_KEYS", "V2_OTHER"]

_NO_DEFAULT = object()

#: 1.x keys (``weight_compression_pytorch`` block and ``!Pruner`` entries): key -> its default.
#: Keys with a prunekit meaning keep their name in prunekit.
V1_KEYS: Dict[str, Any] = {
    "prune_type": "snip_momentum",
    "pattern": "tile_pattern_4x1",
    "target_sparsity": 0.0,
    "prune_domain": "global",
    "start_step": 0,
    "end_step": 0,
    "update_frequency_on_step": 1,
    "sparsity_decay_type": "exp",
    "max_sparsity_ratio_per_layer": 0.98,
    "names": [],
    "excluded_names": [],
    "extra_excluded_names": [],
    "prune_layer_type": ["Conv2d", "Linear"],
}
#: 1.x keys that Neural Compressor's PyTorch pruner accepted and never read (a warning when set)
V1_UNUSED: Dict[str, Any] = {
    "initial_sparsity": 0.0,
    "start_epoch": _NO_DEFAULT,
    "end_epoch": _NO_DEFAULT,
    "update_frequency": _NO_DEFAULT,
    "method": _NO_DEFAULT,
    "parameters": _NO_DEFAULT,
}

#: 2.x keys (``WeightPruningConfig`` arguments, ``pruning_configs`` entries, ``weight_compression_v2``):
#: key -> its default. Their prunekit names are :data:`prunekit.training.ALIASES`.
V2_KEYS: Dict[str, Any] = {
    "target_sparsity": 0.9,
    "pruning_type": "snip_momentum",
    "pattern": "4x1",
    "op_names": [],
    "excluded_op_names": [],
    "start_step": 0,
    "end_step": 0,
    "pruning_scope": "global",
    "pruning_frequency": 1,
    "min_sparsity_ratio_per_op": 0.0,
    "max_sparsity_ratio_per_op": 0.98,
    "sparsity_decay_type": "exp",
    "pruning_op_types": ["Conv", "Linear"],
}
#: 2.x keys without a prunekit counterpart: checked, and a warning when they would change something
V2_OTHER: Dict[str, Any] = {
    "low_memory_usage": False,
    "criterion_type": None,
    "criterion_reduce_type": "mean",
    "resume_from_pruned_checkpoint": False,
    "reg_type": None,
    "reg_coeff": 0.0,
    "backend": None,
    "parameters": None,
}

_LAYOUTS = ("1.x", "2.x")
_PRUNEKIT_TYPES = ("magnitude", "snip", "snip_momentum", "gradient", "pattern_lock")
_ONE_SHOT_TYPES = ("retrain_free", "sparse_gpt", "sparsegpt")
