"""Adapter for the Hugging Face ``Trainer`` (optional: ``pip install prunekit[hf]``).

Example::

    from prunekit.training.hf import PruningTrainerCallback
    trainer = Trainer(model=model, args=args, train_dataset=ds,
                      callbacks=[PruningTrainerCallback({"prune_type": "snip_momentum", "pattern": "4x1",
                                                         "target_sparsity": 0.8, "end_step": 1000})])
    trainer.train()                                   # or trainer.train(resume_from_checkpoint=True)

When the ``Trainer`` is built (``on_init_end``) the callback attaches the
masks to the trainer's model. Every checkpoint (and ``trainer.save_model()``)
is then a plain Hugging Face folder: ``model.safetensors`` holds the
effective weights, which plain ``from_pretrained`` loads pruned, and
``prunekit_masks.safetensors`` beside it the masks (:mod:`prunekit.pretrained`;
``prunekit.load_pretrained(folder)`` gives the pruned model back). At
``on_train_begin`` it wires itself to the trainer's optimizer step hooks, so
every optimizer step (after gradient accumulation) is one pruning step; at
``on_train_end`` it unwires. ``callback.pruning`` is the
:class:`~prunekit.training.PruningCallbacks` object (for reports). The
trainer's model loads such a checkpoint's weights into its masked tensors
(``model.load_state_dict`` takes a dense ``weight`` into ``weight_orig``, as
:func:`prunekit.load_state_dict` does; :func:`prunekit.pretrained.accept_dense_weights`),
which is how the trainer resumes from it and loads the best model at the end
(``load_best_model_at_end``: the masks of the best checkpoint come back too).

Checkpoints and resuming: the callback is an ``ExportableState``. Each
checkpoint's ``trainer_state.json`` records the pruners' step, schedule
position and sparsity (the masks are in the checkpoint's masks file), and
gradient scores (SNIP-momentum's running sums) are written next to it as
``prunekit_pruning_scores.safetensors``. A run resumed from that checkpoint
restores all of it -- with or without ``restore_callback_states_from_checkpoint``
-- so it continues the schedule where it stopped and ends with the masks an
uninterrupted run gives. Pass the callback to the ``Trainer`` constructor
(``callbacks=[...]``): added later, it cannot attach the masks before the
checkpoint is loaded. The checkpoint is found as ``output_dir/checkpoint-<step>``
or at ``TrainingArguments(resume_from_checkpoint=...)``.

What a resume restores is checked first, as hostile input: the pruner state in
``trainer_state.json`` (types; step counts between 0 and the trainer's step;
a schedule position that agrees with the recorded sparsity; ratios in [0, 1]),
the scores (one finite tensor per pruned layer, of the layer's dtype and
shape) and the masks (:func:`prunekit.pretrained.read_masks`, and the loaded
weights zero wherever they prune). Anything wrong is a ``ValueError`` naming
the file, the field and the value, raised before anything changes: the model
and the optimizer are left as they were, the optimizer not wired.
"""

from __future__ import annotations

import logging
import math
import os
import weakref
from typing import Any, Dict, List, Mapping, Optional, Tuple

import torch

from .. import pretrained, reparam
from ..reparam._internal import Snapshot
from ..io.reader import SAFETENSORS_TAGS, open_regular, read_safetensors_header, read_safetensors_tensor
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
# what trainer_state.json keeps per pruner (Pruner.state_dict() without its tensors)
_INT_FIELDS = ("global_step", "local_step", "epoch", "scored_step")
_RATIO_FIELDS = ("current_sparsity_ratio", "initial_sparsity")
_PRUNER_FIELDS = frozenset(("prune_type",) + _INT_FIELDS + _RATIO_FIELDS)
# the pruning of each trainer's model, for a callback rebuilt by restore_callback_states_from_checkpoint
_PRUNING_OF: "weakref.WeakKeyDictionary[Any, PruningCallbacks]" = weakref.WeakKeyDictionary()


def _inner_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    # accelerate wraps the optimizer; its hooks must go on the real one
    seen = 0
    while not type(optimizer).__module__.startswith("torch.optim") and hasattr(optimizer, "optimizer") and seen < 5:
        optimizer = optimizer.optimizer
        seen += 1
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"the trainer's optimizer {optimizer!r} is not a torch.optim.Optimizer")
    return optimizer


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _last_update(scheduler: Any, global_step: int) -> Optional[int]:
    """The last step before ``global_step`` at which ``scheduler`` moves the masks (``None``: none yet)."""
    start, end = scheduler.start_step, scheduler.end_step
    hi = min(global_step - 1, end)
    if hi < start:
        return None
    if scheduler.is_update_step(hi):
        return hi
    freq = max(int(getattr(scheduler, "update_frequency_on_step", 1) or 1), 1)
    u = start + ((hi - start) // freq) * freq
    return u if scheduler.is_update_step(u) else None


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
        sparsity (JSON numbers; the masks live in the checkpoint's masks file, the scores in :data:`SCORES_FILE`)."""
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

        with atomic_path(os.path.join(folder, SCORES_FILE)) as tmp:
            save_file(tensors, tmp)

    @staticmethod
    def _load_scores(pruning: PruningCallbacks, folder: Optional[str]) -> Dict[int, Dict[str, torch.Tensor]]:
        """The scores file of ``folder``, checked against the pruners: ``{pruner index: {layer: scores}}``."""
        path = os.path.join(folder, SCORES_FILE) if folder is not None else None
        if path is None or not os.path.lexists(path):
            return {}
        out: Dict[int, Dict[str, torch.Tensor]] = {}
        with open_regular(path, what="scores file") as f:
            header = read_safetensors_header(f, path)
            for key, (tag, shape, _) in header.tensors.items():
                index, _, name = key.partition("/")
                if not index.isdigit() or int(index) >= len(pruning.pruners):
                    raise ValueError(f"{path}: tensor {key!r} names pruner {index!r}; this config builds "
                                     f"{len(pruning.pruners)} pruners (keys are '<pruner>/<layer>')")
                p = pruning.pruners[int(index)]
                module = p.modules.get(name)
                if module is None:
                    raise ValueError(f"{path}: tensor {key!r} names layer {name!r}, which pruners[{index}] does not "
                                     f"prune (it prunes {sorted(p.modules)[:5]})")
                w = reparam.stored_to_prune(module, p.weight_name)
                dtype = SAFETENSORS_TAGS.get(tag)
                if dtype != w.dtype or list(shape) != list(w.shape):
                    raise ValueError(f"{path}: tensor {key!r} is {tag} {shape}; the scores of {name!r} must be "
                                     f"{w.dtype} {list(w.shape)} (its weight's dtype and shape)")
                s = read_safetensors_tensor(f, header, key)
                if not bool(torch.isfinite(s).all()):
                    raise ValueError(f"{path}: tensor {key!r} holds non-finite scores (inf or NaN)")
                out.setdefault(int(index), {})[name] = s.to(w.device).clone()
        for i, own in out.items():
            p = pruning.pruners[i]
            missing = sorted(set(p.modules) - set(own))
            if missing and p.criterion.needs_grad:
                raise ValueError(f"{path}: no scores for layers {missing[:5]} of pruners[{i}] (the file holds "
                                 f"{len(own)} of its {len(p.modules)} layers)")
        return out

    def _saved_state(self, state: Any) -> Optional[Dict[str, Any]]:
        if isinstance(self._resumed_from, dict) and self._resumed_from.get("pruners"):
            return self._resumed_from
        saved = (getattr(state, "stateful_callbacks", None) or {}).get(type(self).__name__)
        if isinstance(saved, list):  # several of these callbacks: the one with our config
            saved = next((s for s in saved if isinstance(s, dict) and isinstance(s.get("args"), dict)
                          and s["args"].get("config") == self.config), None)
        if not isinstance(saved, dict):
            return None
        attributes = saved.get("attributes")
        found = attributes.get("_resumed_from") if isinstance(attributes, dict) else None
        if found is not None and not isinstance(found, dict):
            raise ValueError(f"trainer_state.json: stateful_callbacks.{type(self).__name__}.attributes._resumed_from "
                             f"is a {type(found).__name__}, not an object")
        return found if found and found.get("pruners") else None

    # ------------------------------------------------------------------ events
    def on_init_end(self, args, state, control, model=None, **kwargs):
        if model is not None and self.pruning is None:
            # masks on the model before any checkpoint is loaded into it
            self.pruning = prepare_pruning(model, self.config)
            _PRUNING_OF[model] = self.pruning
        if model is not None:
            pretrained.install_save_hooks()  # checkpoints: effective weights, masks beside them
            pretrained.accept_dense_weights(model)  # a resume loads those weights into weight_orig

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        """Attach (if not yet), restore a resumed run's pruner state, wire to the optimizer: all or nothing."""
        if model is None or optimizer is None:
            raise ValueError("PruningTrainerCallback needs the trainer's model and optimizer at on_train_begin")
        inner = _inner_optimizer(optimizer)
        created = self.pruning is None
        snapshots = []
        if created:
            adopted = _PRUNING_OF.get(model)
            if adopted is not None and adopted.config.to_dict() == self.config:
                self.pruning = adopted  # a callback rebuilt from the checkpoint: the masks are already there
                created = False
            else:
                snapshots = [Snapshot(m) for m in model.modules()]
        try:
            if self.pruning is None:
                self.pruning = prepare_pruning(model, self.config)
            pruning = self.pruning
            saved = self._saved_state(state) if state.global_step > 0 else None
            full = self._resume_state(pruning, saved, args, state, model) if saved is not None else None
            was_wired = pruning.wired
            before = (pruning.optimizer, [list(p.optimizers) for p in pruning.pruners])
            try:
                with pruning.transaction():
                    if full is not None:
                        pruning.load_state_dict(full)
                    if not was_wired:
                        pruning.wire(inner)
            except BaseException:
                if not was_wired:  # the optimizer exactly as before: no hooks of ours
                    for h in pruning._handles:
                        h.remove()
                    pruning._handles = []
                    pruning.optimizer = before[0]
                    for p, opts in zip(pruning.pruners, before[1]):
                        p.optimizers[:] = opts
                raise
        except BaseException:
            if created:
                for snap in reversed(snapshots):
                    snap.restore()
                self.pruning = None
            raise
        _PRUNING_OF[model] = self.pruning
        pretrained.install_save_hooks()
        pretrained.accept_dense_weights(model)  # also when the callback came after the trainer was built
        if full is not None and self.pruning.global_step != state.global_step:
            logger.warning("pruners resumed at step %d, the trainer at step %d (optimizer steps the pruners did "
                           "not see, e.g. skipped by a gradient scaler)", self.pruning.global_step,
                           state.global_step)
        self._resumed_from = None

    # ------------------------------------------------------------------ resuming
    @staticmethod
    def _folder(args: Any, state: Any) -> Tuple[Optional[str], str]:
        """The checkpoint folder being resumed (or ``None``), and where it was looked for."""
        candidates = []
        resume = getattr(args, "resume_from_checkpoint", None)
        if isinstance(resume, (str, os.PathLike)):
            candidates.append(os.fspath(resume))
        candidates.append(os.path.join(args.output_dir, f"checkpoint-{state.global_step}"))
        return next((c for c in candidates if os.path.isdir(c)), None), " or ".join(candidates)

    def _check_pruner_state(self, p: Any, i: int, s: Any, trainer_step: int) -> Dict[str, Any]:
        where = f"trainer_state.json: {type(self).__name__} pruners[{i}]"
        if not isinstance(s, dict):
            raise ValueError(f"{where} is a {type(s).__name__}, not an object")
        unknown = sorted(set(s) - _PRUNER_FIELDS)
        missing = sorted({"prune_type", "global_step", "current_sparsity_ratio"} - set(s))
        if unknown or missing:
            raise ValueError(f"{where}: unknown fields {unknown} / missing fields {missing}; it holds "
                             f"{sorted(_PRUNER_FIELDS)}")
        if s["prune_type"] != p.config.prune_type:
            raise ValueError(f"{where}.prune_type={s['prune_type']!r}, but this config's pruner is "
                             f"{p.config.prune_type!r}")
        for field in _INT_FIELDS:
            if field in s and not _is_int(s[field]):
                raise ValueError(f"{where}.{field}={s[field]!r} is not an integer")
        for field in _RATIO_FIELDS:
            v = s.get(field, 0.0)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not 0 <= v <= 1:
                raise ValueError(f"{where}.{field}={v!r} is not a ratio in [0, 1]")
        step = s["global_step"]
        if not 0 <= step <= trainer_step:
            raise ValueError(f"{where}.global_step={step} is outside [0, {trainer_step}] (the trainer's step): "
                             "the pruners count one step per optimizer step")
        for field in ("local_step", "epoch"):
            if s.get(field, 0) < 0:
                raise ValueError(f"{where}.{field}={s[field]} is negative")
        if not -1 <= s.get("scored_step", -1) <= step:
            raise ValueError(f"{where}.scored_step={s['scored_step']} is outside [-1, global_step={step}]")
        # the schedule position must agree with the sparsity it recorded
        initial = float(s.get("initial_sparsity", p.initial_sparsity))
        last = _last_update(p.scheduler, step) if p.adds_zeros and p.modules else None
        if last is None:
            expected = initial
        else:
            sched_initial = p.scheduler.initial_sparsity
            try:
                p.scheduler.initial_sparsity = min(initial, p.target_sparsity_ratio)
                expected = p.scheduler.sparsity(last)
            finally:
                p.scheduler.initial_sparsity = sched_initial
        if abs(expected - float(s["current_sparsity_ratio"])) > 1e-6:
            raise ValueError(f"{where}: global_step={step} puts the schedule ({p.scheduler.start_step}.."
                             f"{p.scheduler.end_step}) at sparsity {expected:.6f}, but current_sparsity_ratio="
                             f"{s['current_sparsity_ratio']!r} was recorded: the step count or the ratio was changed")
        return dict(s)

    def _resume_state(self, pruning: PruningCallbacks, saved: Mapping[str, Any], args: Any, state: Any,
                      model: Any) -> Dict[str, Any]:
        """Read and check everything a resume restores; returns it for ``PruningCallbacks.load_state_dict``."""
        pruners = pruning.pruners
        entries = saved.get("pruners")
        where = f"trainer_state.json: {type(self).__name__}"
        if not isinstance(entries, list) or len(entries) != len(pruners):
            raise ValueError(f"{where}.pruners holds {len(entries) if isinstance(entries, list) else entries!r} "
                             f"entries; this config builds {len(pruners)} pruners")
        local_step = saved.get("local_step", 0)
        if not _is_int(local_step) or local_step < 0:
            raise ValueError(f"{where}.local_step={local_step!r} is not a non-negative integer")
        trainer_step = int(state.global_step)
        checked = [self._check_pruner_state(p, i, s, trainer_step) for i, (p, s) in enumerate(zip(pruners, entries))]
        folder, where = self._folder(args, state)
        masks = self._load_masks(pruning, folder, where, model)
        scores = self._load_scores(pruning, folder)
        needs_scores = any(p.criterion.needs_grad and s["global_step"] <= p.end_step
                           for p, s in zip(pruners, checked))
        if needs_scores and not scores:
            logger.warning("resuming at step %d without %s in the checkpoint: gradient scores restart from zero",
                           state.global_step, SCORES_FILE)
        full: Dict[str, Any] = {"local_step": local_step, "pruners": []}
        for i, (p, s) in enumerate(zip(pruners, checked)):
            own_masks = {n: masks.get(f"{n}.{p.weight_name}", m) for n, m in p.masks.items()}
            full["pruners"].append(dict(s, masks=own_masks, scores=scores.get(i, {})))
        return full

    def _load_masks(self, pruning: PruningCallbacks, folder: Optional[str], where: str,
                    model: Any) -> Dict[str, torch.Tensor]:
        """The checkpoint's masks, checked against the weights the trainer loaded: ``{tensor path: mask}``."""
        owned = {f"{n}.{p.weight_name}" for p in pruning.pruners for n in p.modules}
        path = os.path.join(folder, pretrained.MASKS_FILE) if folder is not None else None
        if path is None or not os.path.lexists(path):
            dense = pretrained.dense_weights_loaded(model)
            if dense:
                raise ValueError(
                    f"the checkpoint's weights of {len(dense)} pruned tensors (e.g. {dense[0]!r}) are effective "
                    f"weights whose masks are in {pretrained.MASKS_FILE}, which is not in {where}; pass the "
                    "checkpoint folder as TrainingArguments(resume_from_checkpoint=...) too")
            return {}
        saved = pretrained.read_masks(folder, model)
        pretrained.check_weights(saved, path)
        out: Dict[str, torch.Tensor] = {}
        for s in saved:
            if s.path in owned:
                out[s.path] = s.mask
                continue
            current = reparam.get_mask(s.module, s.name)
            if current is None or not torch.equal(current.to(s.mask.dtype), s.mask):
                raise ValueError(f"{path}: {s.path} was pruned with another mask than the model has now, and no "
                                 "pruner of this config owns it; prune it the same way before building the Trainer")
        return out

    # ------------------------------------------------------------------ the rest of the run
    def on_save(self, args, state, control, **kwargs):
        self._save_scores(os.path.join(args.output_dir, f"checkpoint-{state.global_step}"))

    def on_epoch_begin(self, args, state, control, **kwargs):
        if self.pruning is not None:
            self.pruning.on_epoch_begin(int(state.epoch or 0))

    def on_epoch_end(self, args, state, control, **kwargs):
        if self.pruning is not None:
            self.pruning.on_epoch_end()

    def on_train_end(self, args, state, control, model=None, **kwargs):
        if self.pruning is not None:
            self.pruning.unwire()
            self.pruning.on_train_end()
        best = getattr(state, "best_model_checkpoint", None)
        if model is not None and getattr(args, "load_best_model_at_end", False) and best:
            # the trainer loaded the best checkpoint's weights; its masks are beside them
            pretrained.restore_masks(model, best)
