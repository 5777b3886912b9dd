"""Adapter for the Hugging Face ``Trainer`` (optional: ``pip install prunekit[hf]``).

Example::

    from prunekit.training.hf import PruningTrainerCallback
    trainer = Trainer(model=model, args=args, train_dataset=ds,
                      callbacks=[PruningTrainerCallback({"prune_type": "snip_momentum", "pattern": "4x1",
                                                         "target_sparsity": 0.8, "end_step": 1000})])
    trainer.train()

At ``on_train_begin`` the callback calls :func:`~prunekit.training.prepare_pruning`
on the trainer's model and wires it to the trainer's optimizer step hooks, so
every optimizer step (after gradient accumulation) is one pruning step; at
``on_train_end`` it unwires. ``callback.pruning`` is the
:class:`~prunekit.training.PruningCallbacks` object (for reports and checkpoints).
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from .wiring import PruningCallbacks, prepare_pruning

try:
    from transformers import TrainerCallback
except ImportError as _e:  # pragma: no cover - depends on the environment
    raise ImportError("prunekit.training.hf needs transformers: pip install 'prunekit[hf]'") from _e

__all__ = ["PruningTrainerCallback"]


def _inner_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    # accelerate wraps the optimizer; its hooks must go on the real one
    seen = 0
    while not type(optimizer).__module__.startswith("torch.optim") and hasattr(optimizer, "optimizer") and seen < 5:
        optimizer = optimizer.optimizer
        seen += 1
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"the trainer's optimizer {optimizer!r} is not a torch.optim.Optimizer")
    return optimizer


class PruningTrainerCallback(TrainerCallback):
    """Prunes the trainer's model during ``trainer.train()`` as ``config`` says."""

    def __init__(self, config: Any) -> None:
        self.config = config
        self.pruning: Optional[PruningCallbacks] = None

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        if model is None or optimizer is None:
            raise ValueError("PruningTrainerCallback needs the trainer's model and optimizer at on_train_begin")
        if self.pruning is None:
            self.pruning = prepare_pruning(model, self.config, _inner_optimizer(optimizer))
        elif not self.pruning.wired:
            self.pruning.wire(_inner_optimizer(optimizer))

    def on_epoch_begin(self, args, state, control, **kwargs):
        if self.pruning is not None:
            self.pruning.on_epoch_begin(int(state.epoch or 0))

    def on_epoch_end(self, args, state, control, **kwargs):
        if self.pruning is not None:
            self.pruning.on_epoch_end()

    def on_train_end(self, args, state, control, **kwargs):
        if self.pruning is not None:
            self.pruning.unwire()
            self.pruning.on_train_end()
