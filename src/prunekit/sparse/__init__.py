"""The payoff of unstructured sparsity: compressed checkpoints and sparse-kernel inference.

* :func:`save_compressed` / :func:`load_compressed` — safetensors files that
  store sparse tensors as a packed bitmask plus their non-zero values
  (needs ``safetensors``: ``pip install prunekit[io]``); they live in
  :mod:`prunekit.io` and are re-exported here.
* :func:`sparsify_for_inference` / :func:`restore_dense` — run pruned
  ``Linear``/``Conv2d`` layers on the fastest measured execution policy
  (:mod:`prunekit.sparse.policies`: prunekit's compiled CSR and 4x1/1x4 block
  kernels, torch's CSR, a smaller dense product for whole zero channels, 2:4
  on CUDA) where it beats dense; the :class:`SparsifyReport` says what was
  converted, why, and what every policy measured.
* :mod:`prunekit.sparse.native` — the compiled kernels: ``make kernels``
  builds them; without them torch's kernels are used.
"""

from ..io import CorruptCheckpointError, load_compressed, save_compressed
from .inference import (
    LayerDecision,
    SparsifyReport,
    check_n_m_pattern,
    clear_decision_cache,
    restore_dense,
    sparsify_for_inference,
)
from .modules import BSRLinear, ChannelLinear, CSRConv2d, CSRLinear, SemiStructuredLinear, SparseInferenceModule

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
    "BSRLinear",
    "ChannelLinear",
    "SemiStructuredLinear",
    "SparseInferenceModule",
]
