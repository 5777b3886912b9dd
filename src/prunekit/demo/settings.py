"""What the demo trains and compares: :class:`DemoSettings`."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Dict, Tuple

__all__ = ["DemoSettings", "pattern_sparsity"]


@dataclass
class DemoSettings:
    """How long to train and what to compare. ``quick()`` is the ~30-second variant.

    The ``pretrained_*`` fields set the pretrained-model part: MiniLM-L6 pruned in one shot
    (:func:`prunekit.oneshot`) with each of ``pretrained_methods`` at each of
    ``pretrained_patterns`` (a sparsity such as ``"0.5"`` or an N:M pattern such as ``"2:4"``),
    from ``pretrained_calibration`` sentences, judged on ``pretrained_evaluation`` others.

    Examples:
        >>> from prunekit.demo import DemoSettings
        >>> s = DemoSettings.quick()
        >>> s.levels, s.pretrained_methods
        ((0.5, 0.9), ('magnitude', 'prunekit-fast'))
        >>> DemoSettings(pretrained_patterns=("50%",))
        Traceback (most recent call last):
        ...
        ValueError: DemoSettings: pretrained pattern '50%' must be a sparsity such as '0.5' or an N:M pattern such as '2:4'
    """

    dense_epochs: int = 12
    finetune_epochs: int = 8
    levels: Tuple[float, ...] = (0.5, 0.8, 0.9)
    channel_amount: float = 0.5
    batch_size: int = 64
    lr: float = 3e-3
    finetune_lr: float = 1e-3
    prune_until: float = 0.6  # share of the fine-tuning steps over which the gradual schedule ramps
    latency_batch: int = 64
    latency_repeats: int = 100
    seed: int = 0
    threads: int = 1
    chosen: str = "gradual_magnitude_90"
    name: str = "full"
    pretrained: bool = True
    pretrained_methods: Tuple[str, ...] = ("magnitude", "sparsegpt", "prunekit")
    pretrained_patterns: Tuple[str, ...] = ("0.5", "2:4")
    pretrained_calibration: int = 32
    pretrained_evaluation: int = 96

    @classmethod
    def quick(cls, **overrides: Any) -> "DemoSettings":
        """A short run (a few epochs, two sparsity levels): what the tests run."""
        base: Dict[str, Any] = dict(dense_epochs=5, finetune_epochs=2, levels=(0.5, 0.9), latency_repeats=15,
                                    name="quick", pretrained_methods=("magnitude", "prunekit-fast"),
                                    pretrained_patterns=("0.5",), pretrained_calibration=16,
                                    pretrained_evaluation=32)
        base.update(overrides)
        return cls(**base)

    def __post_init__(self) -> None:
        for key in ("dense_epochs", "finetune_epochs", "batch_size", "latency_batch", "latency_repeats", "threads",
                    "pretrained_calibration", "pretrained_evaluation"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"DemoSettings: {key}={v!r} must be an integer >= 1")
        self.levels = tuple(float(s) for s in self.levels)
        for s in self.levels:
            if not 0.0 < s < 1.0:
                raise ValueError(f"DemoSettings: sparsity level {s!r} must lie strictly between 0 and 1, e.g. 0.9")
        if not 0.0 < self.channel_amount < 1.0:
            raise ValueError(f"DemoSettings: channel_amount={self.channel_amount!r} must lie strictly between 0 and 1")
        if not 0.0 < self.prune_until <= 1.0:
            raise ValueError(f"DemoSettings: prune_until={self.prune_until!r} must lie in (0, 1]")
        self.pretrained_methods = tuple(self.pretrained_methods)
        self.pretrained_patterns = tuple(str(p) for p in self.pretrained_patterns)
        for p in self.pretrained_patterns:
            if pattern_sparsity(p) is None:
                raise ValueError(f"DemoSettings: pretrained pattern {p!r} must be a sparsity such as '0.5' "
                                 "or an N:M pattern such as '2:4'")


def pattern_sparsity(pattern: str) -> Any:
    """``(sparsity, oneshot pattern)`` for a demo pattern string, ``None`` when it is neither form.

    Examples:
        >>> from prunekit.demo.settings import pattern_sparsity
        >>> pattern_sparsity("0.5"), pattern_sparsity("2:4"), pattern_sparsity("1.5")
        ((0.5, 'unstructured'), (0.5, '2:4'), None)
    """
    m = re.fullmatch(r"(\d+):(\d+)", pattern)
    if m:
        n, size = int(m.group(1)), int(m.group(2))
        return (1 - n / size, pattern) if 0 < n < size else None
    try:
        s = float(pattern)
    except ValueError:
        return None
    return (s, "unstructured") if 0.0 < s < 1.0 else None
