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
from typing import Any, Dict, List, Mapping, Optional

from torch import nn

from .._backend import TORCH, FrameworkMismatchError, backend_of, is_module, optimizer_backend
from .. import reparam
from .config import PruningConfig, load_config
from .pruners import Pruner, drop_masks, get_pruner, select_modules
from .report import SparsityReport, sparsity_report

__all__ = ["PruningCallbacks", "prepare_pruning"]

logger = logging.getLogger(__name__)


class PruningCallbacks:
    """Several pruners driven together; every callback is forwarded to each of them.

    Built by :func:`prepare_pruning`. ``pruners`` holds one :class:`Pruner`
    per entry of the config.
    """

    def __init__(self, model: nn.Module, pruners: List[Pruner], config: PruningConfig) -> None:
        self.model = model
        self.pruners = pruners
        self.config = config
        self._handles: List[Any] = []
        self._local_step = 0
        self.optimizer: Optional[Any] = None

    # ---------------------------------------------------------------- callbacks
    def on_train_begin(self, dataloader: Any = None) -> None:
        for p in self.pruners:
            p.on_train_begin(dataloader)

    def on_epoch_begin(self, epoch: int) -> None:
        self._local_step = 0
        for p in self.pruners:
            p.on_epoch_begin(epoch)

    def on_step_begin(self, local_step: Optional[int] = None) -> None:
        if local_step is None:
            local_step = self._local_step
        for p in self.pruners:
            p.on_step_begin(local_step)

    def on_before_optimizer_step(self) -> None:
        for p in self.pruners:
            p.on_before_optimizer_step()

    def on_after_optimizer_step(self) -> None:
        for p in self.pruners:
            p.on_after_optimizer_step()

    def on_step_end(self) -> None:
        for p in self.pruners:
            p.on_step_end()
        self._local_step += 1

    def on_epoch_end(self) -> None:
        for p in self.pruners:
            p.on_epoch_end()

    def on_train_end(self) -> None:
        for p in self.pruners:
            p.on_train_end()

    def on_before_eval(self) -> None:
        for p in self.pruners:
            p.on_before_eval()

    def on_after_eval(self) -> None:
        for p in self.pruners:
            p.on_after_eval()

    def mask_weights(self) -> None:
        for p in self.pruners:
            p.mask_weights()

    def step(self) -> None:
        """The pruning part of one step, for a loop whose optimizer is not wired.

        Call it right after ``optimizer.step()``, while the gradients are still
        there: it runs ``on_before_optimizer_step``, ``on_after_optimizer_step``
        and ``on_step_end``. (Gradient criteria then score the weights after the
        update; call the callbacks around ``optimizer.step()`` yourself to score
        them before.) A wired optimizer does all this by itself -- do not call it then.
        """
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
            self.on_step_begin()
            self.on_before_optimizer_step()

        def post(opt, args, kwargs):
            self.on_after_optimizer_step()
            self.on_step_end()

        self._handles = [optimizer.register_step_pre_hook(pre), optimizer.register_step_post_hook(post)]
        return self

    def unwire(self) -> None:
        """Remove the optimizer hooks (masks stay in the model)."""
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
        saved = state.get("pruners", [])
        if len(saved) != len(self.pruners):
            raise ValueError(f"checkpoint holds {len(saved)} pruners, this config builds {len(self.pruners)}")
        for p, s in zip(self.pruners, saved):
            p.load_state_dict(s)
        self._local_step = int(state.get("local_step", 0))

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
    dict, a list of dicts, a YAML path, a config object). With ``optimizer``,
    the callbacks are wired to its step hooks, so an unchanged training loop
    prunes on schedule; without it, call the callbacks yourself. On an error
    (bad config, unreachable target, a layer selected twice) the model is left
    as it was.

    Example:
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
    cfg = load_config(config)
    selections = []
    owner: Dict[str, int] = {}
    for i, pc in enumerate(cfg.pruners):
        sel = select_modules(model, pc)
        for name in sel:
            if name in owner:
                raise ValueError(
                    f"pruners[{owner[name]}] and pruners[{i}] both select module {name!r}; make their "
                    "names/excluded_names disjoint"
                )
            owner[name] = i
        if not sel:
            logger.warning("%s selects no module of the model", pc.where)
        selections.append(sel)
    pruners: List[Pruner] = []
    # on a failure, remove the masks of the pruners built so far: the model is left untouched
    before = {n: reparam.is_masked(m, "weight") for n, m in model.named_modules()}
    try:
        for sel, pc in zip(selections, cfg.pruners):
            pruners.append(get_pruner(sel, pc))
    except Exception:
        _undo(model, before)
        raise
    callbacks = PruningCallbacks(model, pruners, cfg)
    if optimizer is not None:
        callbacks.wire(optimizer)
    callbacks.on_train_begin()
    return callbacks


def _undo(model: nn.Module, before: Mapping[str, bool]) -> None:
    """Remove the weight reparameterizations a failed ``prepare_pruning`` added."""
    drop_masks(m for n, m in model.named_modules() if not before.get(n, False))
