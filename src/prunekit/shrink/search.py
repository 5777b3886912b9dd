"""The search: every mix of axis sizes that meets a size target, each scored without training.

A target is a parameter count, or a fraction of the dense model's parameters or MACs.
Candidates come from a grid: each searched axis keeps a fraction of its units from
``grid[axis]`` (default :data:`FRACTIONS`), except one -- the *solved* axis (the FFN width when
it is searched, else the hidden size, else the widest axis) -- whose size is the largest that
brings the model to the target. Sizes are uniform across blocks, so the config can say them.
Each candidate is scored by the calibration objective with the model running as if it had
that size (forward hooks; no weight changes, no copy): see :class:`~prunekit.shrink.width.Width`.
"""

from __future__ import annotations

import itertools
import logging
import math
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

from .sizes import LAYERS, SizeModel

logger = logging.getLogger(__name__)

__all__ = ["FRACTIONS", "Candidate", "Target", "grid_candidates"]

#: fractions of an axis's units a candidate keeps, by default
FRACTIONS: Tuple[float, ...] = (1.0, 0.875, 0.75, 0.625, 0.5, 0.375, 0.25)


@dataclass
class Candidate:
    """One mix of sizes: units kept per axis (``"layers"``: blocks kept), its size, and its score."""

    sizes: Dict[str, int]
    params: int
    macs: int
    score: Optional[float] = None  # the calibration objective under emulation (lower is better)

    def __repr__(self) -> str:
        sizes = ", ".join(f"{k}={v}" for k, v in sorted(self.sizes.items()))
        score = "" if self.score is None else f", score={self.score:.4g}"
        return f"Candidate({sizes}; {self.params:,} params, {self.macs:,} MACs/token{score})"


@dataclass(frozen=True)
class Target:
    """The most a shrunk model may have of ``measure`` (``"params"`` or ``"macs"``)."""

    measure: str
    limit: int
    dense: int

    @classmethod
    def parse(cls, target: Union[int, float], measure: str, dense: int) -> "Target":
        """A float in (0, 1) is the fraction of the dense count kept; an int >= 1 the count itself.

        Examples:
            >>> Target.parse(0.5, "params", 1000), Target.parse(300, "params", 1000).limit
            (Target(measure='params', limit=500, dense=1000), 300)
        """
        if measure not in ("params", "macs"):
            raise ValueError(f"prunekit.shrink: measure must be 'params' or 'macs', got {measure!r}")
        if isinstance(target, bool) or not isinstance(target, (int, float)):
            raise TypeError(f"prunekit.shrink: target must be a fraction in (0, 1) or a {measure} count, got "
                            f"{type(target).__name__} {target!r}")
        if isinstance(target, float):
            if not 0.0 < target < 1.0:
                raise ValueError(f"prunekit.shrink: target={target!r} is not a fraction in (0, 1) of the dense model's "
                                 f"{measure}; write e.g. target=0.5 to keep half, or an int count")
            return cls(measure, int(math.floor(target * dense)), dense)
        if not 1 <= target < dense:
            raise ValueError(f"prunekit.shrink: target={target} {measure} is not between 1 and the dense model's "
                             f"{dense:,}; give a smaller count or a fraction such as 0.5")
        return cls(measure, int(target), dense)


def _keep(units: int, fraction: float, step: int) -> int:
    return max(step, int(round(units * fraction / step)) * step) if units >= step else units


def grid_candidates(
    sizes: SizeModel,
    axes: Sequence[str],
    target: Target,
    block_order: Sequence[int],
    *,
    grid: Optional[Dict[str, Sequence[float]]] = None,
    steps: Optional[Dict[str, int]] = None,
    link: Optional[Callable[[Dict[str, int]], Dict[str, int]]] = None,
    least: Optional[Dict[str, int]] = None,
    blocks_only: bool = False,
    slack: float = 0.05,
) -> List[Candidate]:
    """Every grid point of ``axes`` whose solved axis brings the model to ``target``.

    A candidate is at most ``target.limit`` and at least ``target.limit - slack * target.dense``
    (one far below the target would be compared unfairly with the others).

    ``block_order`` lists the blocks least important first (a candidate keeping ``k`` blocks drops
    the first ``n - k``); ``steps[axis]`` makes that axis's sizes multiples of it; ``link`` derives
    sizes that follow others (e.g. heads from the hidden size where the config ties them); ``least[axis]``
    is the fewest units an axis may keep (a router's ``top_k`` experts).

    Examples:
        >>> import torch, transformers
        >>> from prunekit.shrink.width import Width
        >>> cfg = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
        ...                                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
        >>> model = transformers.LlamaForCausalLM(cfg)
        >>> sm = SizeModel(model, Width(model, {"input_ids": torch.arange(8).view(1, 8)}))
        >>> found = grid_candidates(sm, ["ffn", "layers"], Target.parse(0.7, "params", sm.params({})), [0, 1])
        >>> [(c.sizes, c.params, sm.params({})) for c in found]
        [({'layers': 2, 'ffn': 14}, 3984, 5712)]
    """
    grid = dict(grid or {})
    steps = dict(steps or {})
    unknown = [a for a in list(axes) + list(grid) if a not in sizes.units]
    if unknown:
        raise ValueError(f"prunekit.shrink: this model has no axis {unknown[0]!r}; its axes are {sorted(sizes.units)}")
    solved = next((a for a in ("ffn", "hidden") if a in axes), None) or max(axes, key=lambda a: sizes.units[a])
    free = [a for a in axes if a != solved]
    choices = []
    for a in free:
        units, step = sizes.units[a], steps.get(a, 1)
        values = sorted({_keep(units, f, step) for f in grid.get(a, FRACTIONS) if 0 < f <= 1}, reverse=True)
        values = [v for v in values if v >= (least or {}).get(a, 1)]
        choices.append(values)
    measure = sizes.params if target.measure == "params" else sizes.macs
    n_blocks = sizes.n_blocks
    out: List[Candidate] = []
    floor = min(grid.get(solved, FRACTIONS)) / 4  # the solved axis may go below the grid to meet the target
    for combo in itertools.product(*choices):
        fixed = dict(zip(free, combo))
        kept = sorted(block_order[n_blocks - fixed.get(LAYERS, n_blocks):])

        def size_of(n: int) -> Tuple[Dict[str, int], int]:
            s = dict(fixed, **{solved: n})
            s = link(s) if link else s
            blocks = kept if solved != LAYERS else sorted(block_order[n_blocks - n:])
            return s, measure(s, blocks, blocks_only=blocks_only)

        units, step = sizes.units[solved], steps.get(solved, 1)
        lo_n = _keep(units, floor, step)
        best = _largest(lambda n: size_of(n)[1] <= target.limit, lo_n, units, step)
        if best is None:
            continue
        s, size = size_of(best)
        if size < target.limit - slack * target.dense:
            continue
        blocks = kept if solved != LAYERS else sorted(block_order[n_blocks - best:])
        out.append(Candidate(s, sizes.params(s, blocks), sizes.macs(s, blocks)))
    return out


def _largest(ok: Callable[[int], bool], lo: int, hi: int, step: int) -> Optional[int]:
    """The largest multiple of ``step`` in [lo, hi] (or ``hi`` itself) for which ``ok`` holds; ``ok`` is monotone."""
    if ok(hi):
        return hi
    values = list(range(lo, hi, step)) if hi >= step else []
    if not values or not ok(values[0]):
        return None
    a, b = 0, len(values) - 1
    while a < b:
        mid = (a + b + 1) // 2
        if ok(values[mid]):
            a = mid
        else:
            b = mid - 1
    return values[a]
