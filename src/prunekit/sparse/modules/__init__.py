"""Inference modules that multiply through a sparse weight.

* :class:`CSRLinear` — ``nn.Linear`` with its weight in CSR form.
* :class:`CSRConv2d` — ``nn.Conv2d`` (``groups=1``, zero padding) as an
  unfold followed by a CSR matrix product.
* :class:`BSRLinear` — ``nn.Linear`` with its weight in 4x1 or 1x4 blocks
  (the training pruners' block patterns), through prunekit's compiled kernel.
* :class:`ChannelLinear` — a ``Linear`` whose all-zero rows and columns are
  dropped: a smaller dense product plus a scatter (channel sparsity that
  compaction cannot remove, e.g. because a residual reads the channel).
* :class:`SemiStructuredLinear` — ``nn.Linear`` with a 2:4 semi-structured
  weight (``torch.sparse.to_sparse_semi_structured``; CUDA only).

The CSR and BSR modules run one *execution policy*: ``kernel`` is
``"prunekit"`` (the compiled kernels of :mod:`prunekit.sparse.native`) or
``"torch"`` (``torch.sparse``: MKL on CPU, cuSPARSE on CUDA), and
``threads`` is ``0`` (torch's current thread count) or ``1``. Each module's
:attr:`policy` names it the way :class:`prunekit.sparse.SparsifyReport` does
(``"csr"``, ``"csr-1t"``, ``"csr-torch"``, ``"bsr4x1"``, ``"channels"``, ...).
:func:`prunekit.sparse.sparsify_for_inference` measures the policies and
keeps the fastest per layer. A module whose compiled kernel is unavailable in
the running process (unpickled on a machine where it was not built, say)
computes the same result through torch's kernels.

The modules keep their arrays as ordinary buffers, so ``state_dict``,
``copy.deepcopy``, pickling and ``.to()`` work as for any module (a CSR tensor
as a buffer breaks ``deepcopy``). Each module can rebuild a dense twin
(:meth:`to_dense_module`) and, when it was made with ``keep_original=True``,
hands back the very module it replaced (:attr:`original`).

These modules are for inference: the weights are buffers, not parameters.
Stored zeros are skipped, so where the dense layer computes ``0 * inf = nan``
the sparse one does not.

One module per layout: :mod:`.base` (the base class, policy names),
:mod:`.csr`, :mod:`.bsr`, :mod:`.channels` and :mod:`.semi_structured`
(with :func:`prunekit.sparse.check_n_m_pattern`, the check the 2:4 kernels
need first); the modules and their helpers are importable from here.
"""

from .base import SparseInferenceModule
from .base import policy_name as policy_name
from .bsr import BSRLinear
from .bsr import block_fill as block_fill, bsr_unsupported_reason as bsr_unsupported_reason
from .channels import ChannelLinear
from .csr import CSRConv2d, CSRLinear
from .csr import conv2d_unsupported_reason as conv2d_unsupported_reason
from .semi_structured import SemiStructuredLinear

__all__ = ["CSRLinear", "CSRConv2d", "BSRLinear", "ChannelLinear", "SemiStructuredLinear", "SparseInferenceModule"]
