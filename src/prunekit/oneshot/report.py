"""What one-shot pruning did, per layer: sparsity reached, reconstruction error, time."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional, Tuple

__all__ = ["LayerResult", "OneshotReport"]


@dataclass
class LayerResult:
    """One pruned layer.

    ``error`` is the relative output error on the calibration inputs the layer
    saw, ``||X (W - D)^T||^2 / ||X D^T||^2`` (``D`` the dense weight, ``W`` the
    pruned one); ``None`` for methods that gather no calibration statistics.
    """

    name: str
    block: int
    shape: Tuple[int, int]
    pruned: int
    numel: int
    error: Optional[float]
    seconds: float

    @property
    def sparsity(self) -> float:
        """Fraction of the layer's weights that are zero by the mask."""
        return self.pruned / self.numel if self.numel else 0.0


@dataclass
class OneshotReport:
    """The result of :func:`prunekit.oneshot`.

    Examples:
        >>> from prunekit.oneshot import OneshotReport, LayerResult
        >>> r = OneshotReport("wanda", "unstructured", 0.5, [LayerResult("fc", 0, (2, 4), 4, 8, 0.1, 0.01)],
        ...                   blocks=1, samples=8, tokens=64, seconds=0.5)
        >>> r.sparsity, r.layer("fc").error
        (0.5, 0.1)
    """

    method: str
    pattern: str
    target: float
    layers: List[LayerResult] = field(default_factory=list)
    blocks: int = 0
    samples: int = 0
    tokens: int = 0
    seconds: float = 0.0
    options: Dict[str, Any] = field(default_factory=dict)
    #: layers inside the blocks left dense on purpose (mixture-of-experts routers, ...) -> why
    dense: Dict[str, str] = field(default_factory=dict)

    @property
    def sparsity(self) -> float:
        """Zeros by the masks over all pruned layers' weights (each expert's slice a layer; :attr:`dense` left out)."""
        numel = sum(r.numel for r in self.layers)
        return sum(r.pruned for r in self.layers) / numel if numel else 0.0

    def layer(self, name: str) -> LayerResult:
        """The result for layer ``name``."""
        for r in self.layers:
            if r.name == name:
                return r
        raise KeyError(f"no pruned layer named {name!r}; pruned: {[r.name for r in self.layers]}")

    def to_dict(self) -> Dict[str, Any]:
        """Plain data (JSON-ready).

        Examples:
            >>> from prunekit.oneshot import OneshotReport
            >>> sorted(OneshotReport("magnitude", "2:4", 0.5).to_dict())[:4]
            ['blocks', 'dense', 'layers', 'method']
        """
        d = asdict(self)
        d["sparsity"] = self.sparsity
        for row, r in zip(d["layers"], self.layers):
            row["shape"] = list(r.shape)
            row["sparsity"] = r.sparsity
        return d

    def __str__(self) -> str:
        lines = [f"one-shot {self.method} ({self.pattern}, target {self.target:g}): {len(self.layers)} layers in "
                 f"{self.blocks} blocks, sparsity {self.sparsity:.4f}, {self.samples} samples / {self.tokens} tokens, "
                 f"{self.seconds:.2f} s"]
        for r in self.layers:
            err = "-" if r.error is None else f"{r.error:.4f}"
            lines.append(f"  {r.name:<40} {str(list(r.shape)):>12} sparsity {r.sparsity:.4f}  error {err:>7}  "
                         f"{r.seconds:.3f} s")
        for name, why in self.dense.items():
            lines.append(f"  {name:<40} left dense: {why}")
        return "\n".join(lines)
