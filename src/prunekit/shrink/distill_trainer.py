"""The Hugging Face ``Trainer`` engine of distillation: ``accelerate launch`` / ``torchrun`` run it unchanged.

:class:`DistillTrainer` is a ``transformers.Trainer`` whose loss is the distillation loss
(:class:`~prunekit.shrink.distill_core.Objective`: the teacher under ``no_grad``, then the
student), whose optimizer and schedule are the ones the plain loop builds
(:func:`~prunekit.shrink.distill_core.make_optimizer`, :func:`~prunekit.shrink.distill_core.make_scheduler`)
and whose data are the caller's batches in their order, one batch per step and process (no
shuffling, no collation). Everything else is ``Trainer``'s: device placement, DDP/FSDP,
gradient accumulation, clipping, checkpoints and ``resume_from_checkpoint``.

Checkpoints are ``Trainer``'s, made atomic: every process writes into a staging folder,
then the main process moves it into ``output_dir/checkpoint-<step>`` in one step
(:func:`prunekit.io.writer.atomic_folder`), so an interrupted save leaves no half checkpoint.
Each optimizer step's loss is averaged over the processes and recorded; the log lines and the
progress callback run on the main process only.
"""

from __future__ import annotations

import math
import os
import shutil
import tempfile
from typing import Any, Callable, List, Optional

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from ..io.reader import read_json
from ..io.writer import atomic_folder
from .distill_core import (TRAINER_STATE, WHAT, Objective, Recorder, Settings, as_batch, checkpoints, count_tokens,
                           make_optimizer, make_scheduler, seed_all)

try:
    from transformers import Trainer, TrainerCallback, TrainingArguments
    from transformers.trainer_callback import PrinterCallback, ProgressCallback
    from transformers.utils import logging as hf_logging
except ImportError as _e:  # pragma: no cover - depends on the environment
    raise ImportError("engine='trainer' needs transformers: pip install 'prunekit[hf]', or use engine='loop'") from _e

__all__ = ["DistillTrainer", "run_trainer", "STAGING"]

#: the folder, inside output_dir, where a checkpoint is written before it is moved into place
STAGING = ".checkpoint-staging.prunekit-tmp"


class _Listed(Dataset):
    """A list of ready batches as a map-style dataset: item ``i`` is batch ``i``."""

    def __init__(self, batches: List[Any]) -> None:
        self.batches = batches

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, i: int) -> Any:
        return self.batches[i]


def _first(items: List[Any]) -> Any:
    """The collate function of :class:`_Listed` loaders: each item already is a batch."""
    return items[0]


class _Steps(TrainerCallback):
    """Hands each optimizer step's loss (mean over processes) and tokens (sum) to the recorder."""

    def __init__(self, trainer: "DistillTrainer", recorder: Recorder) -> None:
        self.trainer, self.recorder = trainer, recorder

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.recorder.total, self.recorder.start_step = state.max_steps, state.global_step

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        t = self.trainer
        loss = t.pending if t.pending is not None else torch.zeros((), device=args.device)
        tokens = torch.tensor(t.tokens, device=loss.device, dtype=torch.int64)
        t.pending, t.tokens = None, 0
        loss = t.accelerator.reduce(loss.float(), reduction="mean")
        tokens = t.accelerator.reduce(tokens, reduction="sum")
        self.recorder.record(state.global_step, float(loss), int(tokens))


class DistillTrainer(Trainer):
    """``transformers.Trainer`` training ``model`` (the student) to match ``objective``'s teacher.

    ``batches`` is a list of ready batches or a ``DataLoader``; ``settings`` gives the optimizer
    and the schedule. Build it with :func:`run_trainer`.
    """

    loss_is_scaled_for_ga = False  # the loss is a per-batch mean: Trainer divides it by the accumulation
    batches: Any
    objective: Objective
    settings: Settings

    def __init__(self, *, batches: Any, objective: Objective, settings: Settings, **kwargs: Any) -> None:
        self.batches, self.objective, self.settings = batches, objective, settings
        self.pending: Optional[torch.Tensor] = None
        self.tokens = 0
        super().__init__(**kwargs)

    def get_train_dataloader(self) -> DataLoader:
        """The caller's batches in order: a ``DataLoader`` as given, a list one batch per item (its own
        generator, so iterating it draws nothing from the global one)."""
        data = self.batches
        if not isinstance(data, DataLoader):
            data = DataLoader(_Listed(list(data)), batch_size=1, collate_fn=_first, generator=torch.Generator())
        return self.accelerator.prepare(data)

    def create_optimizer(self, model: Optional[nn.Module] = None) -> torch.optim.Optimizer:
        """AdamW as the plain loop builds it."""
        if self.optimizer is None:
            target = self.model if model is None else model
            if target is None:
                raise ValueError("prunekit.shrink: DistillTrainer has no model to build an optimizer for")
            self.optimizer = make_optimizer(target, self.settings)
        return self.optimizer

    def create_scheduler(self, num_training_steps: int, optimizer: Optional[Any] = None) -> Any:
        """The schedule as the plain loop builds it."""
        if self.lr_scheduler is None:
            self.lr_scheduler = make_scheduler(self.optimizer if optimizer is None else optimizer, self.settings,
                                               num_training_steps)
            self._created_lr_scheduler = True
        return self.lr_scheduler

    def compute_loss(self, model: nn.Module, inputs: Any, return_outputs: bool = False,
                     num_items_in_batch: Any = None) -> Any:
        """The distillation loss of one micro-batch (its mean: Trainer scales it for accumulation)."""
        loss = self.objective(model, as_batch(inputs))
        return (loss, None) if return_outputs else loss

    def training_step(self, model: nn.Module, inputs: Any, num_items_in_batch: Any = None) -> torch.Tensor:
        """Trainer's step, keeping the scaled loss and the tokens of the optimizer step under way."""
        self.tokens += count_tokens(as_batch(inputs))
        loss = super().training_step(model, inputs, num_items_in_batch)
        self.pending = loss if self.pending is None else self.pending + loss
        return loss

    def _save_checkpoint(self, model: nn.Module, trial: Any) -> None:
        """Trainer's checkpoint, written to a staging folder and moved into place atomically."""
        real = self.args.output_dir
        if real is None:
            raise ValueError("prunekit.shrink: DistillTrainer saves checkpoints under args.output_dir, which is None")
        staging = os.path.join(real, STAGING)
        name = f"checkpoint-{self.state.global_step}"
        if self.args.should_save:
            shutil.rmtree(staging, ignore_errors=True)  # what an interrupted save left
        self.accelerator.wait_for_everyone()
        self.args.output_dir = staging
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self.args.output_dir = real
        self.accelerator.wait_for_everyone()
        if self.args.should_save:
            written = os.path.join(staging, name)
            with atomic_folder(os.path.join(real, name)) as tmp:
                for entry in os.listdir(written):
                    os.replace(os.path.join(written, entry), os.path.join(tmp, entry))
            shutil.rmtree(staging, ignore_errors=True)
        self.accelerator.wait_for_everyone()


def _arguments(settings: Settings, output_dir: str) -> TrainingArguments:
    device = settings.device
    return TrainingArguments(
        output_dir=output_dir,
        max_steps=settings.steps if settings.steps is not None else -1,
        num_train_epochs=settings.epochs,
        per_device_train_batch_size=1,
        gradient_accumulation_steps=settings.gradient_accumulation_steps,
        learning_rate=settings.lr,
        weight_decay=settings.weight_decay,
        max_grad_norm=settings.max_grad_norm,
        seed=settings.seed,
        save_strategy="steps" if settings.output_dir is not None else "no",
        save_steps=settings.save_steps,
        logging_strategy="no",
        report_to="none",
        disable_tqdm=True,
        remove_unused_columns=False,
        dataloader_pin_memory=False,
        use_cpu=device.type == "cpu" if device is not None else not _has_accelerator(),
    )


def _has_accelerator() -> bool:
    """Whether torch sees a GPU (or another accelerator); without one, ``Trainer`` must be told ``use_cpu`` to run
    several processes (``torchrun``) as one distributed job."""
    acc = getattr(torch, "accelerator", None)
    return bool(acc.is_available()) if acc is not None else torch.cuda.is_available()


def _finished(trainer: DistillTrainer, start: str, settings: Settings, recorder: Recorder) -> bool:
    """Whether checkpoint ``start`` already is at the last step (``Trainer`` would run one step more)."""
    path = os.path.join(start, TRAINER_STATE)
    step = read_json(path, what="Trainer checkpoint state").get("global_step") if os.path.isfile(path) else None
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"{WHAT}: {path} records global_step={step!r}; it is not a checkpoint to resume from (move "
                         "it away to resume from the one before it)")
    total = settings.steps
    if total is None:
        batches = len(trainer.get_train_dataloader())
        total = math.ceil(settings.epochs * settings.updates_per_epoch(batches))
    if step < total:
        return False
    recorder.total, recorder.start_step = total, step
    return True


def run_trainer(student: nn.Module, objective: Objective, data: Any, settings: Settings, recorder: Recorder,
                start: Optional[str], ready: Callable[[torch.device], None]) -> Optional[str]:
    """Train ``student`` with :class:`DistillTrainer` (from checkpoint ``start`` when given).

    ``ready(device)`` runs once the trainer has placed the student on its device and before
    anything trains (it places the teacher and checks the loss); the global generators are seeded
    after it. Returns the last checkpoint in ``output_dir``, if any.
    """
    scratch = None
    out = settings.output_dir
    if out is None:
        scratch = tempfile.TemporaryDirectory(prefix="prunekit-distill-")
        out = scratch.name
    trainer: Optional[DistillTrainer] = None
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # checkpoints write no progress bars: a library prints nothing
    try:
        args = _arguments(settings, out)
        trainer = DistillTrainer(model=student, args=args, batches=data, objective=objective, settings=settings,
                                 train_dataset=data.dataset if isinstance(data, DataLoader) else _Listed(list(data)))
        for cb in (PrinterCallback, ProgressCallback):
            trainer.remove_callback(cb)  # a library prints nothing: progress goes to logging and the callback
        trainer.add_callback(_Steps(trainer, recorder))
        recorder.main = trainer.is_world_process_zero()
        ready(args.device)
        seed_all(settings.seed)
        if start is not None and _finished(trainer, start, settings, recorder):
            return start
        trainer.train(resume_from_checkpoint=start)
    finally:
        if bars:
            hf_logging.enable_progress_bar()
        if trainer is not None:
            trainer.accelerator.free_memory()
            if settings.output_dir is not None and trainer.args.should_save:
                shutil.rmtree(os.path.join(settings.output_dir, STAGING), ignore_errors=True)
        if scratch is not None:
            scratch.cleanup()
    if settings.output_dir is None:
        return None
    found = checkpoints(settings.output_dir)
    return found[-1][1] if found else None
