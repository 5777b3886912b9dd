"""Neural Compressor's entry points: :class:`Pruning`, :func:`prepare_pruning`, :func:`prepare_compression`."""

from __future__ import annotations

import logging
import os
import re
from typing import Any, Dict, List, Optional, Tuple

from torch import Tensor, nn

from ...training import PruningCallbacks, prepare_pruning as _prepare_pruning
from .config import NCConfig, load_config
from .translate import _user_terms

__all__ = ["Pruning", "CompressionManager", "prepare_pruning", "prepare_compression"]

logger = logging.getLogger(__name__)


def _build(model: nn.Module, config: NCConfig, optimizer: Any) -> PruningCallbacks:
    try:
        return _prepare_pruning(model, config.to_pruning_config(model), optimizer)
    except (ValueError, TypeError) as err:
        new = _user_terms(err, config.layout)
        if new is err:
            raise
        raise new from None


# ---------------------------------------------------------------------- entry points
class Pruning:
    """Neural Compressor's ``Pruning(config)``: set ``model``, call the callbacks in your loop.

    The call order of Neural Compressor's PyTorch pruner: ``prune = Pruning(config)``,
    ``prune.model = model``, optionally ``update_items_for_all_pruners(**kw)``
    (1.x) / ``update_config(**kw)`` (2.x) and ``prepare()``, then
    ``on_train_begin()`` (builds the pruners), per epoch ``on_epoch_begin(epoch)``,
    per step ``on_step_begin(local_step)``, ``on_before_optimizer_step()``,
    ``optimizer.step()``, ``on_after_optimizer_step()``, ``on_step_end()``,
    ``on_epoch_end()``, and ``on_train_end()``; ``on_before_eval()`` /
    ``on_after_eval()`` around evaluation. ``get_sparsity_ratio()`` returns
    Neural Compressor's three figures.

    No optimizer is known to this API, so the pruned entries of the weights are
    zeroed again at every ``on_step_end`` (as Neural Compressor did): momentum
    cannot move them.

    Examples:
        >>> import torch, torch.nn as nn
        >>> from prunekit.compat.neural_compressor import Pruning
        >>> _ = torch.manual_seed(0)
        >>> model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
        >>> prune = Pruning({"prune_type": "magnitude", "pattern": "tile_pattern_1x1", "target_sparsity": 0.5})
        >>> prune.model = model
        >>> prune.on_train_begin()
        >>> prune.on_step_begin(0); prune.on_before_optimizer_step(); prune.on_after_optimizer_step(); prune.on_step_end()
        >>> [round(x, 4) for x in prune.get_sparsity_ratio()]
        [0.5, 0.4734, 0.5]
    """

    def __init__(self, config: Any) -> None:
        self._config = load_config(config)
        self.config_file_path = config if isinstance(config, (str, os.PathLike)) else None
        self.model: Optional[nn.Module] = None
        self.pruners: List[Any] = []
        self.callbacks: Optional[PruningCallbacks] = None

    @property
    def pruners_info(self) -> List[Dict[str, Any]]:
        """Every pruner's settings, merged over the globals and the defaults (Neural Compressor's names)."""
        return self._config.entries()

    @property
    def pruner_info(self) -> List[Dict[str, Any]]:
        """The 1.x name of :attr:`pruners_info`."""
        return self.pruners_info

    def update_items_for_all_pruners(self, **kwargs: Any) -> None:
        """Set ``key=value`` for every pruner (before ``on_train_begin``)."""
        if self.callbacks is not None:
            raise ValueError("update the config before on_train_begin(): the pruners are already built")
        self._config.update(**kwargs)

    def update_config(self, *args: Any, **kwargs: Any) -> None:
        """The 2.x name of :meth:`update_items_for_all_pruners`."""
        if args:
            raise TypeError(f"update_config takes keys only, e.g. update_config(start_step=1); got {args!r}")
        self.update_items_for_all_pruners(**kwargs)

    def prepare(self) -> None:
        """Kept for scripts that call it; the pruners are built by :meth:`on_train_begin`."""

    # ------------------------------------------------------------------ callbacks
    def on_train_begin(self, dataloader: Any = None) -> None:
        """Build the pruners on ``self.model`` (masks attached, target checked)."""
        if not isinstance(self.model, nn.Module):
            raise ValueError(f"set prune.model to the torch.nn.Module to prune before on_train_begin() "
                             f"(it is {type(self.model).__name__})")
        if self.callbacks is not None:
            raise ValueError("on_train_begin() was already called: the pruners exist")
        self.callbacks = _build(self.model, self._config, None)
        self.pruners = self.callbacks.pruners

    def _cb(self) -> PruningCallbacks:
        if self.callbacks is None:
            raise ValueError("call on_train_begin() first: it builds the pruners")
        return self.callbacks

    def on_epoch_begin(self, epoch: int) -> None:
        self._cb().call_event("on_epoch_begin", epoch)

    def on_step_begin(self, local_step: int = 0) -> None:
        self._cb().call_event("on_step_begin", local_step)

    def on_before_optimizer_step(self) -> None:
        self._cb().call_event("on_before_optimizer_step")

    def on_after_optimizer_step(self) -> None:
        self._cb().call_event("on_after_optimizer_step")

    def on_step_end(self) -> None:
        cb = self._cb()
        with cb.transaction():  # both or neither
            cb.call_event("on_step_end")
            if cb.optimizer is None:
                cb.call_event("mask_weights")

    def on_epoch_end(self) -> None:
        self._cb().call_event("on_epoch_end")

    def on_train_end(self) -> None:
        self._cb().call_event("on_train_end")
        logger.info("sparsity (elementwise over Linear/Conv, elementwise over all, blockwise): %s",
                    self.get_sparsity_ratio())

    def on_before_eval(self) -> None:
        self._cb().call_event("on_before_eval")

    def on_after_eval(self) -> None:
        self._cb().call_event("on_after_eval")

    def on_after_compute_loss(self, input: Any, student_output: Any, student_loss: Any,
                              teacher_output: Any = None) -> Any:
        """``prepare_compression``'s loss hook: pruning leaves the loss as it is."""
        return student_loss

    # ------------------------------------------------------------------ figures
    def get_sparsity_ratio(self) -> Tuple[float, float, float]:
        """Neural Compressor's three figures: zero weights of the pruned layers over all Linear/Conv
        weights, the same zeros over all parameters, and zero blocks (under each pruner's pattern,
        counted in weights) over all Linear/Conv weights."""
        cb = self._cb()
        zeros = 0
        block_zeros = 0
        for p in cb.pruners:
            numel = 0
            units = zero_units = 0
            for n, mask in p.masks.items():
                zeros += int((mask == 0).sum())
                numel += mask.numel()
                pruned = p.pattern.unit_pruned(mask)
                units += pruned.numel()
                zero_units += int(pruned.sum())
            if units:
                block_zeros += int(numel * (zero_units / units))
        model = self.model
        if model is None:  # callbacks are built on a model
            raise ValueError("Pruning.get_sparsity_ratio(): pruning.model is None; set it to the pruned model")
        weights = [getattr(m, "weight", None) for m in model.modules()
                   if type(m).__name__ == "Linear" or re.search(r"Conv.d", type(m).__name__)]
        lc = sum(w.numel() for w in weights if isinstance(w, Tensor))
        params = sum(p.numel() for p in model.parameters())
        return (zeros / lc if lc else 0.0, zeros / params if params else 0.0, block_zeros / lc if lc else 0.0)

    def __repr__(self) -> str:
        return f"Pruning({self._config!r}, built={self.callbacks is not None})"


def prepare_pruning(model: nn.Module, config: Any, optimizer: Any = None, dataloader: Any = None,
                    loss_func: Any = None, framework: str = "pytorch", device: Optional[str] = None) -> PruningCallbacks:
    """Neural Compressor 2.x's ``prepare_pruning``: prune ``model`` while ``optimizer`` trains it.

    ``config`` is a :class:`WeightPruningConfig`, a YAML path or a dict of
    either layout. Every ``optimizer.step()`` is one pruning step (through the
    optimizer's step hooks; the model and optimizer are not patched). Returns
    :class:`prunekit.training.PruningCallbacks`. Without an optimizer, call its
    callbacks yourself.
    """
    if framework != "pytorch":
        raise ValueError(f"framework={framework!r}: prunekit prunes PyTorch (and TensorPlay) models; "
                         "write framework='pytorch'")
    if dataloader is not None and optimizer is None:
        raise ValueError("prepare_pruning(dataloader=...) without an optimizer runs Neural Compressor's one-shot "
                         "pruners (sparse_gpt, retrain_free); prunekit does that in prunekit.oneshot")
    if device is not None:
        logger.info("device=%r: prunekit prunes where the model's weights are", device)
    return _build(model, load_config(config), optimizer)


class CompressionManager:
    """What ``prepare_compression`` returns: ``model`` and ``callbacks`` (a :class:`Pruning`, built)."""

    def __init__(self, model: nn.Module, config: Any) -> None:
        self.model = model
        self.callbacks = Pruning(config)
        self.callbacks.model = model

    def __repr__(self) -> str:
        return f"CompressionManager(callbacks={self.callbacks!r})"


def prepare_compression(model: nn.Module, confs: Any) -> CompressionManager:
    """Neural Compressor 2.x's ``prepare_compression(model, config)`` for pruning configs.

    Returns a :class:`CompressionManager`; call ``manager.callbacks.on_train_begin()``
    and the other callbacks in your loop. Only pruning configs are served.

    Examples:
        >>> import torch.nn as nn
        >>> from prunekit.compat.neural_compressor import WeightPruningConfig, prepare_compression
        >>> model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
        >>> manager = prepare_compression(model, WeightPruningConfig(pattern="1x1", target_sparsity=0.5))
        >>> manager.callbacks.on_train_begin(); list(manager.callbacks.pruners[0].modules)
        ['0']
    """
    if isinstance(confs, (list, tuple)):
        if len(confs) != 1:
            raise ValueError(f"prepare_compression got {len(confs)} configs; prunekit serves one pruning config "
                             "(quantization-aware training and distillation are not part of prunekit)")
        confs = confs[0]
    return CompressionManager(model, confs)
