"""The payoff of unstructured sparsity: compressed checkpoints and sparse-kernel inference.

* :func:`save_compressed` / :func:`load_compressed` — safetensors files that
  store sparse tensors as a packed bitmask plus their non-zero values
  (needs ``safetensors``: ``pip install prunekit[io]``); they live in
  :mod:`prunekit.io` and are re-exported here.
* :func:`sparsify_for_inference` / :func:`restore_dense` — swap pruned
  ``Linear``/``Conv2d`` layers for CSR (CPU) or 2:4 semi-structured (CUDA)
  modules where a short measurement says it is faster; the
  :class:`SparsifyReport` says what was converted and why.
"""

from .checkpoint import CorruptCheckpointError, load_compressed, save_compressed
from .inference import (
    LayerDecision,
    SparsifyReport,
    check_n_m_pattern,
    clear_decision_cache,
    restore_dense,
    sparsify_for_inference,
)
from .modules import CSRConv2d, CSRLinear, SemiStructuredLinear, SparseInferenceModule

__all__ = [
    "save_compressed",
    "load_compressed",
    "CorruptCheckpointError",
    "sparsify_for_inference",
    "restore_dense",
    "SparsifyReport",
    "LayerDecision",
    "check_n_m_pattern",
    "clear_decision_cache",
    "CSRLinear",
    "CSRConv2d",
    "SemiStructuredLinear",
    "SparseInferenceModule",
]
