"""Training-aware pruning: pruners, patterns, schedules, criteria and their wiring.

Quick start::

    from prunekit.training import prepare_pruning
    pruning = prepare_pruning(model, {"prune_type": "magnitude", "pattern": "1x1",
                                      "target_sparsity": 0.9, "end_step": 500}, optimizer)
    # ... train as usual; pruning.report() tells the sparsity reached.
"""

from .config import ALIASES, PrunerConfig, PruningConfig, load_config
from .criteria import CRITERIA, get_criterion
from ..kernels.patterns import ChannelPattern, NInMPattern, NxMPattern, Pattern, get_pattern
from .pruners import (
    GradientPruner,
    MagnitudePruner,
    PatternLockPruner,
    Pruner,
    SnipMomentumPruner,
    SnipPruner,
    get_pruner,
)
from .registry import PRUNERS, register_pruners
from .report import LayerSparsity, SparsityReport, sparsity_report
from .schedules import IterativeScheduler, OneshotScheduler, Scheduler, get_scheduler
from .selection import select_modules
from .wiring import PruningCallbacks, prepare_pruning

__all__ = [
    "ALIASES",
    "CRITERIA",
    "ChannelPattern",
    "GradientPruner",
    "IterativeScheduler",
    "LayerSparsity",
    "MagnitudePruner",
    "NInMPattern",
    "NxMPattern",
    "OneshotScheduler",
    "PRUNERS",
    "Pattern",
    "PatternLockPruner",
    "Pruner",
    "PrunerConfig",
    "PruningCallbacks",
    "PruningConfig",
    "Scheduler",
    "SnipMomentumPruner",
    "SnipPruner",
    "SparsityReport",
    "get_criterion",
    "get_pattern",
    "get_pruner",
    "get_scheduler",
    "load_config",
    "prepare_pruning",
    "register_pruners",
    "select_modules",
    "sparsity_report",
]
