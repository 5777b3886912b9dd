"""Pruners: a criterion, a pattern and a schedule driving a group of layers.

The surface follows the one Intel Neural Compressor documented for its PyTorch
pruner -- ``register_pruners``, ``get_pruner(modules, config)``,
``Pruner(modules, config)`` and its callbacks -- built on prunekit's one mask
machinery: each layer's mask is its ``weight_mask`` buffer.

Order of events in one training step (what :class:`~prunekit.training.PruningCallbacks`
and the optimizer hooks call)::

    on_step_begin(local_step)
    loss.backward()
    on_before_optimizer_step()   # gradient criteria are scored here, before the weights move
                                 # (gradients are already zero at pruned entries, by the mask)
    optimizer.step()
    on_after_optimizer_step()    # nothing per step: pruned entries of name_orig are zero,
                                 # with zero gradient and zero optimizer state, so they stay zero
    on_step_end()                # at an update step the masks move to the scheduled sparsity;
                                 # global_step += 1

So after ``on_step_end`` of step ``end_step`` the layers are at the target
sparsity exactly. When a mask changes, the newly pruned entries of
``weight_orig`` are set to zero and the optimizer state at those entries
(momentum, Adam's moments, ...) is cleared: a pruned weight receives no
further update, even with weight decay. Masks only ever lose ones.

A pruner drives modules of one framework -- ``torch.nn`` or ``tensorplay.nn``
-- and does its tensor work in that framework through :mod:`prunekit._backend`;
the same weights and gradients give the same masks in both.
"""

from __future__ import annotations

import functools
import logging
import math
from contextlib import contextmanager
from typing import Any, Dict, Iterator, List, Mapping, Optional, Union

from torch import Tensor, nn

from .. import _sharded, methods, reparam
from .._backend import TORCH, Backend, FrameworkMismatchError, backend_of, is_module, is_tensor
from ..reparam._internal import Snapshot, orig_and_mask
from ._optim import clear_pruned_state_, fill_second_moments_, release_second_moments_
from ._undo import UndoLog, zero_where_
from .allocation import check_feasible, global_counts, local_counts
from .config import PrunerConfig, _as_config
from .criteria import Criterion, get_criterion
from ..kernels.patterns import Pattern, get_pattern, select_lowest
from .registry import PRUNERS, get_pruner_class, register_pruners
from .schedules import Scheduler, get_scheduler
from .selection import explain_empty_selection, require_modules, select_modules  # noqa: F401 (importable from here too)

__all__ = [
    "Pruner",
    "MagnitudePruner",
    "SnipPruner",
    "SnipMomentumPruner",
    "GradientPruner",
    "PatternLockPruner",
    "get_pruner",
    "register_pruners",
    "PRUNERS",
]

logger = logging.getLogger(__name__)


def _ensure_mask(module: nn.Module, name: str, init: Optional[Tensor] = None) -> Tensor:
    """The module's mask buffer for ``name``, created (all ones, or ``init``) by the mask module."""
    if reparam.is_masked(module, name):
        return orig_and_mask(module, name)[1]
    w = getattr(module, name)
    b = backend_of(w) or TORCH
    mask = b.ns.ones_like(w) if init is None else init.to(device=w.device, dtype=w.dtype)
    methods.apply_mask(module, name, mask)
    return orig_and_mask(module, name)[1]


class Pruner:
    """Base pruner: prunes ``modules`` (``{name: module}``) as ``config`` says.

    Attributes (the documented surface): ``modules``, ``config``, ``masks``
    (``{name: the module's weight_mask buffer}``), ``scores``, ``pattern``,
    ``scheduler``, ``current_sparsity_ratio`` (the scheduled sparsity of the
    last update), ``global_step``, ``start_step``, ``end_step``,
    ``update_frequency_on_step``, ``target_sparsity_ratio``,
    ``max_sparsity_ratio_per_layer`` (and ``min_sparsity_ratio_per_layer``).
    ``skipped`` maps each layer whose shape does not fit the pattern to the
    reason; those layers are left untouched.

    Subclasses set ``criterion_name`` (``"magnitude"``, ``"snip"``,
    ``"snip_momentum"``, ``"gradient"``) or override :meth:`layer_scores`.

    Examples:
        >>> import torch, torch.nn as nn
        >>> from prunekit.training import MagnitudePruner
        >>> _ = torch.manual_seed(0); fc = nn.Linear(8, 4)
        >>> p = MagnitudePruner({"fc": fc}, {"prune_type": "magnitude", "pattern": "1x1", "target_sparsity": 0.5})
        >>> p.on_step_begin(0); p.on_step_end()        # one-shot at step 0
        >>> int((fc.weight == 0).sum())
        16
    """

    criterion_name = "magnitude"
    weight_name = "weight"
    #: a pattern this pruner always uses, whatever the config says (None: the config's)
    fixed_pattern: Optional[str] = None
    #: False for a pruner that only keeps the zeros the layers already have: it has no
    #: target to check, its target is the initial sparsity, and it never updates masks
    adds_zeros: bool = True

    def __init__(self, modules: Union[Mapping[str, nn.Module], nn.Module], config: Union[PrunerConfig, Mapping[str, Any]]) -> None:
        self.config: PrunerConfig = _as_config(config)
        if is_module(modules):
            modules = require_modules(modules, self.config, self.weight_name)
        if not isinstance(modules, Mapping):
            raise TypeError(f"modules={modules!r}: pass a dict {{name: module}} or a model (nn.Module)")
        self._b: Backend = _modules_backend(modules, type(self).__name__)
        self.pattern: Pattern = get_pattern(self.fixed_pattern or self.config.pattern)
        self.skipped: Dict[str, str] = {}
        fitting: Dict[str, nn.Module] = {}
        for name, module in modules.items():
            if not is_module(module):
                raise TypeError(f"modules[{name!r}]={module!r} is not an nn.Module (torch.nn or tensorplay.nn)")
            w = reparam.stored(module, self.weight_name)
            if not is_tensor(w):
                raise ValueError(f"module {name!r} ({type(module).__name__}) has no tensor {self.weight_name!r} to prune")
            reason = self.pattern.check(tuple(w.shape))
            if reason is not None:
                self.skipped[name] = reason
                logger.warning("skipping %r (weight %s): pattern %r does not fit: %s", name, tuple(w.shape), self.pattern.name, reason)
                continue
            sharded = _sharded.handler_for(w)
            if sharded is not None:  # DTensor shards: their boundaries must fall between units
                sharded.check_pattern(self.pattern, name, module, w)
            fitting[name] = module
        self.modules: Dict[str, nn.Module] = fitting
        self.start_step = self.config.start_step
        self.end_step = self.config.end_step
        self.update_frequency_on_step = self.config.update_frequency_on_step
        if self.config.target_sparsity is None:  # PrunerConfig's checks set it; a later edit may not
            raise ValueError(f"{self.config.where}: target_sparsity is None; set a number in [0, 1], e.g. 0.9")
        self.target_sparsity_ratio = float(self.config.target_sparsity)
        self.max_sparsity_ratio_per_layer = self.config.max_sparsity_ratio_per_layer
        self.min_sparsity_ratio_per_layer = self.config.min_sparsity_ratio_per_layer
        self.global_step = 0
        self.local_step = 0
        self.epoch = 0
        self.optimizers: List[Any] = []
        self.criterion: Criterion = self.make_criterion()
        self._scored_step = -1
        self._undo: Optional[UndoLog] = None  # the open transaction (see _atomic)
        self._undo_joined: Optional[UndoLog] = None
        # optimizer state at pruned entries (see _optim): to be filled at the next step end / refill step
        self._state_pending = False
        self._state_due: Optional[int] = None
        self._state_filled = False
        # check that the target is reachable before touching any module
        initial = {n: self._initial_mask(n, m) for n, m in self.modules.items()}
        self._check_target(initial)
        snapshots = [Snapshot(m) for m in self.modules.values()]
        try:
            self.masks: Dict[str, Tensor] = {
                n: _ensure_mask(m, self.weight_name, initial[n]) for n, m in self.modules.items()
            }
            self.initial_sparsity = self._group_sparsity()
            self.current_sparsity_ratio = self.initial_sparsity
            if not self.adds_zeros:
                self.target_sparsity_ratio = self.initial_sparsity
            elif self.modules and self.initial_sparsity > self.target_sparsity_ratio + 1e-12:
                logger.warning(
                    "layers already at sparsity %.4f, above target_sparsity=%s; masks only lose ones, so they stay",
                    self.initial_sparsity, self.target_sparsity_ratio,
                )
            self.scheduler: Scheduler = get_scheduler(
                self.start_step, self.end_step, self.target_sparsity_ratio, self.config.sparsity_decay_type,
                self.update_frequency_on_step, initial_sparsity=min(self.initial_sparsity, self.target_sparsity_ratio),
            )
        except BaseException:  # KeyboardInterrupt too: a failed set-up leaves the modules as they were
            for snap in snapshots:
                snap.restore()
            raise

    # ------------------------------------------------------------------ transactions
    _SCALARS = ("global_step", "local_step", "epoch", "current_sparsity_ratio", "initial_sparsity", "_scored_step",
                "_state_pending", "_state_due", "_state_filled")

    @contextmanager
    def _atomic(self) -> Iterator[UndoLog]:
        """A transaction around a callback's changes: on any exception (``KeyboardInterrupt``
        included) the masks, weights, gradients, optimizer state and this pruner's own
        state are put back. Inside an outer transaction (several pruners driven by
        :class:`~prunekit.training.PruningCallbacks`) the outer one rolls back."""
        log = self._undo
        own = log is None
        grad_mode = self._b.is_grad_enabled()
        try:
            if log is None:  # own
                log = UndoLog()
                self._undo = log
            if self._undo_joined is not log:
                self._undo_joined = log
                saved = {k: getattr(self, k) for k in self._SCALARS}
                scores = dict(self.criterion.scores)
                sched_initial = self.scheduler.initial_sparsity

                def restore() -> None:
                    self.__dict__.update(saved)
                    self.criterion.scores.clear()
                    self.criterion.scores.update(scores)
                    self.scheduler.initial_sparsity = sched_initial

                log.add(restore)
            yield log
            if own:  # the commit: inside the try, so an interrupt on this line rolls back too
                self._undo = self._undo_joined = None
        except BaseException:
            if own:
                if log is not None:
                    log.rollback()
                self._undo = self._undo_joined = None
                # an interrupt between a `with no_grad()`'s __enter__ and its block skips __exit__
                self._b.ns.set_grad_enabled(grad_mode)
            raise

    # ------------------------------------------------------------------ set-up helpers
    def make_criterion(self) -> Criterion:
        """The criterion object; override to plug in a scoring of your own."""
        return get_criterion(self.criterion_name)

    @property
    def scores(self) -> Dict[str, Tensor]:
        """``{name: score tensor}`` as last computed by the criterion."""
        return self.criterion.scores

    def _initial_mask(self, name: str, module: nn.Module) -> Optional[Tensor]:
        """Mask to create for a module not yet reparametrized (None = all ones)."""
        return None

    def _unit_bounds(self, name: str, shape, pruned_units: int, ratio_scale: float):
        n = self.pattern.n_units(shape)
        hi = min(int(math.floor(self.max_sparsity_ratio_per_layer * n + 1e-9)), self.pattern.max_units(shape))
        lo = int(math.ceil(self.min_sparsity_ratio_per_layer * ratio_scale * n - 1e-9))
        hi = max(hi, pruned_units)
        lo = min(max(lo, pruned_units), hi)
        return lo, hi

    def _check_target(self, initial: Mapping[str, Optional[Tensor]]) -> None:
        if not self.modules or not self.adds_zeros:
            return
        names, numel, lo, hi, un = [], [], [], [], []
        for n, m in self.modules.items():
            shape = tuple(reparam.stored_to_prune(m, self.weight_name).shape)
            mask = reparam.get_mask(m, self.weight_name) if reparam.is_masked(m, self.weight_name) else initial.get(n)
            pruned = 0 if mask is None else self._pruned_units(n, m, mask)
            l, h = self._unit_bounds(n, shape, pruned, 1.0)
            names.append(n)
            numel.append(math.prod(shape))
            lo.append(l)
            hi.append(h)
            un.append(self.pattern.unit_numel(shape))
        budget = self._budget(self.target_sparsity_ratio, numel, un)
        try:
            check_feasible(budget, numel, lo, hi, un, names)
        except ValueError as e:
            raise ValueError(f"{self.config.where} ({type(self).__name__}): {e}") from None

    def _pruned_units(self, name: str, module: nn.Module, mask: Tensor) -> int:
        sharded = _sharded.handler_for(mask)
        if sharded is not None:  # DTensor shards: counted across ranks (prunekit.distributed)
            return sharded.count_pruned_units(self, name, module, mask)
        return int(self.pattern.unit_pruned(mask).sum())

    def _budget(self, sparsity: float, numel, unit_numel) -> int:
        total = sum(numel)
        if len(set(unit_numel)) == 1 and unit_numel:
            u = unit_numel[0]
            return int(round(sparsity * total / u)) * u
        return int(round(sparsity * total))

    def _group_sparsity(self) -> float:
        total = zeros = 0
        for n, m in self.modules.items():
            mask = self.masks[n]
            total += mask.numel()
            sharded = _sharded.handler_for(mask)
            zeros += int((mask == 0).sum()) if sharded is None else sharded.count_true(mask == 0)
        return zeros / total if total else 0.0

    def attach_optimizer(self, optimizer: Any) -> None:
        """Clear this optimizer's state at pruned entries whenever a mask changes.

        While attached, Adam-style second moments at pruned entries hold a tiny
        positive number instead of zero (the update there is zero either way; zeros
        make PyTorch's CPU ``sqrt`` slow): see :mod:`prunekit.training._optim`.
        :meth:`release_optimizer_state` puts the zeros back."""
        if optimizer not in self.optimizers:
            self.optimizers.append(optimizer)
        self._state_pending = True

    def release_optimizer_state(self) -> None:
        """Put back the plain zeros at pruned entries of Adam-style second moments (see
        :meth:`attach_optimizer`); the optimizer state is then exactly what clearing alone gives."""
        if not self.optimizers or not self._state_filled:
            return
        with self._atomic() as undo:
            for n, m in self.modules.items():
                release_second_moments_(self.optimizers, reparam.stored_to_prune(m, self.weight_name), self.masks[n], undo)
            self._state_pending = True
            self._state_due = None
            self._state_filled = False

    def _maintain_optimizer_state(self, step: int) -> None:
        """Fill the second moments of pruned entries the first time the optimizer has state for
        them, and again before the value decays too far (every :func:`~._optim.refill_period` steps)."""
        if not self.optimizers or not (self._state_pending or (self._state_due is not None and step >= self._state_due)):
            return
        with self._atomic() as undo:
            period: Optional[int] = None
            seen = False
            for n, m in self.modules.items():
                orig = reparam.stored_to_prune(m, self.weight_name)
                seen = seen or any(opt.state.get(orig) for opt in self.optimizers)
                p = fill_second_moments_(self.optimizers, orig, self.masks[n], undo)
                if p is not None:
                    period = p if period is None else min(period, p)
            self._state_due = None if period is None else step + period
            self._state_filled = self._state_filled or period is not None
            if seen:
                self._state_pending = False

    # ------------------------------------------------------------------ callbacks
    def on_train_begin(self, dataloader: Any = None) -> None:
        """Start of training: masks are already in place; weights are re-masked."""
        self.mask_weights()

    def on_epoch_begin(self, epoch: int) -> None:
        """Record the epoch number."""
        self.epoch = int(epoch)

    def on_step_begin(self, local_step: int) -> None:
        """Record the step within the epoch (``global_step`` counts optimizer steps)."""
        self.local_step = int(local_step)

    def on_before_optimizer_step(self) -> None:
        """Gradients are ready (and zero at pruned entries: ``weight = weight_orig * weight_mask``
        gives ``weight_orig.grad = dL/dweight * mask``); score gradient criteria."""
        if self._needs_scores_now(self.global_step):
            with self._atomic():
                self.update_scores()

    def on_after_optimizer_step(self) -> None:
        """Weights moved. Nothing to do per step: pruned entries of ``weight_orig`` were set to
        zero and their optimizer state cleared when the mask changed, and with a zero gradient
        they stay zero (weight decay of zero is zero). Call :meth:`mask_weights` to force it."""

    def on_step_end(self) -> None:
        """Update the masks when this is an update step, then advance ``global_step``."""
        step = self.global_step
        update = self.check_is_pruned_step(step)
        if update or self._state_pending or (self._state_due is not None and step >= self._state_due):
            with self._atomic():
                if update:
                    if self.criterion.needs_grad and self._scored_step != step:
                        logger.debug("step %d: on_before_optimizer_step was not called; scoring from current "
                                     "gradients", step)
                        self.update_scores()
                    self.update_masks(step)
                self._maintain_optimizer_state(step)
                self.global_step = step + 1
        else:
            self.global_step = step + 1

    def on_epoch_end(self) -> None:
        """End of an epoch (nothing to do by default)."""

    def on_train_end(self) -> None:
        """End of training: log the reached sparsity; the optimizer state at pruned entries is left as
        plain clearing leaves it (:meth:`release_optimizer_state`)."""
        self.release_optimizer_state()
        logger.info("%s: sparsity %.4f (target %.4f) after %d steps", type(self).__name__,
                    self._group_sparsity(), self.target_sparsity_ratio, self.global_step)

    def on_before_eval(self) -> None:
        """Before evaluation: make sure the weights are masked."""
        self.mask_weights()

    def on_after_eval(self) -> None:
        """After evaluation (nothing to do by default)."""

    #: the per-step callbacks whose base versions :meth:`idle_at` speaks for
    _STEP_CALLBACKS = ("on_step_begin", "on_before_optimizer_step", "on_after_optimizer_step", "on_step_end")

    def idle_at(self, step: int) -> bool:
        """True when the per-step callbacks have nothing to do at ``step`` but count it: not an
        update step, no scores to take, no optimizer state due (and the callbacks are the base
        class's: a subclass that overrides one is never idle). The optimizer hooks then skip
        the callbacks and only advance the step counters.

        Examples:
            >>> import torch
            >>> from prunekit.training import get_pruner
            >>> p = get_pruner({"0": torch.nn.Linear(4, 4)}, {"prune_type": "magnitude", "pattern": "1x1",
            ...                 "target_sparsity": 0.5, "start_step": 0, "end_step": 4, "update_frequency_on_step": 2})
            >>> [p.idle_at(s) for s in range(6)]
            [False, True, False, True, False, True]
        """
        cls = type(self)
        if not all(getattr(cls, c) is getattr(Pruner, c) for c in self._STEP_CALLBACKS):
            return False
        return not (self.check_is_pruned_step(step) or self._needs_scores_now(step) or self._state_pending
                    or (self._state_due is not None and step >= self._state_due))

    # ------------------------------------------------------------------ work
    def check_is_pruned_step(self, step: int) -> bool:
        """True when the masks are updated at ``step``."""
        return self.adds_zeros and bool(self.modules) and self.scheduler.is_update_step(step)

    def _needs_scores_now(self, step: int) -> bool:
        if not self.criterion.needs_grad or not self.modules:
            return False
        return self.check_is_pruned_step(step)

    def mask_weights(self) -> None:
        """Set ``weight_orig`` to zero wherever the mask is zero (in place, no grad; atomic)."""
        with self._atomic() as undo:
            for n, m in self.modules.items():
                zero_where_(reparam.stored_to_prune(m, self.weight_name), self.masks[n], undo)

    def update_scores(self) -> None:
        """Feed the criterion this step's weights and gradients (gradient criteria).

        ``weight_orig`` is passed as the weight: it equals ``weight_orig * weight_mask``
        wherever the mask is one, and where it is zero the gradient is zero too (the mask
        multiplies it), so every score is the same -- without a weight-sized product per
        layer and step (SNIP-momentum scores at every step)."""
        if not self.criterion.needs_grad:
            return
        with self._atomic(), self._b.no_grad():
            for n, m in self.modules.items():
                orig = reparam.stored_to_prune(m, self.weight_name)
                self.criterion.update(n, orig.detach(), orig.grad)
            self._scored_step = self.global_step

    def layer_scores(self, name: str, module: nn.Module) -> Tensor:
        """Importance of every weight of one layer (higher = keep)."""
        w = reparam.effective(module, self.weight_name)
        s = self.criterion.score(name, w)
        if s is None:
            logger.warning("%s: no gradient scores for %r yet; ranking it by magnitude this time",
                           type(self).__name__, name)
            s = w.abs().float()
        return s

    def update_masks(self, step: int) -> None:
        """Move every mask to the scheduled sparsity of ``step`` (masks only lose ones).

        Every layer's new mask is computed before any is written; the writes are
        recorded, so a failure (``KeyboardInterrupt`` included) leaves the masks,
        weights, gradients and optimizer state as they were. (Masks that are
        ``DTensor`` shards are decided across ranks by :mod:`prunekit.distributed`
        and are not rolled back: a rollback on one rank would leave the others apart.)"""
        with self._atomic():
            sharded = _sharded.handler_for(*self.masks.values())
            if sharded is not None:  # DTensor shards: the same decision, made across ranks
                sharded.update_pruner_masks(self, step)
                return
            self._update_masks(step)

    def _update_masks(self, step: int) -> None:
        sparsity = self.scheduler.sparsity(step)
        names = list(self.modules)
        shapes, unit_scores, numel, un, lo, hi = [], [], [], [], [], []
        scale = sparsity / self.target_sparsity_ratio if self.target_sparsity_ratio > 0 else 0.0
        b = self._b
        with b.no_grad():
            for n in names:
                m = self.modules[n]
                mask = self.masks[n]
                shape = tuple(mask.shape)
                already = self.pattern.unit_pruned(mask)
                u = self.pattern.ranking(self.pattern.unit_scores(self.layer_scores(n, m).to(mask.device)), already)
                l, h = self._unit_bounds(n, shape, int(already.sum()), min(scale, 1.0))
                shapes.append(shape)
                unit_scores.append(u)
                numel.append(mask.numel())
                un.append(self.pattern.unit_numel(shape))
                lo.append(l)
                hi.append(h)
            budget = self._budget(sparsity, numel, un)
            budget = max(budget, sum(l * u for l, u in zip(lo, un)))
            budget = min(budget, sum(h * u for h, u in zip(hi, un)))
            if self.config.prune_domain == "global":
                counts = global_counts(budget, unit_scores, un, lo, hi)
            else:
                counts = local_counts(budget, [self.pattern.n_units(s) for s in shapes], un, lo, hi)
            keeps = [self.pattern.expand(~select_lowest(u, k), shape) for shape, u, k in zip(shapes, unit_scores, counts)]
            for n, keep in zip(names, keeps):
                self._set_mask(n, keep)
        self.current_sparsity_ratio = sparsity
        if logger.isEnabledFor(logging.DEBUG):  # counting the zeros syncs with the device: only when logged
            logger.debug("%s step %d: scheduled sparsity %.4f, reached %.4f", type(self).__name__, step,
                         sparsity, self._group_sparsity())

    def _set_mask(self, name: str, keep: Tensor) -> None:
        module = self.modules[name]
        mask = self.masks[name]
        orig = reparam.stored_to_prune(module, self.weight_name)
        b = self._b
        if b.ns.equal(keep.to(b.bool), mask != 0):
            return
        undo = self._undo
        keep_f = keep.to(orig.dtype)
        with b.no_grad():
            if undo is not None:
                old = mask.clone()

                def restore() -> None:
                    with b.no_grad():
                        mask.copy_(old)

                undo.add(restore)
            mask.copy_(keep.to(mask.dtype))
            zero_where_(orig, keep_f, undo)
            if orig.grad is not None:
                zero_where_(orig.grad, keep_f, undo)
            period = clear_pruned_state_(self.optimizers, orig, keep_f, undo)
            if period is not None:
                self._state_filled = True
                if self._state_due is None:
                    self._state_due = self.global_step + period

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self) -> Dict[str, Any]:
        """Step, schedule position, scores and masks (tensors cloned)."""
        return {
            "prune_type": self.config.prune_type,
            "global_step": self.global_step,
            "local_step": self.local_step,
            "epoch": self.epoch,
            "current_sparsity_ratio": self.current_sparsity_ratio,
            "initial_sparsity": self.initial_sparsity,
            "scored_step": self._scored_step,
            "scores": {n: s.detach().clone() for n, s in self.scores.items()},
            "masks": {n: m.detach().clone() for n, m in self.masks.items()},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved; masks are copied into the module buffers."""
        missing = set(state.get("masks", {})) ^ set(self.masks)
        if missing:
            raise ValueError(
                f"{type(self).__name__}.load_state_dict: layers differ between the checkpoint and this pruner: "
                f"{sorted(missing)}"
            )
        for n, m in state["masks"].items():
            if tuple(m.shape) != tuple(self.masks[n].shape):
                raise ValueError(f"{type(self).__name__}.load_state_dict: mask of {n!r} has shape {tuple(m.shape)}, "
                                 f"expected {tuple(self.masks[n].shape)}")
        global_step = int(state["global_step"])
        current = float(state["current_sparsity_ratio"])
        with self._atomic() as undo:
            self.global_step = global_step
            self.local_step = int(state.get("local_step", 0))
            self.epoch = int(state.get("epoch", 0))
            self.current_sparsity_ratio = current
            self.initial_sparsity = float(state.get("initial_sparsity", self.initial_sparsity))
            self.scheduler.initial_sparsity = min(self.initial_sparsity, self.target_sparsity_ratio)
            self._scored_step = int(state.get("scored_step", -1))
            self.criterion.scores.clear()
            for n, s in state.get("scores", {}).items():
                self.criterion.scores[n] = s.detach().clone()
            b = self._b
            with b.no_grad():
                for n, m in state["masks"].items():
                    target = self.masks[n]
                    old = target.clone()
                    undo.add(functools.partial(_copy_no_grad, b, target, old))
                    target.copy_(m.to(device=target.device, dtype=target.dtype))
            self.mask_weights()
            self._state_pending = True

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(layers={len(self.modules)}, pattern={self.pattern.name!r}, "
                f"target={self.target_sparsity_ratio}, steps={self.start_step}..{self.end_step}, "
                f"scope={self.config.prune_domain!r})")


@register_pruners("magnitude")
class MagnitudePruner(Pruner):
    """Prunes the weights (blocks) of smallest ``|w|``."""

    criterion_name = "magnitude"


@register_pruners("snip")
class SnipPruner(Pruner):
    """Prunes the weights (blocks) of smallest ``|w * dL/dw|`` at each update step."""

    criterion_name = "snip"


@register_pruners("snip_momentum")
class SnipMomentumPruner(Pruner):
    """Prunes by ``|w * dL/dw|`` accumulated with momentum 0.9 at every optimizer step."""

    criterion_name = "snip_momentum"

    def _needs_scores_now(self, step: int) -> bool:
        # accumulate at every step up to the last update, not only at update steps
        return bool(self.modules) and step <= self.end_step


@register_pruners("gradient")
class GradientPruner(Pruner):
    """Prunes the weights (blocks) of smallest ``|dL/dw|``."""

    criterion_name = "gradient"


@register_pruners("pattern_lock")
class PatternLockPruner(Pruner):
    """Keeps the zeros a model already has, through training: no new pruning.

    Unpruned layers get the mask ``weight != 0``; layers that already carry a
    mask keep it. Pruned entries get no gradient and no optimizer update.
    The zeros may form any pattern, so every layer fits (``pattern`` is ``1x1``).
    """

    criterion_name = "magnitude"
    fixed_pattern = "1x1"
    adds_zeros = False

    def _initial_mask(self, name: str, module: nn.Module) -> Optional[Tensor]:
        w = reparam.stored_to_prune(module, self.weight_name)
        return (w != 0).to(w.dtype)


def _copy_no_grad(b: Backend, target: Tensor, value: Tensor) -> None:
    with b.no_grad():
        target.copy_(value)


def _modules_backend(modules: Mapping[str, Any], where: str) -> Backend:
    """The one framework of ``modules`` (torch when empty); mixing frameworks is an error."""
    found: Dict[str, str] = {}
    b0: Optional[Backend] = None
    for name, module in modules.items():
        b = backend_of(module) if is_module(module) else None
        if b is None:
            continue  # reported as "not an nn.Module" by the caller
        if b0 is None:
            b0 = b
        found.setdefault(b.name, name)
        if b is not b0:
            raise FrameworkMismatchError(
                f"{where}: modules {found[b0.name]!r} ({b0.name}) and {name!r} ({b.name}) are of different "
                f"frameworks; one pruner prunes modules of one framework -- build one pruner per framework"
            )
    return b0 or TORCH


def get_pruner(modules: Union[Mapping[str, nn.Module], nn.Module], config: Union[PrunerConfig, Mapping[str, Any]]) -> Pruner:
    """The registered pruner named by ``config``'s ``prune_type``, built on ``modules``.

    Examples:
        >>> import torch.nn as nn
        >>> from prunekit.training import get_pruner
        >>> get_pruner({"fc": nn.Linear(8, 4)}, {"prune_type": "snip", "pattern": "1x4"}).pattern
        NxMPattern('1x4')
    """
    cfg = _as_config(config)
    cls = get_pruner_class(cfg.prune_type)
    return cls(modules, cfg)


