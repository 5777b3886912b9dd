"""prunekit: neural-network pruning for PyTorch.

``import prunekit as prune`` replaces ``import torch.nn.utils.prune as prune``:
same names, signatures and semantics, with the faults of the original fixed
(see the README). Training-aware pruners, compaction and sparse inference
live in submodules and are re-exported here lazily.
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

from .base import BasePruningMethod, PruningContainer
from ._backend import FrameworkMismatchError
from .errors import PruningError
from .global_ import global_unstructured
from .kernels.amount import (
    compute_nparams_to_prune,
    validate_pruning_amount,
    validate_pruning_amount_init,
)
from .methods import (
    CustomFromMask,
    Identity,
    L1Unstructured,
    LnStructured,
    RandomStructured,
    RandomUnstructured,
    custom_from_mask,
    identity,
    l1_unstructured,
    ln_structured,
    random_structured,
    random_unstructured,
    remove,
)
from .reparam import base_class, is_pruned, iter_pruned
from .permanent import remove_all
from .state_dict import StateDictMismatchError, dense_state_dict, load_state_dict
from . import distributed  # noqa: F401 -- registers the DTensor handler (torch.distributed.tensor loads on first use)
from .pretrained import load_pretrained, restore_masks, save_pretrained  # also: pruned HF models save plain weights

# torch's private spellings, so code written against torch ports by changing one import
_validate_pruning_amount_init = validate_pruning_amount_init
_validate_pruning_amount = validate_pruning_amount
_compute_nparams_toprune = compute_nparams_to_prune

logging.getLogger(__name__).addHandler(logging.NullHandler())

__version__ = "0.1.0"

# name -> submodule, imported on first use: `import prunekit` needs torch only, and the
# optional extras (safetensors, yaml, ...) are imported when their features are used.
_LAZY = {
    # training-aware pruning (prunekit.training)
    "register_pruners": ".training",
    "get_pruner": ".training",
    "Pruner": ".training",
    "MagnitudePruner": ".training",
    "SnipPruner": ".training",
    "SnipMomentumPruner": ".training",
    "PatternLockPruner": ".training",
    "PruningConfig": ".training",
    "PrunerConfig": ".training",
    "PruningCallbacks": ".training",
    "GradientPruner": ".training",
    "prepare_pruning": ".training",
    "sparsity_report": ".training",
    # compaction (prunekit.compact)
    "prune_groups": ".compact",
    # one-shot pruning from calibration data (prunekit.oneshot; the package is callable)
    "OneshotReport": ".oneshot",
    # recovery of a shrunk model by distillation from the dense one (prunekit.shrink)
    "distill": ".shrink",
    # files: compressed checkpoints, every format prunekit reads and writes (prunekit.io)
    "save_compressed": ".io",
    "load_compressed": ".io",
    "CorruptCheckpointError": ".io",
    "CheckpointSignatureError": ".io",
    # fusing pruned layers (torch.ao.quantization.fuse_modules; prunekit.fusion)
    "fuse_modules": ".fusion",
    "fuse_modules_qat": ".fusion",
    "fuse_known_modules": ".fusion",
    # sparse inference (prunekit.sparse)
    "sparsify_for_inference": ".sparse",
    "restore_dense": ".sparse",
    "SparsifyReport": ".sparse",
    # reports and plots (prunekit.report)
    "model_report": ".report",
    "ModelReport": ".report",
    "LayerReport": ".report",
    "read_checkpoint": ".io",
    "UnsafeCheckpointError": ".io",
    "plot_layer_sparsity": ".report",
    "plot_accuracy_vs_sparsity": ".report",
}
_SUBMODULES = {"compact", "training", "sparse", "kernels", "reparam", "report", "demo", "cli", "importance", "io",
               "oneshot", "fusion", "shrink"}


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module("." + name, __name__)
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'prunekit' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list:
    return sorted(set(globals()) | set(_LAZY) | _SUBMODULES)


__all__ = [
    "BasePruningMethod",
    "CustomFromMask",
    "Identity",
    "L1Unstructured",
    "LnStructured",
    "PruningContainer",
    "PruningError",
    "FrameworkMismatchError",
    "RandomStructured",
    "RandomUnstructured",
    "StateDictMismatchError",
    "base_class",
    "compute_nparams_to_prune",
    "custom_from_mask",
    "dense_state_dict",
    "global_unstructured",
    "identity",
    "is_pruned",
    "iter_pruned",
    "l1_unstructured",
    "ln_structured",
    "load_pretrained",
    "load_state_dict",
    "oneshot",
    "random_structured",
    "random_unstructured",
    "remove",
    "remove_all",
    "restore_masks",
    "save_pretrained",
    "shrink",
    "validate_pruning_amount",
    "validate_pruning_amount_init",
] + sorted(_LAZY)
