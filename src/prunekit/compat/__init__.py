"""Thin shims for other libraries' names and files, on top of prunekit's own machinery.

* :mod:`prunekit.compat.tensorplay_ao` -- TensorPlay's documented
  ``tensorplay.ao.pruning``, served under that name by the finder in
  ``_prunekit_tensorplay_ao`` (README, "TensorPlay").
"""
