"""Which layers one-shot pruning prunes, and how their weights look as ``(out, in)`` matrices.

A target is a linear layer inside a block: ``nn.Linear`` (weight ``(out, in)``)
or Hugging Face's ``Conv1D`` (GPT-2; weight ``(in, out)``, used as ``x @ W``); or one
expert's slice of a mixture-of-experts module's 3-D parameter (``gate_up_proj[e]``,
``down_proj[e]``, :mod:`.experts`), named ``<module>.<parameter>.<e>``; or, when asked for,
a router's bare ``weight``. The solvers see every weight as ``(out, in)``; :class:`Target`
converts. Routers (unless asked for) and 3-D parameters of a layout one-shot does not read
are left dense and listed by :func:`left_dense`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from dataclasses import field
from typing import Dict, Iterable, List, Optional, Sequence, Tuple, Union

from torch import Tensor, nn

from .. import reparam
from ..moe import experts_layout

__all__ = ["Target", "find_targets", "is_linear_like", "left_dense"]


def is_linear_like(module: nn.Module) -> bool:
    """``nn.Linear`` (or a subclass), or a ``Conv1D`` with a 2-D weight (GPT-2's linear layers).

    Examples:
        >>> from torch import nn
        >>> is_linear_like(nn.Linear(2, 3)), is_linear_like(nn.Conv1d(2, 3, 1))
        (True, False)
    """
    if isinstance(module, nn.Linear):
        return True
    return (reparam.base_class(module).__name__ == "Conv1D" and hasattr(module, "nf")
            and reparam.stored_to_prune(module, "weight").dim() == 2)


@dataclass
class Target:
    """One layer to prune: its qualified name, block index and module; ``tensor`` the parameter's name on
    the module; ``expert`` the slice of a 3-D parameter (``None``: the whole 2-D parameter);
    ``stored_transposed`` whether it is stored ``(in, out)`` (``None``: ``Conv1D`` is, the rest is not)."""

    name: str
    block: int
    module: nn.Module
    tensor: str = "weight"
    expert: Optional[int] = None
    stored_transposed: Optional[bool] = field(default=None, repr=False)

    @property
    def transposed(self) -> bool:
        """True for ``Conv1D`` and ``is_transposed`` experts (weight stored ``(in, out)``)."""
        if self.stored_transposed is not None:
            return self.stored_transposed
        return not isinstance(self.module, nn.Linear)

    @property
    def param(self) -> Tensor:
        """The stored Parameter (``<tensor>_orig`` when pruned; all experts of a 3-D one)."""
        return reparam.stored_to_prune(self.module, self.tensor)

    @property
    def key(self) -> str:
        """The parameter's qualified name (its ``state_dict`` key; a 3-D one holds every expert's slice)."""
        return self.name.rsplit(".", 1)[0] if self.expert is not None else f"{self.name}.{self.tensor}"

    def matrix(self, t: Optional[Tensor] = None) -> Tensor:
        """``t`` (default: the weight; a 3-D one is sliced at ``expert``) as an ``(out, in)`` matrix (a view)."""
        t = self.param if t is None else t
        if self.expert is not None and t.dim() == 3:
            t = t[self.expert]
        return t.t() if self.transposed else t

    def stored(self, matrix: Tensor) -> Tensor:
        """An ``(out, in)`` matrix in the stored layout."""
        return matrix.t() if self.transposed else matrix

    @property
    def in_features(self) -> int:
        return self.matrix().shape[1]

    @property
    def out_features(self) -> int:
        return self.matrix().shape[0]


Patterns = Union[None, str, Sequence[str]]


def _compile(p: Patterns, what: str) -> List["re.Pattern[str]"]:
    if p is None:
        return []
    if isinstance(p, str):
        p = [p]
    out = []
    for s in p:
        if not isinstance(s, str):
            raise TypeError(f"{what} must be a string or a list of strings (regular expressions), got {s!r}")
        try:
            out.append(re.compile(s))
        except re.error as e:
            raise ValueError(f"{what}: {s!r} is not a regular expression ({e})") from None
    return out


def _candidates(bi: int, full: str, m: nn.Module, router: bool) -> List[Target]:
    """The targets module ``m`` (named ``full``, in block ``bi``; ``router``: one of the block's routers) offers."""
    if is_linear_like(m):
        return [Target(full, bi, m)]
    lay = experts_layout(m)
    if lay is not None:
        return [Target(f"{full}.{name}.{e}", bi, m, name, e, lay.transposed)
                for name in lay.tensors for e in range(lay.experts)]
    if router:
        return [Target(full, bi, m, stored_transposed=False)]
    return []


def find_targets(blocks: Iterable[Tuple[str, nn.Module]], targets: Patterns = None, ignore: Patterns = None,
                 prefix: str = "", routers: bool = False) -> List[Target]:
    """The layers inside ``blocks`` whose qualified name matches ``targets`` and not ``ignore``.

    ``targets``/``ignore``: regular expressions (``re.search``) over the
    qualified name, or class names of the layers (``"Linear"``, ``"MixtralExperts"``);
    ``targets=None`` takes every linear layer and every expert's slice of a 3-D experts
    parameter (``<experts module>.<parameter>.<e>``) in the blocks; ``routers=True`` adds the
    mixture-of-experts routers (see :func:`left_dense`).

    Examples:
        >>> from torch import nn
        >>> blocks = [("h.0", nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)))]
        >>> [t.name for t in find_targets(blocks, ignore=r"\\.1$")]
        ['h.0.0']
    """
    inc, exc = _compile(targets, "targets"), _compile(ignore, "ignore")
    out: List[Target] = []
    for bi, (bname, block) in enumerate(blocks):
        gates = {id(m) for m in _routers(block)}
        for lname, m in block.named_modules():
            full = f"{prefix}{bname}.{lname}" if lname else f"{prefix}{bname}"
            if id(m) in gates and not routers:
                continue
            cls = reparam.base_class(m).__name__
            for t in _candidates(bi, full, m, id(m) in gates):
                if inc and not any(p.search(t.name) or p.fullmatch(cls) for p in inc):
                    continue
                if any(p.search(t.name) or p.fullmatch(cls) for p in exc):
                    continue
                out.append(t)
    return out


def _routers(block: nn.Module) -> List[nn.Module]:
    """The routers of ``block``'s mixture-of-experts layers: every child with a 2-D ``weight`` of its own (a
    router module, or a ``Linear`` gating a shared expert) beside an ``experts`` child."""
    out = []
    for m in block.modules():
        experts = m._modules.get("experts")
        if experts is None or not (experts_layout(experts) is not None or isinstance(experts, nn.ModuleList)):
            continue
        for name, child in m.named_children():
            w = reparam.stored(child, "weight") if name != "experts" else None
            if isinstance(w, Tensor) and w.dim() == 2 and not child._modules:
                out.append(child)
    return out


def left_dense(blocks: Iterable[Tuple[str, nn.Module]], chosen: Sequence[Target]) -> Dict[str, str]:
    """The layers inside ``blocks`` one-shot leaves dense on purpose, and why: the routers (not in ``chosen``)
    and parameters of 3 or more dimensions that are not experts of a known layout.

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> block = nn.Module(); block.odd = nn.Module(); block.odd.w = nn.Parameter(torch.zeros(2, 3, 4))
        >>> left_dense([("h.0", block)], [])
        {'h.0.odd.w': 'a 3-D parameter of a layout one-shot does not read'}
    """
    taken = {id(t.module) for t in chosen}
    out: Dict[str, str] = {}
    for bname, block in blocks:
        names = {id(m): f"{bname}.{n}" if n else bname for n, m in block.named_modules()}
        for r in _routers(block):
            if id(r) not in taken:
                out[names[id(r)]] = "router (pass routers=True to prune it)"
        for n, m in block.named_modules():
            if experts_layout(m) is not None or is_linear_like(m):
                continue
            for pname, p in m.named_parameters(recurse=False):
                if p.dim() >= 3 and not pname.endswith("_orig"):
                    full = f"{bname}.{n}.{pname}" if n else f"{bname}.{pname}"
                    out[full] = f"a {p.dim()}-D parameter of a layout one-shot does not read"
    return out
