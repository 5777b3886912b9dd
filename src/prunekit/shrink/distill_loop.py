"""The plain PyTorch engine of distillation: the Hugging Face ``Trainer``'s loop, without it.

It walks the data as ``Trainer`` does -- epochs of ``ceil(batches / accumulation)`` optimizer
steps, the last one of an epoch accumulating what is left, the same loss scaling, clipping,
optimizer, schedule and step order -- so that both engines reach the same weights. Checkpoints
are ``output_dir/checkpoint-<step>/distill_state.pt`` (student weights, optimizer, schedule,
step, random generators), each folder written atomically (:func:`prunekit.io.writer.atomic_folder`):
a checkpoint is complete or absent.
"""

from __future__ import annotations

import itertools
import logging
import os
import random
from typing import Any, Dict, Optional, Tuple

import torch
from torch import nn

from ..io.reader import open_regular
from ..io.writer import atomic_folder
from ..oneshot.blocks import to_device
from .distill_core import (LOOP_STATE, WHAT, Objective, Recorder, Settings, as_batch, count_tokens, make_optimizer,
                           make_scheduler, seed_all)

__all__ = ["FORMAT", "load_checkpoint", "run_loop", "save_checkpoint"]

logger = logging.getLogger("prunekit.shrink.distillation")

FORMAT = "prunekit.distill/1"


def _rng_state() -> Dict[str, Any]:
    state: Dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: Dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(output_dir: str, step: int, student: nn.Module, optimizer: Any, scheduler: Any,
                    settings: Settings) -> str:
    """Write ``output_dir/checkpoint-<step>`` atomically; its path.

    Examples:
        >>> import tempfile
        >>> net = nn.Linear(2, 2); opt = torch.optim.SGD(net.parameters(), lr=0.1)
        >>> sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
        >>> path = save_checkpoint(tempfile.mkdtemp(), 3, net, opt, sched, Settings())
        >>> os.path.basename(path), os.listdir(path)
        ('checkpoint-3', ['distill_state.pt'])
    """
    state = {"format": FORMAT, "step": step, "student": student.state_dict(), "optimizer": optimizer.state_dict(),
             "scheduler": scheduler.state_dict(), "rng": _rng_state(), "settings": settings.summary()}
    path = os.path.join(output_dir, f"checkpoint-{step}")
    with atomic_folder(path) as tmp:
        torch.save(state, os.path.join(tmp, LOOP_STATE))
    return path


def _bad(path: str, why: str) -> ValueError:
    return ValueError(f"{WHAT}: {path} is not a checkpoint this run can resume from: {why}; resume from another "
                      "output_dir, or delete that folder to resume from the one before it")


def _check_weights(path: str, saved: Any, student: nn.Module) -> None:
    own = student.state_dict()
    if not isinstance(saved, dict) or set(saved) != set(own):
        keys = set(saved) if isinstance(saved, dict) else set()
        missing, extra = sorted(set(own) - keys)[:3], sorted(keys - set(own))[:3]
        raise _bad(path, f"its student weights do not fit this student (missing {missing}, unexpected {extra})")
    for k, t in own.items():
        v = saved[k]
        if not isinstance(v, torch.Tensor) or v.shape != t.shape or v.dtype != t.dtype:
            got = f"{v.dtype} {list(v.shape)}" if isinstance(v, torch.Tensor) else type(v).__name__
            raise _bad(path, f"its {k!r} is {got}, the student's {t.dtype} {list(t.shape)}")


def load_checkpoint(path: str, student: nn.Module, optimizer: Any, scheduler: Any,
                    settings: Settings) -> Tuple[int, Dict[str, Any]]:
    """Load a checkpoint of :func:`save_checkpoint`: ``(step, random generator states)``.

    Everything is read and checked before anything changes; the student's weights are loaded last.
    """
    file = os.path.join(path, LOOP_STATE)
    try:
        with open_regular(file, what="distill checkpoint") as f:
            state = torch.load(f, map_location="cpu", weights_only=True)
    except Exception as e:  # a damaged or foreign file: say which, and what to do
        raise _bad(file, f"it cannot be read ({type(e).__name__}: {e})") from e
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise _bad(file, f"it is not a {FORMAT} checkpoint")
    step = state.get("step")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise _bad(file, f"its step is {step!r}")
    rng = state.get("rng")
    if not isinstance(rng, dict) or not isinstance(rng.get("torch"), torch.Tensor) or "python" not in rng:
        raise _bad(file, "it has no random generator states")
    _check_weights(file, state.get("student"), student)
    try:
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
    except (KeyError, ValueError, TypeError, RuntimeError) as e:
        raise _bad(file, f"its optimizer or schedule state does not fit ({e})") from e
    changed = {k: (v, settings.summary().get(k)) for k, v in (state.get("settings") or {}).items()
               if settings.summary().get(k) != v}
    if changed:
        logger.warning("%s: resuming from %s with other settings (saved, now): %s", WHAT, path, changed)
    student.load_state_dict(state["student"])
    return step, rng


def run_loop(student: nn.Module, objective: Objective, data: Any, settings: Settings, recorder: Recorder,
             total: int, start: Optional[str], device: Optional[torch.device]) -> Optional[str]:
    """Train ``student`` for ``total`` optimizer steps (from checkpoint ``start`` when given).

    ``data`` is re-iterable (a list or a ``DataLoader``); batches go to ``device``. Returns the
    last checkpoint written, if any.
    """
    ga = settings.gradient_accumulation_steps
    optimizer = make_optimizer(student, settings)
    scheduler = make_scheduler(optimizer, settings, total)
    step, rng = 0, None
    if start is not None:
        step, rng = load_checkpoint(start, student, optimizer, scheduler, settings)
        recorder.start_step = step
    else:
        seed_all(settings.seed)
    n = len(data) if hasattr(data, "__len__") else None
    per_epoch = settings.updates_per_epoch(n) if n is not None else total
    remainder = (n % ga or ga) if n is not None else ga
    first_epoch, skip = divmod(step, per_epoch)
    epoch, saved = first_epoch, start
    student.train()
    student.zero_grad(set_to_none=True)
    while step < total:
        resuming = rng is not None and epoch == first_epoch
        if resuming and not skip and rng is not None:
            _set_rng_state(rng)
        batches = iter(data)
        if resuming and skip:
            for _ in itertools.islice(batches, skip * ga):
                pass
        ran = False
        for update in range(skip if resuming else 0, per_epoch):
            group = list(itertools.islice(batches, ga if update != per_epoch - 1 else remainder))
            if resuming and skip and rng is not None:
                _set_rng_state(rng)  # where the interrupted run stood after this step's predecessor
                resuming = False
            if not group:
                break
            ran = True
            loss, tokens = torch.zeros(()), 0
            for b in group:
                b = as_batch(b)
                tokens += count_tokens(b)
                b = b if device is None else to_device(b, device)
                value = objective(student, b) / len(group)
                value.backward()
                loss = loss.to(value.device) + value.detach()
            if settings.max_grad_norm > 0:
                torch.nn.utils.clip_grad_norm_(student.parameters(), settings.max_grad_norm)
            optimizer.step()
            scheduler.step()
            student.zero_grad(set_to_none=True)
            step += 1
            recorder.record(step, float(loss), tokens)
            if settings.output_dir is not None and (step % settings.save_steps == 0 or step >= total):
                saved = save_checkpoint(settings.output_dir, step, student, optimizer, scheduler, settings)
            if step >= total:
                break
        epoch, skip = epoch + 1, 0
        if not ran:
            logger.warning("%s: the data gave no batch in epoch %d; stopping at step %d of %d", WHAT, epoch, step,
                           total)
            break
    return saved
