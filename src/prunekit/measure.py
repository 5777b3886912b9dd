"""Measuring sparsity: the effective tensors of a model or state dict, and how they are counted.

One place for what every report counts, so reports cannot disagree:
:func:`prunekit.model_report` (and ``prunekit inspect``) and
:func:`prunekit.training.sparsity_report` both measure through these helpers.

* :func:`effective_tensors` -- every parameter once (tied ones under their
  first name), a pruned ``x_orig`` replaced by ``x = x_orig * x_mask`` with
  masked entries exactly zero, as :func:`prunekit.remove` bakes them;
* :func:`count` / :func:`totals` -- elements and non-zero elements (NaN counts
  as non-zero);
* :func:`block_counts` -- units and all-zero units under a pruning pattern;
* :func:`fraction` -- the one rounding rule (``0.0`` for an empty whole).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Mapping, Optional, Set, Tuple, Union

from torch import Tensor, nn

from . import _sharded
from ._backend import is_module, is_tensor
from .state_dict import dense_state_dict

__all__ = ["block_counts", "count", "effective_tensors", "fraction", "masked_names", "totals"]


def count(t: Tensor) -> Tuple[int, int]:
    """``(elements, non-zero elements)`` of ``t`` (NaN counts as non-zero; DTensor shards: over all ranks).

    Examples:
        >>> import torch
        >>> count(torch.tensor([[0.0, 1.0], [float("nan"), 0.0]]))
        (4, 2)
    """
    return t.numel(), _sharded.count_nonzero(t)


def fraction(part: int, whole: int) -> float:
    """``part / whole``, ``0.0`` for an empty whole (the one rounding every report uses).

    Examples:
        >>> fraction(3, 4), fraction(0, 0)
        (0.75, 0.0)
    """
    return part / whole if whole else 0.0


def block_counts(nz: Tensor, pattern: Any) -> Optional[Tuple[int, int]]:
    """``(units, all-zero units)`` of the non-zero map ``nz`` cut into ``pattern``'s units.

    ``pattern`` is a :class:`prunekit.kernels.patterns.Pattern`; ``None`` when
    ``nz``'s shape does not fit it (a DTensor shard is measured whole). The
    units are those pattern pruning removes, so a tensor pruned with a pattern
    reports its blocks exactly.

    Examples:
        >>> import torch
        >>> from prunekit.kernels.patterns import get_pattern
        >>> block_counts(torch.tensor([[True, True, False, False]]), get_pattern("1x2"))
        (2, 1)
    """
    if pattern.check(tuple(nz.shape)) is not None:
        return None
    units = pattern.to_units(_sharded.whole(nz)).any(dim=1)
    return units.numel(), int((~units).sum())


def masked_names(sd: Mapping[str, Any]) -> Set[str]:
    """Names ``x`` whose ``x_orig`` and ``x_mask`` are both in the state dict ``sd``.

    Examples:
        >>> sorted(masked_names({"w_orig": 0, "w_mask": 0, "b": 0, "v_mask": 0}))
        ['w']
    """
    return {k[: -len("_mask")] for k in sd if k.endswith("_mask") and k[: -len("_mask")] + "_orig" in sd}


def effective_tensors(source: Union[nn.Module, Mapping[str, Tensor]]
                      ) -> Tuple["OrderedDict[str, Tensor]", Set[str], str]:
    """(name -> effective tensor, names that carried a mask, kind of source: ``"model"`` or ``"state_dict"``).

    For a model (PyTorch or TensorPlay): every parameter once (tied ones under
    their first name), a pruned ``x_orig`` replaced by ``x = x_orig * x_mask``
    with masked entries exactly zero, as :func:`prunekit.remove` bakes them.
    For a state dict: every floating-point entry, ``x_orig``/``x_mask`` pairs baked.

    Examples:
        >>> import torch, prunekit
        >>> m = torch.nn.Linear(2, 2)
        >>> _ = prunekit.l1_unstructured(m, "weight", amount=1)
        >>> tensors, masked, kind = effective_tensors(m)
        >>> list(tensors), sorted(masked), kind
        (['bias', 'weight'], ['weight'], 'model')
    """
    if is_module(source):
        sd = source.state_dict()
        masked = masked_names(sd)
        baked = dense_state_dict(sd)
        wanted = []
        for pname, _ in source.named_parameters():
            base = pname[: -len("_orig")] if pname.endswith("_orig") else pname
            wanted.append(base if base in masked else pname)
        out = OrderedDict((k, baked[k].detach()) for k in wanted if k in baked)
        return out, masked, "model"
    if isinstance(source, Mapping):
        for k, v in source.items():
            if not isinstance(k, str) or not is_tensor(v):
                raise TypeError(
                    f"model_report: entry {k!r} of the state dict is a {type(v).__name__}, not a tensor; "
                    "pass a model or a mapping of names to tensors"
                )
        masked = masked_names(source)
        baked = dense_state_dict(source)
        out = OrderedDict((k, v.detach()) for k, v in baked.items() if v.is_floating_point() or v.is_complex())
        return out, masked, "state_dict"
    raise TypeError(
        f"model_report: expected an nn.Module or a state dict (a mapping of names to tensors), got "
        f"{type(source).__name__}; for a file use model_report(read_checkpoint(path)[0])"
    )


def totals(tensors: Mapping[str, Tensor]) -> Tuple[int, int]:
    """``(elements, non-zero elements)`` over every tensor of ``tensors``.

    Examples:
        >>> import torch
        >>> totals({"a": torch.zeros(3), "b": torch.ones(2)})
        (5, 2)
    """
    numel = nonzero = 0
    for t in tensors.values():
        n, nz = count(t)
        numel += n
        nonzero += nz
    return numel, nonzero
