"""Intel Neural Compressor's pruning configs and entry points, served by prunekit's pruners.

Scripts written for Neural Compressor's PyTorch pruner run with one changed import::

    # from neural_compressor.experimental.pytorch_pruner.pruning import Pruning     (1.x)
    # from neural_compressor.config import WeightPruningConfig                       (2.x)
    # from neural_compressor.compression.pruner import prepare_pruning               (2.x)
    # from neural_compressor.training import prepare_compression                     (2.x)
    from prunekit.compat.neural_compressor import (Pruning, WeightPruningConfig, prepare_pruning,
                                                   prepare_compression)

Two config layouts are read, from a YAML file or a dict:

* **1.x** -- ``pruning: approach: weight_compression_pytorch: {...}`` with a list
  of ``!Pruner`` entries (plain dicts work too). Block keys are defaults for
  every entry; absent keys take Neural Compressor 1.x's defaults (``prune_type``
  ``snip_momentum``, pattern ``tile_pattern_4x1``, ``prune_domain`` ``global``,
  ``max_sparsity_ratio_per_layer`` 0.98, layer types ``Conv2d`` and ``Linear``,
  ``exp`` decay, ``target_sparsity`` 0.0, steps 0..0).
* **2.x** -- ``WeightPruningConfig(pruning_configs=[{...}, ...], **globals)``, or the
  YAML section ``pruning: approach: weight_compression_v2: {...}`` with
  ``!PrunerV2`` entries. Entries override the globals; absent keys take 2.x's
  defaults (``pruning_type`` ``snip_momentum``, pattern ``4x1``,
  ``target_sparsity`` 0.9, ``pruning_op_types`` ``["Conv", "Linear"]``, ...).
  As in Neural Compressor 2.x, the model's final classifier (its last module,
  when that is a ``Linear`` or ``Conv2d``) is left unpruned.

Names are translated (see :data:`V1_KEYS` and :data:`V2_KEYS`): patterns lose
their ``tile_pattern_`` prefix, and Neural Compressor's ``"N:M"`` -- *N pruned*
in every M -- becomes prunekit's ``"(M-N):M"`` (*M-N kept*); ``*_progressive``
pruning types run as their base criterion. Keys that Neural Compressor accepted
but its PyTorch pruner never used (``initial_sparsity``, ``start_epoch``,
``update_frequency``, ...) load with a warning naming them; a key neither
layout knows, or a wrong value, is an error naming the key as you wrote it.

The package's modules: :mod:`.keys` (both layouts' keys and defaults),
:mod:`.translate` (one entry into a prunekit pruner config), :mod:`.config`
(the configs as written, and reading them) and :mod:`.entry_points`.

Example (the 2.x flow):
    >>> import torch, torch.nn as nn
    >>> from prunekit.compat.neural_compressor import WeightPruningConfig, prepare_pruning
    >>> _ = torch.manual_seed(0)
    >>> model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.01)
    >>> config = WeightPruningConfig(pruning_configs=[{"pattern": "1x1"}],
    ...                              pruning_type="magnitude", target_sparsity=0.5, end_step=2)
    >>> pruning = prepare_pruning(model, config, opt)
    >>> for _ in range(3):
    ...     opt.zero_grad(); model(torch.randn(8, 16)).sum().backward(); opt.step()
    >>> int((model[0].weight == 0).sum() + (model[2].weight == 0).sum()), (512 + 1024) // 2
    (768, 768)
    >>> int((model[4].weight == 0).sum())  # the final classifier is left alone, as in Neural Compressor 2.x
    0
"""

from __future__ import annotations

from .config import NCConfig, WeightPruningConfig, load_config
from .entry_points import CompressionManager, Pruning, prepare_compression, prepare_pruning
from .keys import V1_KEYS, V2_KEYS
from .keys import V1_UNUSED as V1_UNUSED, V2_OTHER as V2_OTHER

__all__ = [
    "Pruning",
    "WeightPruningConfig",
    "CompressionManager",
    "prepare_pruning",
    "prepare_compression",
    "load_config",
    "NCConfig",
    "V1_KEYS",
    "V2_KEYS",
]
