"""One-shot pruning of pretrained models from calibration data, block by block.

* :func:`oneshot` -- the verb (``prunekit.oneshot``); :func:`oneshot_folder` -- the same from a
  Hugging Face folder to a new one, one block in memory (:mod:`.folder`);
* :mod:`.solvers` -- magnitude, Wanda, SparseGPT and the masked least-squares refit on one matrix;
* :mod:`.blocks` -- finding repeated blocks, capturing a block's inputs, running a block,
  offloading (reusable by anything that walks a model block by block);
* :mod:`.layers` -- which layers are pruned and their ``(out, in)`` view;
* :mod:`.report` -- :class:`OneshotReport`;
* :mod:`.walk` -- the block walk (statistics, solving, writing), :mod:`.parallel` -- the work
  shared by the ranks of a process group, :mod:`.undo` -- the originals kept on disk for the rollback.

The package itself is callable: ``prunekit.oneshot(model, calibration, ...)``
is :func:`oneshot` whether ``prunekit.oneshot`` was reached as the package or
as the function (Python binds the subpackage to that attribute once it is
imported).

Examples:
    >>> import prunekit, prunekit.oneshot
    >>> callable(prunekit.oneshot), prunekit.oneshot.__call__.__doc__ == prunekit.oneshot.oneshot.__doc__
    (True, True)
"""

from .._callable import make_callable
from .api import MASKS, METHODS, PRUNEKIT_DEFAULTS, oneshot, parse_pattern
from .folder import oneshot_folder
from .blocks import BlockInput, capture_block_inputs, find_blocks, on_device, run_block
from .layers import Target, find_targets
from .report import LayerResult, OneshotReport
from .solvers import magnitude_prune, refit_masked, sparsegpt_prune, wanda_prune

__all__ = [
    "MASKS",
    "METHODS",
    "PRUNEKIT_DEFAULTS",
    "BlockInput",
    "LayerResult",
    "OneshotReport",
    "Target",
    "capture_block_inputs",
    "find_blocks",
    "find_targets",
    "magnitude_prune",
    "on_device",
    "oneshot",
    "oneshot_folder",
    "parse_pattern",
    "refit_masked",
    "run_block",
    "sparsegpt_prune",
    "wanda_prune",
]


make_callable(__name__, oneshot)
