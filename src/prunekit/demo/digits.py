"""The digits CNN, its data and its training loop (what every digits stage of the demo uses)."""

from __future__ import annotations

import copy
import logging
import math
from typing import Any, Callable, Optional, Tuple

import torch
from torch import Tensor, nn

from .settings import DemoSettings

__all__ = ["Progress", "Stepper", "accuracy", "bake", "load_data", "make_model", "train"]

logger = logging.getLogger(__name__)

Progress = Callable[[str, int, int], None]


def make_model() -> nn.Module:
    """The demo's CNN for 1x8x8 digit images (about 227k parameters, 2.5M MACs per image).

    Examples:
        >>> import torch
        >>> from prunekit.demo import make_model
        >>> make_model()(torch.zeros(2, 1, 8, 8)).shape
        torch.Size([2, 10])
    """
    return nn.Sequential(
        nn.Conv2d(1, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
        nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(64, 128, 3, padding=1), nn.BatchNorm2d(128), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(512, 256), nn.ReLU(), nn.Linear(256, 10),
    )


def load_data(seed: int = 0, test_fraction: float = 0.2) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """scikit-learn's digits as ``(x_train, y_train, x_test, y_test)``; images scaled to [-1, 1].

    The split is stratified by class and fixed by ``seed``.

    Examples:
        >>> from prunekit.demo import load_data
        >>> xtr, ytr, xte, yte = load_data()
        >>> tuple(xtr.shape), tuple(xte.shape)
        ((1438, 1, 8, 8), (359, 1, 8, 8))
    """
    try:
        from sklearn.datasets import load_digits
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("the demo needs scikit-learn for its bundled digits data: pip install scikit-learn") from e
    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 8.0 - 1.0
    y = torch.tensor(digits.target, dtype=torch.long)
    g = torch.Generator().manual_seed(seed)
    train, test = [], []
    for c in range(10):
        idx = torch.nonzero(y == c).flatten()
        idx = idx[torch.randperm(idx.numel(), generator=g)]
        n_test = int(round(test_fraction * idx.numel()))
        test.append(idx[:n_test])
        train.append(idx[n_test:])
    tr, te = torch.cat(train), torch.cat(test)
    return x[tr], y[tr], x[te], y[te]


class Stepper:
    """Counts training steps across the whole demo for the progress callback.

    Examples:
        >>> from prunekit.demo.digits import Stepper
        >>> seen = []
        >>> s = Stepper(10, lambda stage, done, total: seen.append((stage, done, total)))
        >>> s.stage("training")
        >>> for _ in range(5): s.step()
        >>> seen
        [('training', 0, 10), ('training', 5, 10)]
    """

    def __init__(self, total: int, progress: Optional[Progress]) -> None:
        self.total, self.done, self.progress, self.label = total, 0, progress, ""

    def stage(self, label: str) -> None:
        """Start the stage called ``label`` (logged, and shown by the progress callback)."""
        self.label = label
        logger.info("demo: %s", label)
        if self.progress:
            self.progress(label, self.done, self.total)

    def step(self) -> None:
        """One training step done."""
        self.done += 1
        if self.progress and (self.done % 5 == 0 or self.done == self.total):
            self.progress(self.label, self.done, self.total)


def train(model: nn.Module, data: Tuple[Tensor, ...], epochs: int, lr: float, settings: DemoSettings,
          stepper: Stepper, seed: int, wire: Optional[Callable[[torch.optim.Optimizer, int], Any]] = None) -> Any:
    """Train ``model`` with AdamW and a cosine schedule; ``wire(optimizer, total_steps)`` attaches a pruner.

    Returns what ``wire`` returned (the pruning hooks), ``None`` without it. Leaves the model in eval mode.
    """
    xtr, ytr = data[0], data[1]
    torch.manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-4)
    spe = math.ceil(len(xtr) / settings.batch_size)
    total = epochs * spe
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * min(s, total) / total)))
    hooks = wire(opt, total) if wire else None
    loss_fn = nn.CrossEntropyLoss()
    for _ in range(epochs):
        model.train()
        order = torch.randperm(len(xtr))
        for i in range(0, len(xtr), settings.batch_size):
            b = order[i:i + settings.batch_size]
            opt.zero_grad(set_to_none=True)
            loss_fn(model(xtr[b]), ytr[b]).backward()
            opt.step()
            sched.step()
            stepper.step()
    model.eval()
    return hooks


@torch.no_grad()
def accuracy(model: nn.Module, x: Tensor, y: Tensor) -> float:
    """Share of ``x`` classified as ``y`` (the model is put in eval mode)."""
    model.eval()
    return float((model(x).argmax(dim=1) == y).float().mean())


def bake(model: nn.Module) -> nn.Module:
    """A copy with every mask baked in (plain dense layers holding the zeros)."""
    from .. import iter_pruned, remove

    out = copy.deepcopy(model)
    for _, module, name in list(iter_pruned(out)):
        remove(module, name)
    return out
