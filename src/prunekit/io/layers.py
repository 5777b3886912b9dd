"""What the exporters need to know about a model's tensors: its linear layers and its tied weights.

* :func:`linear_layers` -- every linear layer of a model with the axis of its
  inputs in the stored weight: ``nn.Linear`` stores ``(out, in)`` (axis 1),
  Hugging Face's ``Conv1D`` (GPT-2's linear layers) stores ``(in, out)``
  (axis 0);
* :func:`fits_n_m` -- whether a weight keeps at most N of every M consecutive
  inputs (2:4 by default), along the axis its layer reads them;
* :func:`tied_aliases` -- which entries of a state dict are the same tensor as
  an earlier one (tied weights: a language model's ``lm_head`` and its input
  embedding), so that a file stores each tied tensor once, under the name
  ``transformers`` keeps, and records or restores the others on load.

Pure queries: nothing here changes a model or a tensor.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Dict, Iterable, Mapping, Optional, Tuple

import torch

from .. import reparam

__all__ = ["fits_n_m", "linear_input_axis", "linear_layers", "tied_aliases", "tied_keys_of"]


def linear_input_axis(module: torch.nn.Module) -> Optional[int]:
    """The axis of the inputs in ``module``'s stored weight: 1 for ``nn.Linear``, 0 for ``Conv1D``; else None.

    ``Conv1D`` is Hugging Face's linear layer of GPT-2 and its kin (``x @ W`` with
    ``W`` of shape ``(in, out)``); a pruned one is recognised by its class before pruning.

    Examples:
        >>> import torch
        >>> linear_input_axis(torch.nn.Linear(4, 2)), linear_input_axis(torch.nn.Conv1d(4, 2, 1))
        (1, None)
        >>> from transformers.pytorch_utils import Conv1D
        >>> linear_input_axis(Conv1D(nf=2, nx=4))
        0
    """
    if isinstance(module, torch.nn.Linear):
        return 1
    if reparam.base_class(module).__name__ == "Conv1D" and hasattr(module, "nf"):
        weight = reparam.stored(module, "weight")
        if isinstance(weight, torch.Tensor) and weight.dim() == 2:
            return 0
    return None


def linear_layers(model: torch.nn.Module) -> "OrderedDict[str, int]":
    """Every linear layer of ``model`` (``nn.Linear`` and ``Conv1D``): its name -> the axis of its inputs.

    Examples:
        >>> import torch
        >>> dict(linear_layers(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))))
        {'0': 1, '2': 1}
    """
    out: "OrderedDict[str, int]" = OrderedDict()
    for name, module in model.named_modules():
        axis = linear_input_axis(module)
        if axis is not None:
            out[name] = axis
    return out


def fits_n_m(weight: torch.Tensor, in_axis: int = 1, n: int = 2, m: int = 4) -> bool:
    """Whether the 2-D ``weight`` has at most ``n`` non-zeros in every ``m`` consecutive inputs.

    The groups run along ``in_axis`` (1 for ``nn.Linear``'s ``(out, in)``, 0 for
    ``Conv1D``'s ``(in, out)``); a weight whose input count is not a multiple of
    ``m`` does not fit.

    Examples:
        >>> import torch
        >>> w = torch.tensor([[1.0, 0.0, 2.0, 0.0], [0.0, 3.0, 0.0, 4.0]])
        >>> fits_n_m(w), fits_n_m(w.t(), in_axis=0), fits_n_m(w.t())
        (True, True, False)
    """
    if weight.dim() != 2 or weight.shape[in_axis] % m or weight.numel() == 0:
        return False
    rows = weight.t() if in_axis == 0 else weight
    return bool(((rows.reshape(-1, m) != 0).sum(dim=1) <= n).all())


def tied_keys_of(model: Any) -> Tuple[str, ...]:
    """The state-dict names ``transformers`` leaves out of a saved model because they are tied to another.

    transformers 5 lists them as ``model.all_tied_weights_keys`` (``{tied: source}``),
    earlier releases as ``_tied_weights_keys`` (a list); ``()`` for any other model.

    Examples:
        >>> import torch
        >>> tied_keys_of(torch.nn.Linear(2, 2))
        ()
    """
    for attr in ("all_tied_weights_keys", "_tied_weights_keys"):
        keys = getattr(model, attr, None)
        if isinstance(keys, Mapping):
            return tuple(k for k in keys if isinstance(k, str))
        if isinstance(keys, (list, tuple, set)):
            return tuple(k for k in keys if isinstance(k, str))
    return ()


def _identity(t: torch.Tensor) -> Optional[Tuple[Any, ...]]:
    if t.device.type == "meta" or t.numel() == 0 or t.layout != torch.strided:
        return None
    return (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)


def tied_aliases(tensors: Mapping[str, torch.Tensor], drop: Iterable[str] = ()) -> "OrderedDict[str, str]":
    """The entries of ``tensors`` that are the very same tensor as another: alias name -> the name kept.

    Tied entries view the same memory with the same offset, shape, strides and
    dtype (a state dict of a model with tied weights holds one such pair per
    tie; merely overlapping views are not ties). Of each group, the name kept
    is the first one not in ``drop`` (``transformers``' tied keys, see
    :func:`tied_keys_of`), else the first one.

    Examples:
        >>> import torch
        >>> emb = torch.nn.Embedding(8, 4)
        >>> head = torch.nn.Linear(4, 8, bias=False)
        >>> head.weight = emb.weight
        >>> sd = {"head.weight": head.weight.detach(), "emb.weight": emb.weight.detach(), "x": torch.ones(1)}
        >>> dict(tied_aliases(sd)), dict(tied_aliases(sd, drop=["head.weight"]))
        ({'emb.weight': 'head.weight'}, {'head.weight': 'emb.weight'})
    """
    dropped = set(drop)
    groups: Dict[Tuple[Any, ...], list] = {}
    for name, t in tensors.items():
        key = _identity(t) if isinstance(t, torch.Tensor) else None
        if key is not None:
            groups.setdefault(key, []).append(name)
    out: "OrderedDict[str, str]" = OrderedDict()
    for names in groups.values():
        if len(names) < 2:
            continue
        kept = next((n for n in names if n not in dropped), names[0])
        for n in names:
            if n != kept:
                out[n] = kept
    return OrderedDict((n, out[n]) for n in tensors if n in out)
