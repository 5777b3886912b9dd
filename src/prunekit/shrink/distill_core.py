"""What both distillation engines share, so that they compute the same thing step for step.

* :class:`Settings` -- the checked options of :func:`prunekit.shrink.distill`;
* :func:`make_optimizer` / :func:`make_scheduler` -- AdamW with the Hugging Face ``Trainer``'s
  weight-decay groups, and its learning-rate schedules (the same formulas);
* :class:`Objective` -- one batch's loss: the teacher under ``no_grad``, the student, the loss;
* :func:`probe` -- the loss checked once on a real batch, before anything trains;
* :class:`Recorder` -- per-step losses, tokens seen, logging and the progress callback;
* :func:`checkpoints` -- the ``checkpoint-<step>`` folders of an output folder;
* :func:`seed_all`, :func:`modes` / :func:`restore_modes`, :func:`count_tokens`.
"""

from __future__ import annotations

import logging
import math
import os
import random
import re
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor, nn

from ..oneshot.blocks import call_model, to_device
from .distill_losses import DistillLoss, is_finite_scalar

__all__ = ["CHECKPOINT", "LOOP_STATE", "SCHEDULES", "TRAINER_STATE", "Objective", "Recorder", "Settings",
           "checkpoints", "count_tokens", "decay_parameter_names", "device_of", "make_optimizer", "make_scheduler",
           "modes", "probe", "restore_modes", "seed_all"]

logger = logging.getLogger("prunekit.shrink.distillation")

WHAT = "prunekit.distill"
#: learning-rate schedules after the warmup: "linear" (to 0), "constant", "cosine" (to 0)
SCHEDULES = ("linear", "constant", "cosine")
CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")
#: the file of a loop-engine checkpoint; a Trainer checkpoint has Trainer's ``trainer_state.json``
LOOP_STATE = "distill_state.pt"
TRAINER_STATE = "trainer_state.json"
# Trainer's rule: no weight decay for biases and normalization weights
_NO_DECAY = [re.compile(p) for p in (r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)")]


@dataclass(frozen=True)
class Settings:
    """The checked training options of one distillation run (see :func:`prunekit.shrink.distill`)."""

    steps: Optional[int] = None
    epochs: float = 1.0
    lr: float = 5e-5
    weight_decay: float = 0.0
    warmup: Union[int, float] = 0
    schedule: str = "linear"
    max_grad_norm: float = 1.0
    gradient_accumulation_steps: int = 1
    seed: int = 0
    device: Optional[torch.device] = None
    output_dir: Optional[str] = None
    save_steps: int = 500
    resume: bool = False
    logging_steps: int = 10
    callback: Optional[Callable[[int, float], Any]] = None

    def updates_per_epoch(self, batches: int) -> int:
        """Optimizer steps in one pass over ``batches`` batches (the last one may accumulate fewer)."""
        return max(math.ceil(batches / self.gradient_accumulation_steps), 1)

    def total_steps(self, batches: Optional[int]) -> int:
        """``steps``, or ``epochs`` passes over ``batches`` batches per process.

        Examples:
            >>> Settings(epochs=2, gradient_accumulation_steps=2).total_steps(5), Settings(steps=4).total_steps(None)
            (6, 4)
        """
        if self.steps is not None:
            return self.steps
        assert batches is not None  # distill() asks for steps when the data has no length
        return math.ceil(self.epochs * self.updates_per_epoch(batches))

    def warmup_steps(self, total: int) -> int:
        """Warmup steps: ``warmup`` itself, or a fraction of ``total`` when it is below 1.

        Examples:
            >>> Settings(warmup=0.1).warmup_steps(25), Settings(warmup=3).warmup_steps(25)
            (3, 3)
        """
        if isinstance(self.warmup, float) and self.warmup < 1:
            return math.ceil(self.warmup * total)
        return int(self.warmup)

    def summary(self) -> dict:
        """What a checkpoint records of these settings (plain values), to warn when a resume changes them."""
        return {k: getattr(self, k) for k in ("steps", "epochs", "lr", "weight_decay", "warmup", "schedule",
                                              "max_grad_norm", "gradient_accumulation_steps", "seed")}


# ----------------------------------------------------------------------------- optimizer and schedule
def decay_parameter_names(model: nn.Module) -> List[str]:
    """Names of the trainable parameters that get weight decay: not biases, not normalization weights
    (``nn.LayerNorm``, or a name that says norm) -- the Hugging Face ``Trainer``'s rule.

    Examples:
        >>> decay_parameter_names(nn.Sequential(nn.Linear(2, 2), nn.LayerNorm(2)))
        ['0.weight']
    """
    owners: Dict[str, str] = {}
    for mname, module in model.named_modules():
        for pname in module._parameters:
            owners.setdefault(f"{mname}.{pname}" if mname else pname, mname)
    layer_norms = {n for n, m in model.named_modules() if isinstance(m, nn.LayerNorm)}
    out = []
    for name, p in model.named_parameters():
        owner = owners.get(name, "")
        in_norm = any(owner == ln or owner.startswith(ln + ".") for ln in layer_norms)
        if p.requires_grad and not in_norm and not any(r.search(name.lower()) for r in _NO_DECAY):
            out.append(name)
    return out


def make_optimizer(model: nn.Module, settings: Settings) -> torch.optim.AdamW:
    """AdamW (betas 0.9/0.999, eps 1e-8) over the trainable parameters, weight decay as
    :func:`decay_parameter_names` says.

    Examples:
        >>> opt = make_optimizer(nn.Linear(2, 2), Settings(lr=0.1, weight_decay=0.01))
        >>> [(len(g["params"]), g["weight_decay"]) for g in opt.param_groups]
        [(1, 0.01), (1, 0.0)]
    """
    decay = set(decay_parameter_names(model))
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [{"params": [p for n, p in named if n in decay], "weight_decay": settings.weight_decay},
              {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0}]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=settings.lr, betas=(0.9, 0.999), eps=1e-8)


def _factor(step: int, kind: str, warmup: int, total: int) -> float:
    if step < warmup:
        return float(step) / float(max(1, warmup))
    if kind == "constant":
        return 1.0
    progress = float(step - warmup) / float(max(1, total - warmup))
    if kind == "linear":
        return max(0.0, 1.0 - progress)
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))


def make_scheduler(optimizer: Any, settings: Settings, total: int) -> torch.optim.lr_scheduler.LambdaLR:
    """The learning-rate schedule over ``total`` steps: a linear warmup from 0, then ``settings.schedule``
    (the formulas of ``transformers.get_scheduler``'s ``linear``, ``constant_with_warmup``, ``cosine``).

    Examples:
        >>> opt = torch.optim.SGD(nn.Linear(1, 1).parameters(), lr=1.0)
        >>> sched, lrs = make_scheduler(opt, Settings(warmup=2, schedule="linear"), 4), []
        >>> for _ in range(4):
        ...     lrs.append(opt.param_groups[0]["lr"]); opt.step(); sched.step()
        >>> lrs
        [0.0, 0.5, 1.0, 0.5]
    """
    warmup = settings.warmup_steps(total)
    kind = settings.schedule

    def factor(step: int) -> float:
        return _factor(step, kind, warmup, total)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


# ----------------------------------------------------------------------------- models and batches
def seed_all(seed: int) -> None:
    """Seed Python's, NumPy's (when installed) and torch's generators, as ``transformers.set_seed`` does.

    Examples:
        >>> seed_all(3); a = torch.rand(1); seed_all(3); bool(torch.equal(a, torch.rand(1)))
        True
    """
    random.seed(seed)
    try:
        import numpy
    except ImportError:  # pragma: no cover - numpy ships with torch's usual installs
        numpy = None  # type: ignore[assignment]
    if numpy is not None:
        numpy.random.seed(seed)
    torch.manual_seed(seed)


def modes(model: nn.Module) -> List[Tuple[nn.Module, bool]]:
    """Every submodule's ``training`` flag, for :func:`restore_modes`.

    Examples:
        >>> net = nn.Sequential(nn.Linear(1, 1), nn.Dropout()); net[1].eval()
        Dropout(p=0.5, inplace=False)
        >>> saved = modes(net); _ = net.train(); restore_modes(saved); [m.training for m in net]
        [True, False]
    """
    return [(m, m.training) for m in model.modules()]


def restore_modes(saved: Sequence[Tuple[nn.Module, bool]]) -> None:
    """Put back the flags :func:`modes` recorded (idempotent)."""
    for m, flag in saved:
        m.training = flag


def device_of(model: nn.Module) -> Optional[torch.device]:
    """The device of the model's first parameter (or buffer); ``None`` when it has neither.

    Examples:
        >>> device_of(nn.Linear(1, 1)), device_of(nn.ReLU())
        (device(type='cpu'), None)
    """
    for t in model.parameters():
        return t.device
    for b in model.buffers():
        return b.device
    return None


def as_batch(batch: Any) -> Any:
    """A batch as :func:`call_model` takes it: a mapping (``BatchEncoding``) becomes a dict."""
    if not isinstance(batch, dict) and hasattr(batch, "keys") and hasattr(batch, "__getitem__"):
        return {k: batch[k] for k in batch.keys()}
    return batch


def count_tokens(batch: Any) -> int:
    """Tokens in a batch: the real ones of its ``attention_mask``, else every ``input_ids`` entry (0 without).

    Examples:
        >>> count_tokens({"input_ids": torch.ones(2, 3), "attention_mask": torch.tensor([[1, 1, 0], [1, 0, 0]])})
        3
        >>> count_tokens({"input_ids": torch.ones(2, 3)}), count_tokens({"pixel_values": torch.ones(1, 3, 4, 4)})
        (6, 0)
    """
    if isinstance(batch, dict):
        mask, ids = batch.get("attention_mask"), batch.get("input_ids")
        if isinstance(mask, Tensor):
            return int((mask != 0).sum())
        if isinstance(ids, Tensor):
            return ids.numel()
        return 0
    if isinstance(batch, Tensor) and not batch.is_floating_point():
        return batch.numel()
    return 0


class Objective:
    """The loss of one batch: the teacher (``no_grad``) and the student on it, compared by ``loss``.

    ``batch`` must already be on the student's device; the teacher gets its own copy on its device.
    """

    def __init__(self, teacher: nn.Module, loss: Callable[[Any, Any, Any], Tensor], hidden_states: bool) -> None:
        self.teacher, self.loss, self.hidden_states = teacher, loss, hidden_states
        self.calls = 0  # training batches started (the probe does not count)

    def inputs(self, batch: Any) -> Any:
        """The model inputs of ``batch`` (``output_hidden_states=True`` added when the loss needs them)."""
        return dict(batch, output_hidden_states=True) if self.hidden_states else batch

    def teacher_output(self, batch: Any) -> Any:
        """The teacher's output on ``batch``, without gradients."""
        inputs = self.inputs(batch)
        device = device_of(self.teacher)
        with torch.no_grad():
            return call_model(self.teacher, inputs if device is None else to_device(inputs, device))

    def __call__(self, student: nn.Module, batch: Any) -> Tensor:
        self.calls += 1
        teacher_out = self.teacher_output(batch)
        value = self.loss(call_model(student, self.inputs(batch)), teacher_out, batch)
        if not isinstance(value, Tensor) or not value.requires_grad:
            raise ValueError(f"{WHAT}: the loss {value!r} does not depend on the student's parameters (no "
                             "gradient); a loss function must compute its value from student_out")
        return value


def probe(student: nn.Module, objective: Objective, batch: Any, loss: Any) -> Callable[[Any, Any, Any], Tensor]:
    """The loss to train with, checked on ``batch`` (on the student's device) before anything trains.

    Both models run once under ``no_grad``, the student in eval mode (its modes are put back). A
    :class:`DistillLoss` is resolved and shape-checked (``ValueError`` naming the shapes); a function
    must return a finite scalar tensor (``TypeError`` otherwise).
    """
    saved = modes(student)
    student.eval()
    try:
        with torch.no_grad():
            student_out = call_model(student, objective.inputs(batch))
            teacher_out = objective.teacher_output(batch)
            fn = loss.check(student_out, teacher_out, batch) if isinstance(loss, DistillLoss) else loss
            value = fn(student_out, teacher_out, batch)
    finally:
        restore_modes(saved)
    if not is_finite_scalar(value):
        shown = f"a tensor of shape {tuple(value.shape)} ({value.dtype})" if isinstance(value, Tensor) else repr(value)
        raise TypeError(f"{WHAT}: the loss returned {shown} on the first batch; it must return one finite floating "
                        "scalar tensor (reduce it, e.g. with .mean())")
    return fn


# ----------------------------------------------------------------------------- progress
class Recorder:
    """Each optimizer step's loss and tokens: logged every ``logging_steps`` steps (and the last),
    handed to ``callback(step, loss)``, kept for the report."""

    def __init__(self, settings: Settings, total: int, start_step: int, main_process: bool = True) -> None:
        self.settings, self.total, self.start_step, self.main = settings, total, start_step, main_process
        self.losses: List[float] = []
        self.tokens = 0
        self.started = time.perf_counter()

    def record(self, step: int, loss: float, tokens: int) -> None:
        """One optimizer step done: ``loss`` is its mean over micro-batches (and processes)."""
        self.losses.append(loss)
        self.tokens += tokens
        if not self.main:
            return
        every = self.settings.logging_steps
        if every and (step % every == 0 or step == self.total):
            logger.info("%s: step %d/%d, loss %.6g, %d tokens, %.1f s", WHAT, step, self.total, loss, self.tokens,
                        self.seconds)
        if self.settings.callback is not None:
            self.settings.callback(step, loss)

    @property
    def seconds(self) -> float:
        """Seconds since the recorder was made."""
        return time.perf_counter() - self.started


def checkpoints(output_dir: Optional[str]) -> List[Tuple[int, str]]:
    """``(step, path)`` of the ``checkpoint-<step>`` folders in ``output_dir``, by step.

    Examples:
        >>> import tempfile
        >>> d = tempfile.mkdtemp()
        >>> for name in ("checkpoint-10", "checkpoint-2", "notes"):
        ...     os.mkdir(os.path.join(d, name))
        >>> [step for step, _ in checkpoints(d)]
        [2, 10]
    """
    if output_dir is None or not os.path.isdir(output_dir):
        return []
    found = []
    for name in os.listdir(output_dir):
        m = CHECKPOINT.match(name)
        path = os.path.join(output_dir, name)
        if m and os.path.isdir(path):
            found.append((int(m.group(1)), path))
    return sorted(found)
