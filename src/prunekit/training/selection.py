"""Which modules of a model a pruner config selects, and why a selection is empty.

A pruner config names layer types (``prune_layer_type``), name patterns
(``names``) and exclusions (``excluded_names``, ``extra_excluded_names``);
:func:`select_modules` applies them to a model, :func:`require_modules` refuses
an empty selection with the message of :func:`explain_empty_selection`. The
pruners, :func:`prunekit.training.prepare_pruning` and the ``prunekit`` command
select modules through these functions.
"""

from __future__ import annotations

import re
from typing import Any, Dict, List, Mapping, Union

from torch import nn

from .. import reparam
from .._backend import is_tensor
from .config import PrunerConfig, _as_config
from .registry import did_you_mean

__all__ = ["select_modules", "require_modules", "explain_empty_selection"]


def _class_names(module: nn.Module) -> List[str]:
    return [c.__name__ for c in type(module).__mro__]


def select_modules(model: nn.Module, config: Union[PrunerConfig, Mapping[str, Any]], name: str = "weight") -> Dict[str, nn.Module]:
    """The modules of ``model`` that ``config`` selects, by qualified name.

    A module is selected when its class (or a base class) is named in
    ``prune_layer_type``, it has a ``weight``, its name matches one of
    ``names`` (``re.search``; all names when empty) and none of
    ``excluded_names``/``extra_excluded_names``.

    Examples:
        >>> import torch.nn as nn
        >>> from prunekit.training import select_modules
        >>> m = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
        >>> list(select_modules(m, {"prune_type": "magnitude", "excluded_names": ["^2$"]}))
        ['0']
    """
    cfg = _as_config(config)
    types = set(cfg.layer_type_names)
    inc = [re.compile(p) for p in cfg.names]
    exc = [re.compile(p) for p in cfg.all_excluded_names]
    out: Dict[str, nn.Module] = {}
    for qname, module in model.named_modules():
        if not types.intersection(_class_names(module)):
            continue
        if not is_tensor(reparam.stored(module, name)):
            continue
        if inc and not any(p.search(qname) for p in inc):
            continue
        if any(p.search(qname) for p in exc):
            continue
        out[qname] = module
    return out


def _listing(names: List[str], limit: int = 12) -> str:
    shown = ", ".join(repr(n) for n in names[:limit])
    return f"[{shown}{', ...' if len(names) > limit else ''}]" + (f" ({len(names)} in all)" if len(names) > limit else "")


def explain_empty_selection(model: nn.Module, config: Union[PrunerConfig, Mapping[str, Any]],
                            name: str = "weight") -> str:
    """Why ``config`` selects no module of ``model``, listing what the model offers.

    The message says which key filtered everything out (``prune_layer_type``,
    ``names`` or ``excluded_names``), the layers available at that point and
    what to write instead.

    Examples:
        >>> import torch.nn as nn
        >>> from prunekit.training.selection import explain_empty_selection
        >>> m = nn.Sequential(nn.Conv2d(3, 8, 3), nn.Flatten(), nn.Linear(8, 2))
        >>> print(explain_empty_selection(m, {"prune_type": "magnitude", "prune_layer_type": ["Linaer"]}))
        pruner config: prune_layer_type=['Linaer'] matches no layer of Sequential; its layers with a 'weight' are of types ['Conv2d', 'Linear']. Did you mean 'Linear'?
        >>> print(explain_empty_selection(m, {"prune_type": "magnitude", "names": ["fc"]}))
        pruner config: names=['fc'] match none of the 2 layers of Sequential that prune_layer_type selects: ['0', '2']; names are regular expressions searched in these qualified names
    """
    cfg = _as_config(config)
    model_label = type(model).__name__
    weighted = [(q, m) for q, m in model.named_modules() if is_tensor(reparam.stored(m, name))]
    if not weighted:
        return f"{cfg.where}: {model_label} has no module with a tensor {name!r} to prune"
    types = set(cfg.layer_type_names)
    typed = [q for q, m in weighted if types.intersection(_class_names(m))]
    if not typed:
        present = sorted({type(m).__name__ for _, m in weighted})
        hints = "".join(did_you_mean(t, present) for t in cfg.prune_layer_type)
        return (f"{cfg.where}: prune_layer_type={cfg.prune_layer_type} matches no layer of {model_label}; "
                f"its layers with a {name!r} are of types {present}.{hints}")
    inc = [re.compile(p) for p in cfg.names]
    named = [q for q in typed if not inc or any(p.search(q) for p in inc)]
    if not named:
        return (f"{cfg.where}: names={cfg.names} match none of the {len(typed)} layers of {model_label} that "
                f"prune_layer_type selects: {_listing(typed)}; names are regular expressions searched in these "
                "qualified names")
    return (f"{cfg.where}: excluded_names={cfg.excluded_names} and extra_excluded_names={cfg.extra_excluded_names} "
            f"exclude all {len(named)} layers of {model_label} that prune_layer_type and names select: "
            f"{_listing(named)}; narrow the exclusions")


def require_modules(model: nn.Module, config: Union[PrunerConfig, Mapping[str, Any]],
                    name: str = "weight") -> Dict[str, nn.Module]:
    """:func:`select_modules`, but a selection that matches nothing is a ``ValueError``
    (from :func:`explain_empty_selection`) instead of an empty dict.

    Examples:
        >>> import torch.nn as nn
        >>> from prunekit.training.selection import require_modules
        >>> list(require_modules(nn.Sequential(nn.Linear(4, 4)), {"prune_type": "magnitude"}))
        ['0']
    """
    selected = select_modules(model, config, name)
    if not selected:
        raise ValueError(explain_empty_selection(model, config, name))
    return selected
