"""Sparsity schedules: which sparsity a pruner should have reached at a step.

Two kinds:

* one-shot (``start_step == end_step``): the target sparsity at ``start_step``,
  nothing before;
* iterative: from ``initial_sparsity`` at ``start_step`` to ``target_sparsity``
  at ``end_step``, the masks being updated every ``update_frequency_on_step``
  steps *and always at* ``end_step``, so every schedule reaches the target
  exactly (not "the last multiple of the frequency before the end").

With ``progress = (step - start_step) / (end_step - start_step)`` clamped to
[0, 1], ``s0`` the initial and ``sf`` the target sparsity:

=========  ============================================================
``linear``  ``s0 + (sf - s0) * progress``
``cos``     ``s0 + (sf - s0) * (1 - cos(pi * progress)) / 2``
``cube``    ``sf + (s0 - sf) * (1 - progress) ** 3`` (Zhu & Gupta, 2017)
``exp``     density decays geometrically: ``1 - (1 - s0) * ((1 - sf) / (1 - s0)) ** progress``
=========  ============================================================

At ``progress == 1`` every formula returns ``sf`` exactly (it is returned
directly, never recomputed through floating point).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Dict, List

__all__ = [
    "DECAY_TYPES",
    "Scheduler",
    "OneshotScheduler",
    "IterativeScheduler",
    "get_scheduler",
    "decay",
]


def _linear(s0: float, sf: float, p: float) -> float:
    return s0 + (sf - s0) * p


def _cos(s0: float, sf: float, p: float) -> float:
    return s0 + (sf - s0) * (1.0 - math.cos(math.pi * p)) / 2.0


def _cube(s0: float, sf: float, p: float) -> float:
    return sf + (s0 - sf) * (1.0 - p) ** 3


def _exp(s0: float, sf: float, p: float) -> float:
    d0, df = 1.0 - s0, 1.0 - sf
    if d0 <= 0.0:
        return s0
    if df <= 0.0:  # target 100 %: geometric decay to zero density is undefined; use linear density
        return 1.0 - d0 * (1.0 - p)
    return 1.0 - d0 * (df / d0) ** p


#: Decay functions by name: ``f(s0, sf, progress) -> sparsity``.
DECAY_TYPES: Dict[str, Callable[[float, float, float], float]] = {
    "linear": _linear,
    "cos": _cos,
    "cube": _cube,
    "exp": _exp,
}


def decay(kind: str, initial: float, target: float, progress: float) -> float:
    """Sparsity of a ``kind`` schedule at ``progress`` in [0, 1].

    Examples:
        >>> from prunekit.training.schedules import decay
        >>> round(decay("cube", 0.0, 0.8, 0.5), 12)   # 0.8 + (0 - 0.8) * 0.5**3
        0.7
        >>> decay("exp", 0.0, 0.9, 1.0)
        0.9
    """
    if kind not in DECAY_TYPES:
        raise ValueError(
            f"sparsity_decay_type={kind!r} is not a schedule; use one of {sorted(DECAY_TYPES)}"
        )
    p = min(max(float(progress), 0.0), 1.0)
    if p >= 1.0:
        return float(target)
    if p <= 0.0:
        return float(initial)
    return DECAY_TYPES[kind](float(initial), float(target), p)


@dataclass
class Scheduler:
    """Base schedule: ``sparsity(step)`` and ``is_update_step(step)``."""

    start_step: int
    end_step: int
    target_sparsity: float
    initial_sparsity: float = 0.0
    update_frequency_on_step: int = 1

    def sparsity(self, step: int) -> float:  # pragma: no cover - abstract
        raise NotImplementedError

    def is_update_step(self, step: int) -> bool:  # pragma: no cover - abstract
        raise NotImplementedError

    def update_steps(self) -> List[int]:
        """Every step at which masks change, in order.

        Examples:
            >>> from prunekit.training.schedules import IterativeScheduler
            >>> IterativeScheduler(0, 10, 0.5, update_frequency_on_step=4).update_steps()
            [0, 4, 8, 10]
        """
        return [s for s in range(self.start_step, self.end_step + 1) if self.is_update_step(s)]


class OneshotScheduler(Scheduler):
    """All of the target at ``start_step`` (== ``end_step``).

    Examples:
        >>> from prunekit.training.schedules import OneshotScheduler
        >>> s = OneshotScheduler(3, 3, 0.75)
        >>> [s.sparsity(t) for t in (2, 3, 9)], s.is_update_step(3)
        ([0.0, 0.75, 0.75], True)
    """

    def sparsity(self, step: int) -> float:
        return float(self.target_sparsity) if step >= self.start_step else float(self.initial_sparsity)

    def is_update_step(self, step: int) -> bool:
        return step == self.start_step


@dataclass
class IterativeScheduler(Scheduler):
    """Gradual schedule from ``initial_sparsity`` to ``target_sparsity``.

    Examples:
        >>> from prunekit.training.schedules import IterativeScheduler
        >>> s = IterativeScheduler(0, 4, 0.8, decay_type="linear")
        >>> [round(s.sparsity(t), 6) for t in range(5)]
        [0.0, 0.2, 0.4, 0.6, 0.8]
    """

    decay_type: str = "exp"

    def progress(self, step: int) -> float:
        span = self.end_step - self.start_step
        if span <= 0:
            return 1.0 if step >= self.start_step else 0.0
        return min(max((step - self.start_step) / span, 0.0), 1.0)

    def sparsity(self, step: int) -> float:
        return decay(self.decay_type, self.initial_sparsity, self.target_sparsity, self.progress(step))

    def is_update_step(self, step: int) -> bool:
        if step < self.start_step or step > self.end_step:
            return False
        if step == self.end_step:
            return True
        return (step - self.start_step) % self.update_frequency_on_step == 0


def get_scheduler(
    start_step: int,
    end_step: int,
    target_sparsity: float,
    decay_type: str = "exp",
    update_frequency_on_step: int = 1,
    initial_sparsity: float = 0.0,
) -> Scheduler:
    """One-shot when ``start_step == end_step``, iterative otherwise.

    Examples:
        >>> from prunekit.training.schedules import get_scheduler
        >>> type(get_scheduler(5, 5, 0.5)).__name__, type(get_scheduler(0, 9, 0.5)).__name__
        ('OneshotScheduler', 'IterativeScheduler')
    """
    if decay_type not in DECAY_TYPES:
        raise ValueError(
            f"sparsity_decay_type={decay_type!r} is not a schedule; use one of {sorted(DECAY_TYPES)}"
        )
    if end_step < start_step:
        raise ValueError(f"end_step={end_step} is before start_step={start_step}; use end_step >= start_step")
    if start_step == end_step:
        return OneshotScheduler(start_step, end_step, target_sparsity, initial_sparsity, update_frequency_on_step)
    return IterativeScheduler(
        start_step, end_step, target_sparsity, initial_sparsity, update_frequency_on_step, decay_type
    )
