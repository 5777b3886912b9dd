"""Recovery by knowledge distillation: a shrunk student trained to match its dense teacher.

:func:`distill` trains the student on unlabeled batches so that its outputs match the
teacher's -- logit KL for language models, hidden states or sentence embeddings for encoders
(:mod:`.distill_losses`) -- with one of two engines that compute the same steps:

* ``engine="trainer"`` -- a Hugging Face ``Trainer`` (:mod:`.distill_trainer`), so that
  ``accelerate launch`` or ``torchrun`` run the same script on many processes and GPUs: each
  process passes the same data and takes its share of the batches, the student is placed where
  ``accelerate`` says, checkpoints are ``Trainer``'s;
* ``engine="loop"`` -- a plain PyTorch loop on one device (:mod:`.distill_loop`), for models
  that are not ``transformers`` models or where ``transformers`` is not installed.

Both walk the batches in the same order (epochs of ``ceil(batches / accumulation)`` optimizer
steps), with the same optimizer, schedule, loss scaling, clipping and seeding
(:mod:`.distill_core`), so the same seed gives the same weights -- across processes up to the
order of floating-point sums. (A shuffling ``DataLoader`` is the exception: under ``Trainer``,
``accelerate`` draws its order from its own seeded sampler.) ``use_cache`` is off on both models while they train, as
``Trainer`` has it.

Interruptions. An exception or ``KeyboardInterrupt`` while training keeps the progress made,
as ``Trainer`` does: the student holds the weights of its last optimizer step (one interrupted
inside an optimizer step may be partly applied), and every checkpoint in ``output_dir`` is
whole -- written to a temporary folder and moved into place in one step -- so
``resume=True`` continues from the last one and ends with the weights of an uninterrupted run.
A failure before the first optimizer step of a run that does not resume leaves the student where
it was, with its weights; the teacher is never changed.
"""

from __future__ import annotations

import importlib.util
import logging
import math
import numbers
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional, Tuple, Union

import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader

from ..oneshot.blocks import to_device
from .distill_core import (LOOP_STATE, SCHEDULES, TRAINER_STATE, WHAT, Objective, Recorder, Settings, as_batch,
                           checkpoints, device_of, modes, probe, restore_modes)
from .distill_loop import run_loop
from .distill_losses import LOSSES, POOLINGS, DistillLoss

__all__ = ["DistillReport", "distill"]

logger = logging.getLogger(__name__)

ENGINES = ("auto", "trainer", "loop")


@dataclass(repr=False)
class DistillReport:
    """What one :func:`distill` call did.

    ``engine`` ran it, with the loss ``loss_name`` (e.g. ``"kl, temperature=1"``, or a function's name).
    ``steps`` optimizer steps ran in this call, from ``start_step`` (0, or the checkpoint it
    resumed from) towards ``total_steps``; ``losses`` holds each one's loss (the mean over its
    micro-batches and processes), ``initial_loss``/``final_loss`` the first and last of them
    (``None`` when no step ran). ``tokens`` counts the real tokens of the batches seen, ``seconds``
    the time spent training. ``checkpoint`` is the last checkpoint in ``output_dir``, if any.

    Examples:
        >>> DistillReport(engine="loop", loss_name="kl, temperature=1", start_step=0, total_steps=2,
        ...               losses=[2.5, 2.0], tokens=32, seconds=0.5)
        DistillReport(2 steps (0 -> 2 of 2), loss 2.5 -> 2, 32 tokens, 0.50 s, engine='loop', loss_name='kl, temperature=1')
    """

    engine: str
    loss_name: str
    start_step: int
    total_steps: int
    losses: List[float] = field(default_factory=list)
    tokens: int = 0
    seconds: float = 0.0
    checkpoint: Optional[str] = None
    steps: int = field(init=False)
    initial_loss: Optional[float] = field(init=False)
    final_loss: Optional[float] = field(init=False)

    def __post_init__(self) -> None:
        self.steps = len(self.losses)
        self.initial_loss = self.losses[0] if self.losses else None
        self.final_loss = self.losses[-1] if self.losses else None

    def __repr__(self) -> str:
        loss = f"loss {self.initial_loss:.5g} -> {self.final_loss:.5g}" if self.losses else "no step ran"
        saved = f", checkpoint={self.checkpoint!r}" if self.checkpoint else ""
        return (f"DistillReport({self.steps} steps ({self.start_step} -> {self.start_step + self.steps} of "
                f"{self.total_steps}), {loss}, {self.tokens} tokens, {self.seconds:.2f} s, engine={self.engine!r}, "
                f"loss_name={self.loss_name!r}{saved})")


# ----------------------------------------------------------------------------- checking the call
def _int(name: str, value: Any, low: int, hint: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{WHAT}: {name} must be an int, got {type(value).__name__} {value!r}; {hint}")
    if value < low:
        raise ValueError(f"{WHAT}: {name}={value!r} is below {low}; {hint}")
    return int(value)


def _real(name: str, value: Any, low: float, hint: str, strict: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{WHAT}: {name} must be a number, got {type(value).__name__} {value!r}; {hint}")
    v = float(value)
    if not math.isfinite(v) or v < low or (strict and v == low):
        raise ValueError(f"{WHAT}: {name}={value!r} is out of range; {hint}")
    return v


def _choice(name: str, value: Any, allowed: Tuple[str, ...]) -> str:
    if value not in allowed:
        raise ValueError(f"{WHAT}: {name}={value!r} is not known; write one of {', '.join(map(repr, allowed))}")
    return value


def _loss(loss: Any, temperature: Any, pooling: Any, intermediate: Any) -> Any:
    t = _real("temperature", temperature, 0.0, "write a temperature above 0 (1 = the plain softmax)", strict=True)
    pool = None if pooling is None else _choice("pooling", pooling, POOLINGS)
    inter = _real("intermediate", intermediate, 0.0, "write a weight >= 0 (0 = no intermediate-layer term)")
    if callable(loss) and not isinstance(loss, str):
        if inter:
            raise ValueError(f"{WHAT}: intermediate={intermediate!r} adds a term to the built-in losses; with "
                             "loss=function, compute that term inside the function (or write intermediate=0)")
        return loss
    if not isinstance(loss, str):
        raise TypeError(f"{WHAT}: loss must be a name or a function, got {type(loss).__name__} {loss!r}; write one "
                        f"of {', '.join(map(repr, LOSSES))} or a function loss(student_out, teacher_out, batch)")
    if loss not in LOSSES:
        raise ValueError(f"{WHAT}: loss={loss!r} is not known; write one of {', '.join(map(repr, LOSSES))} or pass a "
                         "function loss(student_out, teacher_out, batch) -> scalar tensor")
    return DistillLoss(loss, t, pool, inter, what=WHAT)


def _settings(steps: Any, epochs: Any, lr: Any, weight_decay: Any, warmup: Any, schedule: Any, max_grad_norm: Any,
              gradient_accumulation_steps: Any, seed: Any, device: Any, output_dir: Any, save_steps: Any,
              resume: Any, logging_steps: Any, callback: Any) -> Settings:
    if steps is not None:
        steps = _int("steps", steps, 1, "write the number of optimizer steps, or steps=None and epochs=...")
    epochs = 1.0 if epochs is None else _real("epochs", epochs, 0.0, "write a number of passes over the data above 0",
                                              strict=True)
    if isinstance(warmup, numbers.Integral) and not isinstance(warmup, bool):
        warmup = _int("warmup", warmup, 0, "write warmup steps (an int >= 0) or a fraction of the steps in [0, 1)")
    else:
        warmup = _real("warmup", warmup, 0.0, "write warmup steps (an int >= 0) or a fraction of the steps in [0, 1)")
        if warmup >= 1:
            raise ValueError(f"{WHAT}: warmup={warmup!r} is a fraction of the steps and must be below 1; write an int "
                             "for a number of steps")
    if device is not None:
        try:
            device = torch.device(device)
        except (RuntimeError, TypeError) as e:
            raise ValueError(f"{WHAT}: device={device!r} is not a device ({e}); write e.g. 'cpu' or 'cuda'") from e
    if output_dir is not None:
        if not isinstance(output_dir, (str, os.PathLike)):
            raise TypeError(f"{WHAT}: output_dir must be a folder path, got {type(output_dir).__name__}")
        output_dir = os.fspath(output_dir)
        if os.path.exists(output_dir) and not os.path.isdir(output_dir):
            raise ValueError(f"{WHAT}: output_dir={output_dir!r} is a file; write a folder for the checkpoints")
    if not isinstance(resume, bool):
        raise TypeError(f"{WHAT}: resume must be True or False, got {resume!r}")
    if resume and output_dir is None:
        raise ValueError(f"{WHAT}: resume=True continues from the last checkpoint in output_dir; give "
                         "output_dir=... (the folder of the interrupted run)")
    if callback is not None and not callable(callback):
        raise TypeError(f"{WHAT}: callback must be a function callback(step, loss), got {type(callback).__name__}")
    if not isinstance(seed, numbers.Integral) or isinstance(seed, bool):
        raise TypeError(f"{WHAT}: seed must be an int, got {type(seed).__name__} {seed!r}")
    return Settings(
        steps=steps, epochs=epochs,
        lr=_real("lr", lr, 0.0, "write a learning rate above 0, e.g. lr=5e-5", strict=True),
        weight_decay=_real("weight_decay", weight_decay, 0.0, "write a weight decay >= 0"),
        warmup=warmup, schedule=_choice("schedule", schedule, SCHEDULES),
        max_grad_norm=_real("max_grad_norm", 0.0 if max_grad_norm is None else max_grad_norm, 0.0,
                            "write a gradient norm above 0 to clip at, or 0 / None for no clipping"),
        gradient_accumulation_steps=_int("gradient_accumulation_steps", gradient_accumulation_steps, 1,
                                         "write the number of batches per optimizer step (1 = no accumulation)"),
        seed=int(seed), device=device, output_dir=output_dir,
        save_steps=_int("save_steps", save_steps, 1, "write how many optimizer steps between checkpoints"),
        resume=resume,
        logging_steps=_int("logging_steps", logging_steps, 0, "write how many steps between log lines (0: none)"),
        callback=callback)


def _storage(p: Tensor) -> Optional[Tuple[Any, int]]:
    """Where a parameter's memory is (``None`` when it has none to share: empty, meta, or not a plain tensor)."""
    try:
        ptr = p.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError, TypeError):
        return None
    return (p.device, ptr) if ptr and p.numel() else None


def _models(student: Any, teacher: Any) -> None:
    for name, m in (("student", student), ("teacher", teacher)):
        if not isinstance(m, nn.Module):
            raise TypeError(f"{WHAT}: the {name} must be a torch.nn.Module, got {type(m).__name__}")
    if student is teacher:
        raise ValueError(f"{WHAT}: the student is the teacher itself; training it would change the teacher: pass "
                         "a shrunk copy as the student (copy.deepcopy(teacher) before shrinking)")
    teacher_storage = {_storage(p) for p in teacher.parameters()} - {None}
    trainable = False
    for name, p in student.named_parameters():
        if _storage(p) in teacher_storage:
            raise ValueError(f"{WHAT}: the student's parameter {name!r} shares its memory with a teacher parameter; "
                             "training would change the teacher: pass a copy (copy.deepcopy(teacher) before shrinking)")
        trainable = trainable or p.requires_grad
    if not trainable:
        raise ValueError(f"{WHAT}: the student ({type(student).__name__}) has no parameter with requires_grad=True; "
                         "there is nothing to train")


def _data(data: Any, settings: Settings, dicts: bool) -> Tuple[Any, Any, Optional[int]]:
    """``(batches, first batch, batches per epoch or None)``: a list of batches or the ``DataLoader``."""
    if isinstance(data, (Tensor, dict, str, bytes)) or hasattr(data, "keys"):
        raise TypeError(f"{WHAT}: data is a single {type(data).__name__}; pass a list of batches (e.g. [batch]) or "
                        "a DataLoader")
    batches: Any  # the DataLoader, or the list of batches
    if isinstance(data, DataLoader):
        try:
            n: Optional[int] = len(data)
        except TypeError:
            n = None
        if n is None and settings.steps is None:
            raise ValueError(f"{WHAT}: the DataLoader has no length (an IterableDataset), so epochs cannot be counted; "
                             "give steps=... (optimizer steps)")
        first = next(iter(data), None) if n != 0 else None
        if first is None:
            raise ValueError(f"{WHAT}: the DataLoader gives no batch; distillation needs at least one")
        batches, first = data, as_batch(first)
    else:
        try:
            batches = [as_batch(b) for b in data]
        except TypeError as e:
            raise TypeError(f"{WHAT}: data must be a list (or iterable) of batches or a DataLoader, got "
                            f"{type(data).__name__}") from e
        if not batches:
            raise ValueError(f"{WHAT}: data holds no batch; pass at least one, e.g. [{{'input_ids': ..., "
                             "'attention_mask': ...}]")
        for i, b in enumerate(batches):
            if not isinstance(b, (dict, tuple, list, Tensor)):
                raise TypeError(f"{WHAT}: data[{i}] is a {type(b).__name__}; a batch is a dict (model(**batch)), a "
                                "tuple (model(*batch)) or a tensor (model(batch))")
        first, n = batches[0], len(batches)
    if dicts and not isinstance(first, dict):
        raise ValueError(f"{WHAT}: intermediate > 0 asks the models for output_hidden_states=True, which needs dict "
                         f"batches (keyword inputs); the first batch is a {type(first).__name__}")
    return batches, first, n


def _installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # blocked (sys.modules[name] is None) or broken
        return False


def _engine(engine: Any, student: nn.Module, settings: Settings) -> str:
    engine = _choice("engine", engine, ENGINES)
    tf = sys.modules.get("transformers")
    if engine == "auto":
        pretrained = tf is not None and isinstance(student, tf.PreTrainedModel)
        engine = "trainer" if pretrained else "loop"
    if engine == "trainer":
        if tf is None and not _installed("transformers"):
            raise ImportError(f"{WHAT}: engine='trainer' needs transformers (pip install 'prunekit[hf]'); write "
                              "engine='loop' to train without it")
        dev = settings.device
        if dev is not None and (dev.type not in ("cpu", "cuda") or dev.index is not None):
            raise ValueError(f"{WHAT}: engine='trainer' puts each process on the device accelerate gives it; device may "
                             f"be None, 'cpu' or 'cuda', not {str(dev)!r} (choose GPUs with CUDA_VISIBLE_DEVICES, or "
                             "write engine='loop')")
    return engine


def _start(settings: Settings, engine: str) -> Optional[str]:
    """The checkpoint to resume from, or ``None`` to start at step 0."""
    found = checkpoints(settings.output_dir)
    if not settings.resume:
        if found:
            raise ValueError(f"{WHAT}: output_dir={settings.output_dir!r} already holds {os.path.basename(found[-1][1])} "
                             "of an earlier run; write resume=True to continue it, or choose an empty folder")
        return None
    if not found:
        logger.info("%s: no checkpoint in %s; starting at step 0", WHAT, settings.output_dir)
        return None
    path = found[-1][1]
    mine, other = (LOOP_STATE, TRAINER_STATE) if engine == "loop" else (TRAINER_STATE, LOOP_STATE)
    if not os.path.exists(os.path.join(path, mine)):
        if os.path.exists(os.path.join(path, other)):
            writer = "trainer" if engine == "loop" else "loop"
            raise ValueError(f"{WHAT}: {path} was written by engine={writer!r}; resume it with engine={writer!r}")
        raise ValueError(f"{WHAT}: {path} has no {mine}; it is not a checkpoint of prunekit.distill (move it away "
                         "to resume from the one before it)")
    logger.info("%s: resuming from %s", WHAT, path)
    return path


_ABSENT = object()


def _caches_off(*models: nn.Module) -> List[Tuple[Any, Any]]:
    """Turn off the key/value cache of Hugging Face models for training (``Trainer`` sets ``use_cache=False``
    on its model's config); ``(config, value before or _ABSENT)`` to put back with :func:`_put_back_caches`."""
    saved = []
    for m in models:
        config = getattr(m, "config", None)
        if config is not None and hasattr(config, "to_dict"):
            saved.append((config, config.__dict__.get("use_cache", _ABSENT)))
            if getattr(config, "use_cache", None) is not None:
                config.use_cache = False
    return saved


def _put_back_caches(saved: List[Tuple[Any, Any]]) -> None:
    for config, value in saved:
        if value is _ABSENT:
            config.__dict__.pop("use_cache", None)
        else:
            config.use_cache = value


def _describe(loss: Any) -> str:
    if isinstance(loss, DistillLoss):
        return loss.name
    return getattr(loss, "__qualname__", None) or type(loss).__name__


def distill(
    student: nn.Module,
    teacher: nn.Module,
    data: Any,
    *,
    loss: Union[str, Callable[[Any, Any, Any], Tensor]] = "auto",
    temperature: float = 1.0,
    pooling: Optional[str] = None,
    intermediate: float = 0.0,
    steps: Optional[int] = None,
    epochs: Optional[float] = None,
    lr: float = 5e-5,
    weight_decay: float = 0.0,
    warmup: Union[int, float] = 0,
    schedule: str = "linear",
    max_grad_norm: Optional[float] = 1.0,
    gradient_accumulation_steps: int = 1,
    seed: int = 0,
    device: Any = None,
    engine: str = "auto",
    output_dir: Optional[Union[str, "os.PathLike[str]"]] = None,
    save_steps: int = 500,
    resume: bool = False,
    logging_steps: int = 10,
    callback: Optional[Callable[[int, float], Any]] = None,
) -> DistillReport:
    """Train ``student`` in place to match ``teacher`` on unlabeled ``data``; what it did as a :class:`DistillReport`.

    ``data``: a list (any iterable is read into one) or a ``DataLoader`` of batches -- dicts of
    keyword inputs (``input_ids``, ``attention_mask``, ...), tuples of positional inputs or
    tensors -- used in their order; no labels. ``loss``: ``"kl"`` (``temperature**2 * KL`` of the
    softened ``.logits`` over the real tokens of the batch's ``attention_mask``), ``"mse"`` or
    ``"cosine"`` between hidden states as ``pooling`` says (``"tokens"``, the default: each real
    token's ``last_hidden_state``; ``"mean"``: those mean-pooled, the sentence embedding of models
    such as MiniLM; ``"cls"``; ``"pooler"``: ``pooler_output``), ``"auto"`` (``"kl"`` when both
    models give logits, else ``"cosine"`` of mean-pooled states), or a function
    ``loss(student_out, teacher_out, batch) -> scalar tensor``;
    ``intermediate > 0`` adds that weight times the MSE of hidden states at the same relative
    depth (same hidden size needed). The loss is checked on the first batch before anything
    trains.

    Training: AdamW (``lr``, ``weight_decay``; none on biases and norms), ``warmup`` steps (or
    a fraction below 1) from 0, then the ``schedule`` (``"linear"`` to 0, ``"constant"``,
    ``"cosine"``); gradients clipped at ``max_grad_norm`` (0/``None``: not) and accumulated
    over ``gradient_accumulation_steps`` batches; ``steps`` optimizer steps, or ``epochs`` passes
    (default 1); ``seed`` seeds Python, NumPy and torch. ``engine``: ``"trainer"`` (Hugging Face
    ``Trainer``: ``accelerate launch`` / ``torchrun`` run it on many processes; ``device`` None,
    ``"cpu"`` or ``"cuda"``), ``"loop"`` (plain PyTorch on ``device``, default the student's),
    ``"auto"`` (the trainer for a ``transformers`` model, else the loop); the same seed gives
    both the same weights. ``output_dir``: a checkpoint every ``save_steps`` steps and at the
    end, each written atomically; ``resume=True`` continues from the last one (or starts at 0
    when there is none) and ends where an uninterrupted run ends. ``callback(step, loss)`` gets
    every step's loss; the log every ``logging_steps`` steps (main process only).

    The teacher runs in eval mode under ``no_grad`` and is never changed; both models get back
    their modes, devices (the student stays on the training device) and ``use_cache``. Bad
    options, empty data or outputs the loss cannot compare raise ``ValueError``/``TypeError``
    before anything changes; an exception or ``KeyboardInterrupt`` while training keeps the
    progress made, as ``Trainer`` does (see the module's notes).

    Examples:
        >>> import torch, transformers
        >>> from prunekit.shrink import distill
        >>> def llama(layers):
        ...     torch.manual_seed(0)
        ...     return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        ...         vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=layers,
        ...         num_attention_heads=2)).eval()
        >>> teacher, student = llama(2), llama(1)
        >>> g = torch.Generator().manual_seed(0)
        >>> data = [{"input_ids": torch.randint(0, 32, (2, 8), generator=g),
        ...          "attention_mask": torch.ones(2, 8, dtype=torch.long)} for _ in range(2)]
        >>> report = distill(student, teacher, data, steps=4, lr=1e-2, engine="loop")
        >>> report.steps, report.final_loss < report.initial_loss, report.tokens
        (4, True, 64)
    """
    _models(student, teacher)
    loss_fn = _loss(loss, temperature, pooling, intermediate)
    settings = _settings(steps, epochs, lr, weight_decay, warmup, schedule, max_grad_norm, gradient_accumulation_steps,
                         seed, device, output_dir, save_steps, resume, logging_steps, callback)
    hidden = isinstance(loss_fn, DistillLoss) and loss_fn.needs_hidden_states
    batches, first, n = _data(data, settings, hidden)
    engine = _engine(engine, student, settings)
    start = _start(settings, engine)
    return _train(student, teacher, Objective(teacher, loss_fn, hidden), settings, batches, first, n, engine, start)


def _train(student: nn.Module, teacher: nn.Module, objective: Objective, settings: Settings, batches: Any, first: Any,
           n: Optional[int], engine: str, start: Optional[str]) -> DistillReport:
    """Run the engine; put back what the run must not keep (the teacher's device, modes, caches)."""
    if settings.output_dir is not None:
        os.makedirs(settings.output_dir, exist_ok=True)
    total = settings.total_steps(n) if engine == "loop" else 0
    recorder = Recorder(settings, total, 0)
    loss_fn = objective.loss
    teacher_modes, teacher_device = modes(teacher), device_of(teacher)
    student_modes, student_device = modes(student), device_of(student)
    moved: List[bool] = []

    def ready(dev: Optional[torch.device]) -> None:
        """Place the teacher on ``dev`` (unless it is spread over devices) and check the loss on ``first``."""
        if dev is not None and teacher_device is not None and teacher_device != dev and \
                getattr(teacher, "hf_device_map", None) is None:
            moved.append(True)
            teacher.to(dev)
        target = device_of(student)
        objective.loss = probe(student, objective, first if target is None else to_device(first, target), loss_fn)

    teacher.eval()
    caches = _caches_off(student, teacher)
    try:
        if engine == "loop":
            if settings.device is not None:
                student.to(settings.device)
            ready(settings.device)
            checkpoint = run_loop(student, objective, batches, settings, recorder, total, start, device_of(student))
        else:
            from .distill_trainer import run_trainer

            checkpoint = run_trainer(student, objective, batches, settings, recorder, start, ready)
    except BaseException:
        if objective.calls:
            student.zero_grad(set_to_none=True)  # no gradients of a cut-off step left behind
        if not recorder.losses and start is None and student_device is not None and device_of(student) != student_device:
            student.to(student_device)  # nothing trained: the student goes back where it was
        raise
    finally:
        _put_back_caches(caches)
        if moved:
            teacher.to(teacher_device)
        restore_modes(teacher_modes)
        restore_modes(student_modes)
    return DistillReport(engine=engine, loss_name=_describe(objective.loss), start_step=recorder.start_step,
                         total_steps=recorder.total, losses=list(recorder.losses), tokens=recorder.tokens,
                         seconds=recorder.seconds, checkpoint=checkpoint)
