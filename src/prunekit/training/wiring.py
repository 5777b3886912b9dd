"""One call to prune a model while it trains: :func:`prepare_pruning`.

The shape is torchao's ``quantize_(model, config)``: a config plus one verb
that walks the model. It returns a :class:`PruningCallbacks` object with the
pruner callbacks for any hand-written loop; given an optimizer it also wires
itself to the optimizer's step hooks (``register_step_pre_hook`` /
``register_step_post_hook`` -- no monkey-patching), so the loop needs no
change at all. ``unwire()`` removes the hooks.

TensorPlay models work the same way: pass a ``tensorplay.nn`` model and a
``tensorplay.optim`` optimizer (its step hooks and ``optimizer.state`` layout
match PyTorch's); masks, scores and optimizer state stay TensorPlay tensors.
Mixing frameworks (a TensorPlay model with a torch optimizer) raises
:class:`~prunekit.FrameworkMismatchError` before the model is touched.

Example (the whole change to a training loop)::

    import prunekit
    pruning = prunekit.prepare_pruning(model, {"prune_type": "snip_momentum", "pattern": "1x1",
                                               "target_sparsity": 0.9, "end_step": 1000}, optimizer)
    for x, y in loader:                   # unchanged loop: each optimizer.step() is a pruning step
        optimizer.zero_grad(); loss_fn(model(x), y).backward(); optimizer.step()
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from typing import Any, Dict, Iterator, List, Mapping, Optional

from torch import nn

from .._backend import TORCH, FrameworkMismatchError, backend_of, is_module, optimizer_backend
from ..reparam._internal import Snapshot
from ._undo import UndoLog
from .config import PruningConfig, load_config
from .pruners import Pruner, get_pruner
from .registry import did_you_mean
from .report import SparsityReport, sparsity_report
from .selection import require_modules

__all__ = ["EVENTS", "PruningCallbacks", "prepare_pruning"]

logger = logging.getLogger(__name__)


#: the events a :class:`PruningCallbacks` (and every :class:`Pruner`) answers, in the order of a run
EVENTS = (
    "on_train_begin",
    "on_epoch_begin",
    "on_step_begin",
    "on_before_optimizer_step",
    "on_after_optimizer_step",
    "on_step_end",
    "on_epoch_end",
    "on_train_end",
    "on_before_eval",
    "on_after_eval",
    "mask_weights",
)


class PruningCallbacks:
    """Several pruners driven together: every event goes to each of them through :meth:`call_event`.

    Built by :func:`prepare_pruning`. ``pruners`` holds one :class:`Pruner`
    per entry of the config. Each event is one transaction over all the
    pruners: if any pruner fails (``KeyboardInterrupt`` included), every
    pruner's masks, weights, gradients and optimizer state are put back.

    Examples:
        >>> import torch, torch.nn as nn
        >>> from prunekit.training import prepare_pruning
        >>> model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))
        >>> pruning = prepare_pruning(model, {"prune_type": "magnitude", "pattern": "1x1",
        ...                                   "target_sparsity": 0.5, "end_step": 0})
        >>> pruning.call_event("on_step_begin", 0); pruning.call_event("on_step_end")
        >>> int((model[0].weight == 0).sum() + (model[1].weight == 0).sum())
        48
    """

    def __init__(self, model: nn.Module, pruners: List[Pruner], config: PruningConfig) -> None:
        self.model = model
        self.pruners = pruners
        self.config = config
        self._handles: List[Any] = []
        self._local_step = 0
        self.optimizer: Optional[Any] = None

    # ---------------------------------------------------------------- dispatch
    @contextmanager
    def transaction(self) -> Iterator[None]:
        """One transaction over every pruner: the events and calls inside it change all or nothing.

        On any exception (``KeyboardInterrupt`` included) every pruner's masks,
        weights, gradients, optimizer state and own state are put back; nested
        transactions join the outermost one. Each event already is one; use this to
        make several calls one.

        Examples:
            >>> import torch.nn as nn
            >>> from prunekit.training import prepare_pruning
            >>> model = nn.Sequential(nn.Linear(8, 8))
            >>> pruning = prepare_pruning(model, {"prune_type": "magnitude", "pattern": "1x1",
            ...                                   "target_sparsity": 0.5})
            >>> with pruning.transaction():
            ...     pruning.on_step_begin(0); pruning.on_step_end()
            >>> int((model[0].weight == 0).sum())
            32
        """
        if any(p._undo is not None for p in self.pruners):
            yield  # an outer transaction is open
            return
        log = UndoLog()
        grad_mode = self.pruners[0]._b.is_grad_enabled() if self.pruners else True
        local_step = self._local_step
        try:
            for p in self.pruners:
                p._undo = log
            yield
            # the commit: still inside the try, so an interrupt on these lines rolls back too
            for p in self.pruners:
                p._undo = p._undo_joined = None
        except BaseException:
            log.rollback()
            self._local_step = local_step
            for p in self.pruners:
                p._undo = p._undo_joined = None
            if self.pruners:
                self.pruners[0]._b.ns.set_grad_enabled(grad_mode)
            raise

    def call_event(self, event: str, *args: Any) -> None:
        """Pass ``event`` (one of :data:`EVENTS`) with ``args`` to every pruner, as one transaction.

        ``on_step_begin`` without an argument gets the step counted within the
        epoch (reset by ``on_epoch_begin``, advanced by ``on_step_end``).
        """
        if event not in EVENTS:
            raise ValueError(f"event={event!r} is not a pruning event; use one of {list(EVENTS)}."
                             + did_you_mean(event, EVENTS))
        if event == "on_step_begin" and not args:
            args = (self._local_step,)
        with self.transaction():
            for p in self.pruners:
                getattr(p, event)(*args)
            if event == "on_epoch_begin":
                self._local_step = 0
            elif event == "on_step_end":
                self._local_step += 1

    # ---------------------------------------------------------------- callbacks (each one event)
    def on_train_begin(self, dataloader: Any = None) -> None:
        """Start of training: the pruners re-mask the weights."""
        self.call_event("on_train_begin", dataloader)

    def on_epoch_begin(self, epoch: int) -> None:
        """Start of an epoch (the step counter within the epoch restarts at 0)."""
        self.call_event("on_epoch_begin", epoch)

    def on_step_begin(self, local_step: Optional[int] = None) -> None:
        """Start of a step (``local_step`` defaults to the step counted within the epoch)."""
        self.call_event("on_step_begin", *(() if local_step is None else (local_step,)))

    def on_before_optimizer_step(self) -> None:
        """Gradients are ready: gradient criteria score them."""
        self.call_event("on_before_optimizer_step")

    def on_after_optimizer_step(self) -> None:
        """The weights moved (nothing to do per step)."""
        self.call_event("on_after_optimizer_step")

    def on_step_end(self) -> None:
        """End of a step: masks move at update steps."""
        self.call_event("on_step_end")

    def on_epoch_end(self) -> None:
        """End of an epoch."""
        self.call_event("on_epoch_end")

    def on_train_end(self) -> None:
        """End of training: each pruner logs the sparsity it reached."""
        self.call_event("on_train_end")

    def on_before_eval(self) -> None:
        """Before evaluation: the weights are re-masked."""
        self.call_event("on_before_eval")

    def on_after_eval(self) -> None:
        """After evaluation."""
        self.call_event("on_after_eval")

    def mask_weights(self) -> None:
        """Zero every pruned entry of the weights."""
        self.call_event("mask_weights")

    def step(self) -> None:
        """The pruning part of one step, for a loop whose optimizer is not wired.

        Call it right after ``optimizer.step()``, while the gradients are still
        there: it runs ``on_before_optimizer_step``, ``on_after_optimizer_step``
        and ``on_step_end`` (as one transaction). (Gradient criteria then score the
        weights after the update; call the callbacks around ``optimizer.step()``
        yourself to score them before.) A wired optimizer does all this by itself
        -- do not call it then.
        """
        with self.transaction():
            self.on_before_optimizer_step()
            self.on_after_optimizer_step()
            self.on_step_end()

    # ---------------------------------------------------------------- wiring
    @property
    def wired(self) -> bool:
        return bool(self._handles)

    def attach_optimizer(self, optimizer: Any) -> None:
        """Clear ``optimizer``'s state at pruned entries when masks change (no hooks).

        ``optimizer`` is a ``torch.optim.Optimizer`` for a PyTorch model, a
        ``tensorplay.optim.Optimizer`` for a TensorPlay model.
        """
        _check_optimizer(self.model, optimizer)
        self.optimizer = optimizer
        for p in self.pruners:
            p.attach_optimizer(optimizer)

    def wire(self, optimizer: Any) -> "PruningCallbacks":
        """Drive the pruners from ``optimizer``'s step hooks; every ``optimizer.step()`` is one step."""
        if self.wired:
            raise ValueError("this PruningCallbacks is already wired to an optimizer; call unwire() first")
        self.attach_optimizer(optimizer)

        def pre(opt, args, kwargs):
            if self._idle():  # what on_step_begin records; on_before_optimizer_step has nothing to do
                self._count_step(advance=False)
                return
            self.on_step_begin()
            self.on_before_optimizer_step()

        def post(opt, args, kwargs):
            if self._idle():  # on_after_optimizer_step has nothing to do; on_step_end counts the step
                self._count_step(advance=True)
                return
            self.on_after_optimizer_step()
            self.on_step_end()

        # one at a time: an interrupt between the two leaves the first where unwire() finds it
        self._handles.append(optimizer.register_step_pre_hook(pre))
        self._handles.append(optimizer.register_step_post_hook(post))
        return self

    def _idle(self) -> bool:
        """Every pruner is idle at its current step (see :meth:`Pruner.idle_at`)."""
        return all(p.idle_at(p.global_step) for p in self.pruners)

    def _count_step(self, advance: bool) -> None:
        """The whole effect of an idle step's callbacks, all or nothing: ``local_step`` recorded
        (``on_step_begin``), or both step counters advanced (``on_step_end``). It skips the four
        transactions of the callbacks, a few percent of a small model's training step."""
        local = self._local_step
        saved = [(p.local_step, p.global_step) for p in self.pruners]
        try:
            for p in self.pruners:
                if advance:
                    p.global_step += 1
                else:
                    p.local_step = local
            if advance:
                self._local_step = local + 1
        except BaseException:
            for p, (ls, gs) in zip(self.pruners, saved):
                p.local_step, p.global_step = ls, gs
            self._local_step = local
            raise

    def unwire(self) -> None:
        """Remove the optimizer hooks (masks stay in the model); the optimizer state at pruned
        entries is left exactly as clearing it leaves it (see :meth:`Pruner.release_optimizer_state`)."""
        with self.transaction():
            for p in self.pruners:
                p.release_optimizer_state()
        for h in self._handles:
            h.remove()
        self._handles = []

    # ---------------------------------------------------------------- state and reports
    @property
    def global_step(self) -> int:
        return self.pruners[0].global_step if self.pruners else 0

    def state_dict(self) -> Dict[str, Any]:
        """Every pruner's state (step, schedule position, scores, masks)."""
        return {"pruners": [p.state_dict() for p in self.pruners], "local_step": self._local_step}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved (all pruners or none: a failure changes nothing)."""
        saved = state.get("pruners", [])
        if len(saved) != len(self.pruners):
            raise ValueError(f"checkpoint holds {len(saved)} pruners, this config builds {len(self.pruners)}")
        local_step = int(state.get("local_step", 0))
        with self.transaction():
            for p, s in zip(self.pruners, saved):
                p.load_state_dict(s)
            self._local_step = local_step

    def report(self) -> SparsityReport:
        """Sparsity per pruned layer (element- and block-wise under each pruner's pattern)."""
        layers: Dict[str, Any] = {}
        for p in self.pruners:
            for n in p.modules:
                layers[n] = p.pattern
        return sparsity_report(self.model, layers)

    @property
    def skipped(self) -> Dict[str, str]:
        """Layers left alone because their shape does not fit the pattern, with the reason."""
        out: Dict[str, str] = {}
        for p in self.pruners:
            out.update(p.skipped)
        return out

    def __repr__(self) -> str:
        return f"PruningCallbacks({self.pruners!r}, wired={self.wired})"


def _check_optimizer(model: Any, optimizer: Any) -> None:
    """TypeError unless ``optimizer`` is an optimizer of ``model``'s framework."""
    ob = optimizer_backend(optimizer)
    mb = backend_of(model) or TORCH
    if ob is None:
        raise TypeError(
            f"optimizer={optimizer!r} ({type(optimizer).__name__}) is not a {mb.name}.optim.Optimizer; "
            f"pass the {mb.name}.optim optimizer that trains the model"
        )
    if ob is not mb:
        raise FrameworkMismatchError(
            f"optimizer {type(optimizer).__name__} is a {ob.name} optimizer but the model is a {mb.name} "
            f"{type(model).__name__}; pass a {mb.name}.optim optimizer over the model's parameters"
        )


def prepare_pruning(model: nn.Module, config: Any = None,
                    optimizer: Optional[Any] = None) -> PruningCallbacks:
    """Attach masks to the layers ``config`` selects and return the callbacks.

    ``config`` is anything :func:`~prunekit.training.load_config` reads (a
    dict, a list of dicts, a YAML path, a config object, Neural Compressor's
    ``WeightPruningConfig`` from :mod:`prunekit.compat.neural_compressor`). With ``optimizer``,
    the callbacks are wired to its step hooks, so an unchanged training loop
    prunes on schedule; without it, call the callbacks yourself. A selection
    that matches no layer is a ``ValueError`` listing the layers the model has.
    On any error (bad config, unreachable target, a layer selected twice, an
    interrupt) the model and the optimizer are left exactly as they were.

    Examples:
        >>> import torch, torch.nn as nn
        >>> from prunekit.training import prepare_pruning
        >>> _ = torch.manual_seed(0)
        >>> model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> pruning = prepare_pruning(model, {"prune_type": "magnitude", "pattern": "1x1",
        ...                                   "target_sparsity": 0.75, "end_step": 3}, opt)
        >>> for _ in range(4):
        ...     opt.zero_grad(); model(torch.randn(8, 16)).sum().backward(); opt.step()
        >>> round(pruning.report().elementwise_over_layers, 4)
        0.75
    """
    if not is_module(model):
        raise TypeError(f"model={model!r} is not an nn.Module (torch.nn or tensorplay.nn)")
    if optimizer is not None:
        _check_optimizer(model, optimizer)
    cfg = load_config(config, model)
    selections = []
    owner: Dict[str, int] = {}
    for i, pc in enumerate(cfg.pruners):
        sel = require_modules(model, pc)
        for name in sel:
            if name in owner:
                raise ValueError(
                    f"pruners[{owner[name]}] and pruners[{i}] both select module {name!r}; make their "
                    "names/excluded_names disjoint"
                )
            owner[name] = i
        selections.append(sel)
    # on any failure (KeyboardInterrupt included) every touched module is put back as it was
    snapshots = [Snapshot(m) for sel in selections for m in sel.values()]
    callbacks: Optional[PruningCallbacks] = None
    log = UndoLog()  # one transaction over the whole call (on_train_begin re-masks weights)
    b = backend_of(model) or TORCH
    grad_mode = b.is_grad_enabled()
    try:
        pruners: List[Pruner] = [get_pruner(sel, pc) for sel, pc in zip(selections, cfg.pruners)]
        callbacks = PruningCallbacks(model, pruners, cfg)
        for p in pruners:
            p._undo = log
        if optimizer is not None:
            callbacks.wire(optimizer)
        callbacks.on_train_begin()
        for p in pruners:
            p._undo = p._undo_joined = None
        return callbacks  # inside the try: an interrupt on this line still rolls back
    except BaseException:
        log.rollback()
        if callbacks is not None:
            for p in callbacks.pruners:
                p._undo = p._undo_joined = None
            callbacks.unwire()
        for snap in reversed(snapshots):
            snap.restore()
        b.ns.set_grad_enabled(grad_mode)
        raise
