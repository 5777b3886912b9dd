"""The internal tier of :mod:`prunekit.reparam`: what other packages of prunekit use and users do not.

These names are not part of the public API (``prunekit.reparam.__all__``):
they change with the layers above (the pruning methods' ``apply``, rollback,
fusion, loading) and may change without notice. Inside prunekit, import them
from here, never from ``prunekit.reparam`` itself.

============================  ====================================================
``Snapshot(module)``          a module's structure, restored with the caches
``atomic``                    decorator: roll the module back if the call fails
``after_restore``             what a rollback re-derives (caches, shards, RNNs)
``install(m, name, k, h, i)`` store mask ``k`` and hook ``h`` (apply's last step)
``check_prunable(m, name)``   validate a pruning target, return its stored tensor
``orig_and_mask(m, name)``    ``(name_orig, name_mask)`` of a masked tensor
``with_context(err, m, n)``   an error with the module and tensor named in front
``effective_with_grad(o, k)`` the effective value as autograd computes it
``drop_cache(m[, name])``     forget cached effective values
============================  ====================================================
"""

from __future__ import annotations

from .hooks import check_prunable
from .lifecycle import Snapshot, after_restore, atomic, install
from .queries import orig_and_mask, with_context
from .value import drop_cache, effective_with_grad

__all__ = ["Snapshot", "after_restore", "atomic", "check_prunable", "drop_cache", "effective_with_grad", "install",
           "orig_and_mask", "with_context"]
