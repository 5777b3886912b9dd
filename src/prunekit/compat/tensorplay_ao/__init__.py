"""``tensorplay.ao``, provided by prunekit: only its ``pruning`` submodule exists.

TensorPlay 1.0.0 documents ``tensorplay.ao.pruning`` but ships no
``tensorplay.ao``. When prunekit is installed beside it, ``import
tensorplay.ao.pruning`` is served from this folder by the finder in
``_prunekit_tensorplay_ao`` (installed with prunekit; see its docstring for the
mechanism, and ``PRUNEKIT_TENSORPLAY_AO=0`` to switch it off). A TensorPlay
release that ships its own ``tensorplay.ao`` is always imported instead.

Documentation: prunekit's README, section "TensorPlay".
"""

__all__ = ["pruning"]
