"""Adapter for the Hugging Face ``Trainer`` (optional: ``pip install prunekit[hf]``).

Example::

    from prunekit.training.hf import PruningTrainerCallback
    trainer = Trainer(model=model, args=args, train_dataset=ds,
                      callbacks=[PruningTrainerCallback({"prune_type": "snip_momentum", "pattern": "4x1",
                                                         "target_sparsity": 0.8, "end_step": 1000})])
    trainer.train()                                   # or trainer.train(resume_from_checkpoint=True)

When the ``Trainer`` is built (``on_init_end``) the callback attaches the
masks to the trainer's model, so every checkpoint holds ``weight_orig`` and
``weight_mask`` and a resumed run loads them into a model that has them. At
``on_train_begin`` it wires itself to the trainer's optimizer step hooks, so
every optimizer step (after gradient accumulation) is one pruning step; at
``on_train_end`` it unwires. ``callback.pruning`` is the
:class:`~prunekit.training.PruningCallbacks` object (for reports).

Checkpoints and resuming: the callback is an ``ExportableState``. Each
checkpoint's ``trainer_state.json`` records the pruners' step, schedule
position and sparsity (the masks are in the model's own weights file), and
gradient scores (SNIP-momentum's running sums) are written next to it as
``prunekit_pruning_scores.safetensors``. A run resumed from that checkpoint
restores all of it -- with or without ``restore_callback_states_from_checkpoint``
-- so it continues the schedule where it stopped and ends with the masks an
uninterrupted run gives. Pass the callback to the ``Trainer`` constructor
(``callbacks=[...]``): added later, it cannot attach the masks before the
checkpoint is loaded.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Dict, List, Optional

import torch

from .config import load_config
from .wiring import PruningCallbacks, prepare_pruning

try:
    from transformers import TrainerCallback
    from transformers.trainer_callback import ExportableState
except ImportError as _e:  # pragma: no cover - depends on the environment
    raise ImportError("prunekit.training.hf needs transformers: pip install 'prunekit[hf]'") from _e

__all__ = ["PruningTrainerCallback", "SCORES_FILE"]

logger = logging.getLogger(__name__)

#: the file, inside a checkpoint folder, that holds the pruners' gradient scores
SCORES_FILE = "prunekit_pruning_scores.safetensors"
_TENSORS = ("masks", "scores")


def _inner_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    # accelerate wraps the optimizer; its hooks must go on the real one
    seen = 0
    while not type(optimizer).__module__.startswith("torch.optim") and hasattr(optimizer, "optimizer") and seen < 5:
        optimizer = optimizer.optimizer
        seen += 1
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"the trainer's optimizer {optimizer!r} is not a torch.optim.Optimizer")
    return optimizer


class PruningTrainerCallback(TrainerCallback, ExportableState):
    """Prunes the trainer's model during ``trainer.train()`` as ``config`` says; resumable.

    ``config`` is anything :func:`~prunekit.training.load_config` reads; it is
    stored in the checkpoints in its plain-dict form.
    """

    def __init__(self, config: Any) -> None:
        self.config = load_config(config).to_dict()
        self.pruning: Optional[PruningCallbacks] = None
        self._resumed_from: Optional[Dict[str, Any]] = None

    # ------------------------------------------------------------------ checkpoints
    def state(self) -> Dict[str, Any]:
        """What ``trainer_state.json`` keeps: the config, and each pruner's step, schedule position and
        sparsity (JSON numbers; the masks live in the model's weights, the scores in :data:`SCORES_FILE`)."""
        pruners: List[Dict[str, Any]] = []
        local_step = 0
        if self.pruning is not None:
            full = self.pruning.state_dict()
            local_step = full["local_step"]
            for p in full["pruners"]:
                pruners.append({k: v for k, v in p.items() if k not in _TENSORS})
        return {"args": {"config": self.config},
                "attributes": {"_resumed_from": {"pruners": pruners, "local_step": local_step}}}

    def _save_scores(self, folder: str) -> None:
        if self.pruning is None or not os.path.isdir(folder):
            return
        tensors = {f"{i}/{name}": s.detach().contiguous().cpu()
                   for i, p in enumerate(self.pruning.pruners) for name, s in p.scores.items()}
        if not tensors:
            return
        from safetensors.torch import save_file

        from ..io.writer import atomic_path

        with atomic_path(os.path.join(folder, SCORES_FILE)) as tmp:  # no temporary left, whatever happens
            save_file(tensors, tmp)

    def _load_scores(self, folders: List[str]) -> Dict[str, torch.Tensor]:
        for folder in folders:
            path = os.path.join(folder, SCORES_FILE)
            if os.path.isfile(path):
                from safetensors.torch import load_file

                return load_file(path)
        return {}

    def _saved_state(self, state: Any) -> Optional[Dict[str, Any]]:
        if self._resumed_from is not None and self._resumed_from.get("pruners"):
            return self._resumed_from
        saved = (getattr(state, "stateful_callbacks", None) or {}).get(type(self).__name__)
        if isinstance(saved, list):  # several of these callbacks: the one with our config
            saved = next((s for s in saved if s.get("args", {}).get("config") == self.config), None)
        if not isinstance(saved, dict):
            return None
        found = saved.get("attributes", {}).get("_resumed_from")
        return found if found and found.get("pruners") else None

    # ------------------------------------------------------------------ events
    def on_init_end(self, args, state, control, model=None, **kwargs):
        if model is not None and self.pruning is None:
            # masks on the model before any checkpoint is loaded into it
            self.pruning = prepare_pruning(model, self.config)

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        if model is None or optimizer is None:
            raise ValueError("PruningTrainerCallback needs the trainer's model and optimizer at on_train_begin")
        if self.pruning is None:
            self.pruning = prepare_pruning(model, self.config)
        if not self.pruning.wired:
            self.pruning.wire(_inner_optimizer(optimizer))
        saved = self._saved_state(state) if state.global_step > 0 else None
        if saved is not None:
            self._resume(saved, args, state)
        self._resumed_from = None

    def _resume(self, saved: Dict[str, Any], args: Any, state: Any) -> None:
        if self.pruning is None:
            return
        folders = [os.path.join(args.output_dir, f"checkpoint-{state.global_step}")]
        resume = getattr(args, "resume_from_checkpoint", None)
        if isinstance(resume, str):
            folders.insert(0, resume)
        scores = self._load_scores(folders)
        full = {"local_step": saved.get("local_step", 0), "pruners": []}
        for i, (p, s) in enumerate(zip(self.pruning.pruners, saved["pruners"])):
            own = {k[len(f"{i}/"):]: v for k, v in scores.items() if k.startswith(f"{i}/")}
            full["pruners"].append(dict(s, masks={n: m for n, m in p.masks.items()}, scores=own))
        needs_scores = any(p.criterion.needs_grad and s.get("global_step", 0) <= p.end_step
                           for p, s in zip(self.pruning.pruners, saved["pruners"]))
        if needs_scores and not scores:
            logger.warning("resuming at step %d without %s in the checkpoint: gradient scores restart from zero",
                           state.global_step, SCORES_FILE)
        self.pruning.load_state_dict(full)
        if self.pruning.global_step != state.global_step:
            logger.warning("pruners resumed at step %d, the trainer at step %d", self.pruning.global_step,
                           state.global_step)

    def on_save(self, args, state, control, **kwargs):
        self._save_scores(os.path.join(args.output_dir, f"checkpoint-{state.global_step}"))

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
