"""Layers that run their functional form inside a ``forward`` of their own.

A module whose class has a handler through an ancestor but replaces that ancestor's ``forward``
(ConvNeXt's channels-first ``LayerNorm2d``, timm's ``BatchNormAct2d`` and ``Conv2dSame``) is not
one traced layer: the tracer follows its forward op by op. Where that forward calls the layer's
functional form (``F.layer_norm``, ``F.batch_norm``, ``F.conv2d``...) with the module's own
tensors and settings, the call is exactly the layer the handler describes, so the handler's
``trace`` runs on that call's input and output. Any other use of the tensors (a weight
standardised first, a bias added by hand) leaves the op unknown: its channels are blocked.
"""

from __future__ import annotations

from typing import Any, Dict, Tuple

import torch
from torch import Tensor, nn

from .. import weights

__all__ = ["FUNCTIONAL", "call_input", "matches"]

_LINEAR = (("weight", 1, "weight"), ("bias", 2, "bias"))
_CONV_SETTINGS = (("groups", 6, "groups"),)  # conv{1,2,3}d and conv_transpose{1,2,3}d: groups is argument 6

#: functional op -> the module tensors it must receive ``(attribute, argument index, keyword)``
FUNCTIONAL: Dict[str, Tuple[Tuple[str, int, str], ...]] = {
    "linear": _LINEAR,
    **{f"conv{k}d": _LINEAR for k in (1, 2, 3)},
    **{f"conv_transpose{k}d": _LINEAR for k in (1, 2, 3)},
    "batch_norm": (("running_mean", 1, "running_mean"), ("running_var", 2, "running_var"), ("weight", 3, "weight"),
                   ("bias", 4, "bias")),
    "layer_norm": (("weight", 2, "weight"), ("bias", 3, "bias")),
    "group_norm": (("weight", 2, "weight"), ("bias", 3, "bias")),
    "embedding": (("weight", 1, "weight"),),
}
#: functional op -> the module settings it must receive ``(attribute, argument index, keyword)``
_SETTINGS: Dict[str, Tuple[Tuple[str, int, str], ...]] = {
    **{f"conv{k}d": _CONV_SETTINGS for k in (1, 2, 3)},
    **{f"conv_transpose{k}d": _CONV_SETTINGS for k in (1, 2, 3)},
    "layer_norm": (("normalized_shape", 1, "normalized_shape"),),
    "group_norm": (("num_groups", 1, "num_groups"),),
}
_DEFAULTS = {"groups": 1}


def _arg(args: tuple, kwargs: dict, i: int, key: str, default: Any = None) -> Any:
    return args[i] if len(args) > i else kwargs.get(key, default)


def _same_tensor(given: Any, module: nn.Module, attr: str) -> bool:
    """Whether ``given`` is the module's tensor ``attr`` (its masked value when pruned), or both are absent."""
    has = getattr(module, attr, None) is not None or hasattr(module, attr + "_orig")
    if not isinstance(given, Tensor) or not has:
        return given is None and not has
    own = weights.read_only(module, attr)
    if given is own:
        return True
    if given.shape != own.shape or given.dtype != own.dtype:
        return False
    if given.data_ptr() == own.data_ptr() and given.stride() == own.stride():
        return True
    return bool(torch.equal(given, own))


def matches(op: str, module: nn.Module, args: tuple, kwargs: dict) -> bool:
    """Whether ``op(*args, **kwargs)`` is ``module``'s layer: its own tensors and settings.

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> ln = nn.LayerNorm(4)
        >>> x = torch.randn(2, 4)
        >>> matches("layer_norm", ln, (x, (4,), ln.weight, ln.bias, 1e-5), {})
        True
        >>> matches("layer_norm", ln, (x, (4,), ln.weight * 2, ln.bias, 1e-5), {})
        False
    """
    spec = FUNCTIONAL.get(op)
    if spec is None:
        return False
    for attr, i, key in _SETTINGS.get(op, ()):
        given = _arg(args, kwargs, i, key, _DEFAULTS.get(attr))
        want = getattr(module, attr, None)
        if isinstance(want, (tuple, list, torch.Size)):
            if not isinstance(given, (tuple, list, torch.Size)) or tuple(given) != tuple(want):
                return False
        elif given != want:
            return False
    return all(_same_tensor(_arg(args, kwargs, i, key), module, attr) for attr, i, key in spec)


def call_input(args: tuple, kwargs: dict) -> Any:
    """The layer input of a functional call (its first argument).

    Examples:
        >>> call_input(("x", "w"), {}), call_input((), {"input": "x", "weight": "w"})
        ('x', 'x')
    """
    return _arg(args, kwargs, 0, "input")
