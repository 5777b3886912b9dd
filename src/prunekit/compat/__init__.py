"""Thin shims for other libraries' names and files, on top of prunekit's own machinery.

* :mod:`prunekit.compat.tensorplay_ao` -- TensorPlay's documented
  ``tensorplay.ao.pruning``, served under that name by the finder in
  ``_prunekit_tensorplay_ao`` (README, "TensorPlay").
* :mod:`prunekit.compat.neural_compressor` -- Intel Neural Compressor's pruning
  configs (1.x YAML with ``!Pruner`` entries, 2.x ``WeightPruningConfig``) and
  entry points (``Pruning``, ``prepare_pruning``, ``prepare_compression``)
  (README, "Coming from Intel Neural Compressor").
* :mod:`prunekit.compat.peft` -- PEFT LoRA adapters on pruned layers whose
  update is masked like the base, so the unmerged model computes what the
  merged one does (README, "Pruned models go wherever dense models go").

Nothing here prunes by itself: configs are translated to prunekit's own and the
pruners of :mod:`prunekit.training` do the work.
"""
