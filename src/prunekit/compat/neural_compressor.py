"""Intel Neural Compressor's pruning configs and entry points, served by prunekit's pruners.

Scripts written for Neural Compressor's PyTorch pruner run with one changed import::

    # from neural_compressor.experimental.pytorch_pruner.pruning import Pruning     (1.x)
    # from neural_compressor.config import WeightPruningConfig                       (2.x)
    # from neural_compressor.compression.pruner import prepare_pruning               (2.x)
    # from neural_compressor.training import prepare_compression                     (2.x)
    from prunekit.compat.neural_compressor import (Pruning, WeightPruningConfig, prepare_pruning,
                                                   prepare_compression)

Two config layouts are read, from a YAML file or a dict:

* **1.x** -- ``pruning: approach: weight_compression_pytorch: {...}`` with a list
  of ``!Pruner`` entries (plain dicts work too). Block keys are defaults for
  every entry; absent keys take Neural Compressor 1.x's defaults (``prune_type``
  ``snip_momentum``, pattern ``tile_pattern_4x1``, ``prune_domain`` ``global``,
  ``max_sparsity_ratio_per_layer`` 0.98, layer types ``Conv2d`` and ``Linear``,
  ``exp`` decay, ``target_sparsity`` 0.0, steps 0..0).
* **2.x** -- ``WeightPruningConfig(pruning_configs=[{...}, ...], **globals)``, or the
  YAML section ``pruning: approach: weight_compression_v2: {...}`` with
  ``!PrunerV2`` entries. Entries override the globals; absent keys take 2.x's
  defaults (``pruning_type`` ``snip_momentum``, pattern ``4x1``,
  ``target_sparsity`` 0.9, ``pruning_op_types`` ``["Conv", "Linear"]``, ...).
  As in Neural Compressor 2.x, the model's final classifier (its last module,
  when that is a ``Linear`` or ``Conv2d``) is left unpruned.

Names are translated (see :data:`V1_KEYS` and :data:`V2_KEYS`): patterns lose
their ``tile_pattern_`` prefix, and Neural Compressor's ``"N:M"`` -- *N pruned*
in every M -- becomes prunekit's ``"(M-N):M"`` (*M-N kept*); ``*_progressive``
pruning types run as their base criterion. Keys that Neural Compressor accepted
but its PyTorch pruner never used (``initial_sparsity``, ``start_epoch``,
``update_frequency``, ...) load with a warning naming them; a key neither
layout knows, or a wrong value, is an error naming the key as you wrote it.

Example (the 2.x flow):
    >>> import torch, torch.nn as nn
    >>> from prunekit.compat.neural_compressor import WeightPruningConfig, prepare_pruning
    >>> _ = torch.manual_seed(0)
    >>> model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.01)
    >>> config = WeightPruningConfig(pruning_configs=[{"pattern": "1x1"}],
    ...                              pruning_type="magnitude", target_sparsity=0.5, end_step=2)
    >>> pruning = prepare_pruning(model, config, opt)
    >>> for _ in range(3):
    ...     opt.zero_grad(); model(torch.randn(8, 16)).sum().backward(); opt.step()
    >>> int((model[0].weight == 0).sum() + (model[2].weight == 0).sum()), (512 + 1024) // 2
    (768, 768)
    >>> int((model[4].weight == 0).sum())  # the final classifier is left alone, as in Neural Compressor 2.x
    0
"""

from __future__ import annotations

import copy
import logging
import math
import numbers
import os
import re
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from torch import nn

from ..io.errors import UnreadableFileError
from ..io.reader import read_yaml
from ..kernels.patterns import get_pattern
from ..training import PrunerConfig, PruningCallbacks, PruningConfig, prepare_pruning as _prepare_pruning
from ..training.config import ALIASES
from ..training.registry import did_you_mean

__all__ = [
    "Pruning",
    "WeightPruningConfig",
    "CompressionManager",
    "prepare_pruning",
    "prepare_compression",
    "load_config",
    "NCConfig",
    "V1_KEYS",
    "V2_KEYS",
]

logger = logging.getLogger(__name__)

_NO_DEFAULT = object()

#: 1.x keys (``weight_compression_pytorch`` block and ``!Pruner`` entries): key -> its default.
#: Keys with a prunekit meaning keep their name in prunekit.
V1_KEYS: Dict[str, Any] = {
    "prune_type": "snip_momentum",
    "pattern": "tile_pattern_4x1",
    "target_sparsity": 0.0,
    "prune_domain": "global",
    "start_step": 0,
    "end_step": 0,
    "update_frequency_on_step": 1,
    "sparsity_decay_type": "exp",
    "max_sparsity_ratio_per_layer": 0.98,
    "names": [],
    "excluded_names": [],
    "extra_excluded_names": [],
    "prune_layer_type": ["Conv2d", "Linear"],
}
#: 1.x keys that Neural Compressor's PyTorch pruner accepted and never read (a warning when set)
V1_UNUSED: Dict[str, Any] = {
    "initial_sparsity": 0.0,
    "start_epoch": _NO_DEFAULT,
    "end_epoch": _NO_DEFAULT,
    "update_frequency": _NO_DEFAULT,
    "method": _NO_DEFAULT,
    "parameters": _NO_DEFAULT,
}

#: 2.x keys (``WeightPruningConfig`` arguments, ``pruning_configs`` entries, ``weight_compression_v2``):
#: key -> its default. Their prunekit names are :data:`prunekit.training.ALIASES`.
V2_KEYS: Dict[str, Any] = {
    "target_sparsity": 0.9,
    "pruning_type": "snip_momentum",
    "pattern": "4x1",
    "op_names": [],
    "excluded_op_names": [],
    "start_step": 0,
    "end_step": 0,
    "pruning_scope": "global",
    "pruning_frequency": 1,
    "min_sparsity_ratio_per_op": 0.0,
    "max_sparsity_ratio_per_op": 0.98,
    "sparsity_decay_type": "exp",
    "pruning_op_types": ["Conv", "Linear"],
}
#: 2.x keys without a prunekit counterpart: checked, and a warning when they would change something
V2_OTHER: Dict[str, Any] = {
    "low_memory_usage": False,
    "criterion_type": None,
    "criterion_reduce_type": "mean",
    "resume_from_pruned_checkpoint": False,
    "reg_type": None,
    "reg_coeff": 0.0,
    "backend": None,
    "parameters": None,
}

_LAYOUTS = ("1.x", "2.x")
_PRUNEKIT_TYPES = ("magnitude", "snip", "snip_momentum", "gradient", "pattern_lock")
_ONE_SHOT_TYPES = ("retrain_free", "sparse_gpt", "sparsegpt")


# ---------------------------------------------------------------------- the config
class NCConfig:
    """A Neural Compressor pruning config, as written: its layout, global keys and entries.

    ``entries()`` gives every entry merged over the globals and the layout's
    defaults (Neural Compressor's ``pruners_info``); :meth:`to_pruning_config`
    translates them into a :class:`prunekit.training.PruningConfig`.

    Examples:
        >>> from prunekit.compat.neural_compressor import NCConfig
        >>> cfg = NCConfig("1.x", {"target_sparsity": 0.8}, [{"prune_type": "magnitude", "names": ["fc"]}])
        >>> p = cfg.to_pruning_config().pruners[0]
        >>> p.prune_type, p.pattern, p.target_sparsity, p.prune_layer_type
        ('magnitude', '4x1', 0.8, ['Conv2d', 'Linear'])
    """

    def __init__(self, layout: str, globals_: Optional[Mapping[str, Any]] = None,
                 entries: Optional[Sequence[Mapping[str, Any]]] = None, source: str = "config") -> None:
        if layout not in _LAYOUTS:
            raise ValueError(f"layout={layout!r}: use '1.x' (weight_compression_pytorch) or '2.x' (WeightPruningConfig)")
        self.layout = layout
        self.source = source
        self.globals: Dict[str, Any] = dict(globals_ or {})
        raw = list(entries or [])
        for i, e in enumerate(raw):
            if not isinstance(e, Mapping):
                raise TypeError(f"{source}: pruners[{i}]={e!r} is not a mapping of keys; write e.g. "
                                "{'names': ['layer1.*'], 'target_sparsity': 0.5}")
        self.raw_entries: List[Dict[str, Any]] = [dict(e) for e in raw] or [{}]
        self._check_keys()

    # ------------------------------------------------------------------ keys
    @property
    def _keys(self) -> Dict[str, Any]:
        return {**V1_KEYS, **V1_UNUSED} if self.layout == "1.x" else {**V2_KEYS, **V2_OTHER}

    def _check_keys(self) -> None:
        known = self._keys
        for where, d in [(f"{self.source}", self.globals)] + [
                (f"{self.source}: pruners[{i}]", e) for i, e in enumerate(self.raw_entries)]:
            for k in d:
                if not isinstance(k, str):
                    raise TypeError(f"{where}: key {k!r} is not a string")
                if k not in known:
                    other = {**V2_KEYS, **V2_OTHER} if self.layout == "1.x" else {**V1_KEYS, **V1_UNUSED}
                    if k in other:
                        hint = (f" {k!r} is a Neural Compressor {'2.x' if self.layout == '1.x' else '1.x'} key; "
                                f"this is a {self.layout} config" + _spelling_hint(k, self.layout))
                    else:
                        hint = did_you_mean(k, known)
                    raise ValueError(f"{where}: unknown key {k!r} for Neural Compressor's {self.layout} layout."
                                     + (hint or f" Known keys: {sorted(known)}"))

    def update(self, **kwargs: Any) -> None:
        """Set keys for every entry (Neural Compressor's ``update_config`` /
        ``update_items_for_all_pruners``): each value replaces the entries' own.

        Examples:
            >>> from prunekit.compat.neural_compressor import NCConfig
            >>> cfg = NCConfig("2.x", {}, [{"target_sparsity": 0.5}, {}])
            >>> cfg.update(end_step=10)
            >>> [e["end_step"] for e in cfg.entries()]
            [10, 10]
        """
        known = self._keys
        for k in kwargs:
            if k not in known:
                raise ValueError(f"{self.source}: cannot update unknown key {k!r} of the {self.layout} layout."
                                 + (did_you_mean(k, known) or f" Known keys: {sorted(known)}"))
        before = copy.deepcopy(self.raw_entries)
        for e in self.raw_entries:
            e.update(copy.deepcopy(kwargs))
        try:
            self.to_pruning_config()  # check the new values now; a wrong one changes nothing
        except BaseException:
            self.raw_entries = before
            raise

    def entries(self) -> List[Dict[str, Any]]:
        """Every entry merged over the globals and the layout's defaults (``None`` = not set)."""
        keys = self._keys
        out = []
        for e in self.raw_entries:
            merged: Dict[str, Any] = {}
            for k, default in keys.items():
                for src in (e, self.globals):
                    if src.get(k) is not None:
                        merged[k] = copy.deepcopy(src[k])
                        break
                else:
                    merged[k] = None if default is _NO_DEFAULT else copy.deepcopy(default)
            out.append(merged)
        return out

    # ------------------------------------------------------------------ translation
    def to_pruning_config(self, model: Optional[nn.Module] = None) -> PruningConfig:
        """The :class:`~prunekit.training.PruningConfig` that prunes as this config asks.

        With ``model``, a 2.x config leaves the model's final classifier alone
        (as Neural Compressor 2.x does).
        """
        head = _classifier_head(model) if (model is not None and self.layout == "2.x") else None
        if head is not None:
            logger.info("leaving the final classifier %r unpruned, as Neural Compressor 2.x does", head)
        out = []
        for i, e in enumerate(self.entries()):
            where = f"{self.source}: pruners[{i}]" if len(self.raw_entries) > 1 or self.raw_entries[0] else self.source
            set_keys = set(self.globals) | set(self.raw_entries[i])
            out.append(_translate(e, self.layout, where, set_keys, head))
        return PruningConfig(out)

    def __repr__(self) -> str:
        return f"NCConfig({self.layout!r}, {self.globals!r}, {self.raw_entries!r})"


def _spelling_hint(key: str, layout: str) -> str:
    if layout == "1.x":
        canon = ALIASES.get(key)
        return f" (the 1.x spelling is {canon!r})" if canon else ""
    back = {v: k for k, v in ALIASES.items()}
    return f" (the 2.x spelling is {back[key]!r})" if key in back else ""


def _translate(e: Dict[str, Any], layout: str, where: str, set_keys: set, head: Optional[str]) -> PrunerConfig:
    """One merged Neural Compressor entry -> a PrunerConfig (errors name the key as written)."""
    kw: Dict[str, Any] = {}
    spelled: Dict[str, str] = {}
    if layout == "2.x":
        params = e.get("parameters")
        if params is not None:
            if not isinstance(params, Mapping):
                raise TypeError(f"{where}: parameters={params!r} must be a mapping such as {{'reg_coeff': 0.0}}")
            for k, v in params.items():
                if k not in V2_KEYS and k not in V2_OTHER:
                    raise ValueError(f"{where}: parameters has an unknown key {k!r}." + did_you_mean(k, list(V2_OTHER)))
                e[k] = v
        for nc_key in V2_KEYS:
            canon = ALIASES.get(nc_key, nc_key)
            kw[canon] = e[nc_key]
            spelled[canon] = nc_key
        _check_v2_other(e, where, set_keys)
    else:
        for nc_key in V1_KEYS:
            kw[nc_key] = e[nc_key]
            spelled[nc_key] = nc_key
        _check_v1_unused(e, where, set_keys)
    type_key = spelled["prune_type"]
    kw["prune_type"] = _prune_type(kw["prune_type"], type_key, where)
    pat_key = spelled["pattern"]
    kw["pattern"], nm = _pattern(kw["pattern"], pat_key, where)
    tgt_key = spelled["target_sparsity"]
    if nm is not None and kw["prune_type"] != "pattern_lock":
        pruned, m = nm
        t = kw["target_sparsity"]
        if isinstance(t, numbers.Real) and not isinstance(t, bool) and not math.isclose(float(t), pruned / m, abs_tol=1e-9):
            raise ValueError(
                f"{where}: {tgt_key}={t!r} with {pat_key}={e[pat_key]!r}: prunekit prunes {pruned} of every {m} "
                f"weights in every group (sparsity {pruned / m:g}), where Neural Compressor pruned whole groups "
                f"until {tgt_key}; write {tgt_key}: {pruned / m:g}, or use an NxM pattern for another sparsity"
            )
    if nm is not None:
        kw.pop("target_sparsity")  # the N:M pattern sets it
    if isinstance(kw.get("target_sparsity"), numbers.Real) and not isinstance(kw["target_sparsity"], bool) \
            and kw["target_sparsity"] >= 1.0:
        raise ValueError(f"{where}: {tgt_key}={kw['target_sparsity']!r} must be below 1 (Neural Compressor's "
                         f"range is [0, 1)), e.g. 0.9")
    if head is not None and isinstance(kw.get("excluded_names"), (list, tuple)):
        kw["excluded_names"] = list(kw["excluded_names"]) + ["^" + re.escape(head) + "$"]
    try:
        return PrunerConfig(**kw, where=where)
    except (ValueError, TypeError) as err:
        msg = str(err)
        for canon, user in spelled.items():
            if canon != user:
                msg = re.sub(rf"\b{canon}(?=\W)", user, msg)
        raise type(err)(msg) from None


def _user_terms(err: BaseException, layout: str) -> BaseException:
    """``err`` with prunekit's key names replaced by the 2.x spellings (1.x spells them as prunekit does)."""
    if layout != "2.x" or not isinstance(err, (ValueError, TypeError)):
        return err
    msg = str(err)
    for v2, canon in ALIASES.items():
        if v2 in V2_KEYS:
            msg = re.sub(rf"\b{canon}(?=\W)", v2, msg)
    if msg == str(err):
        return err
    new = type(err)(msg)
    new.__cause__ = err.__cause__
    return new


def _build(model: nn.Module, config: NCConfig, optimizer: Any) -> PruningCallbacks:
    try:
        return _prepare_pruning(model, config.to_pruning_config(model), optimizer)
    except (ValueError, TypeError) as err:
        new = _user_terms(err, config.layout)
        if new is err:
            raise
        raise new from None


def _prune_type(value: Any, key: str, where: str) -> Any:
    if not isinstance(value, str):
        return value  # PrunerConfig names the key and the type
    if value.endswith("_progressive"):
        base = value[: -len("_progressive")]
        if base in _PRUNEKIT_TYPES:
            logger.warning("%s: %s=%r runs as %r: prunekit has no progressive variant (the same criterion and "
                           "target; masks move at each update step)", where, key, value, base)
            return base
    if value in _ONE_SHOT_TYPES:
        raise ValueError(f"{where}: {key}={value!r} is one-shot pruning from calibration data, not pruning during "
                         "training; prunekit does that in prunekit.oneshot, not through this config")
    if value in ("block_mask", "pt_block_mask") or value.startswith("basic_") or value in (
            "gradient_sensitivity", "group_lasso"):
        raise ValueError(f"{where}: {key}={value!r} is not supported by prunekit; use one of "
                         f"{list(_PRUNEKIT_TYPES)}")
    return value


def _pattern(value: Any, key: str, where: str) -> Tuple[Any, Optional[Tuple[int, int]]]:
    """Neural Compressor's pattern name -> prunekit's, and ``(pruned, M)`` for N:M patterns."""
    if not isinstance(value, str):
        return value, None
    s = value.strip()
    if s.lower().startswith("tile_pattern_"):
        s = s[len("tile_pattern_"):]
    if "mha" in s.lower():
        raise ValueError(f"{where}: {key}={value!r} (attention-head pruning) is not supported here; prune heads "
                         "with prunekit.compact (structured groups) instead")
    m = re.fullmatch(r"\s*(\d+)\s*:\s*(\d+)\s*", s)
    if m:
        n, mm = int(m.group(1)), int(m.group(2))
        if not 0 < n < mm:
            raise ValueError(f"{where}: {key}={value!r}: Neural Compressor's 'N:M' prunes N of every M weights and "
                             "needs 0 < N < M, e.g. 'tile_pattern_2:4'")
        return f"{mm - n}:{mm}", (n, mm)
    try:
        get_pattern(s)
    except (TypeError, ValueError):
        raise ValueError(f"{where}: {key}={value!r} is not a pattern; write 'tile_pattern_4x1' or '4x1' (NxM blocks), "
                         "'2:4' (Neural Compressor's N:M: 2 pruned in every 4), 'channelx1' or '1xchannel'") from None
    return s, None


def _is_bool(v: Any) -> bool:
    return isinstance(v, bool)


def _check_v1_unused(e: Dict[str, Any], where: str, set_keys: set) -> None:
    init = e["initial_sparsity"]
    if isinstance(init, bool) or not isinstance(init, numbers.Real) or not 0.0 <= float(init) < 1.0:
        raise ValueError(f"{where}: initial_sparsity={init!r} must be a number in [0, 1), e.g. 0.0")
    target = e["target_sparsity"]
    if isinstance(target, numbers.Real) and not isinstance(target, bool) and init > target:
        raise ValueError(f"{where}: initial_sparsity={init!r} is above target_sparsity={target!r}; "
                         "use initial_sparsity <= target_sparsity")
    if init:
        logger.warning("%s: initial_sparsity=%s has no effect: Neural Compressor's PyTorch pruner never read it "
                       "either; schedules start from the layers' current sparsity", where, init)
    for k in ("start_epoch", "end_epoch"):
        v = e[k]
        if v is not None:
            if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 0:
                raise ValueError(f"{where}: {k}={v!r} must be an integer >= 0")
            logger.warning("%s: %s=%s is ignored, as in Neural Compressor's PyTorch pruner (it belongs to the "
                           "epoch-based legacy pruner); schedules run on start_step/end_step", where, k, v)
    v = e["update_frequency"]
    if v is not None:
        if isinstance(v, bool) or not isinstance(v, numbers.Real) or v <= 0:
            raise ValueError(f"{where}: update_frequency={v!r} must be a number > 0")
        logger.warning("%s: update_frequency=%s is ignored, as in Neural Compressor's PyTorch pruner; the steps "
                       "between mask updates are update_frequency_on_step", where, v)
    v = e["method"]
    if v is not None:
        if v not in ("per_tensor", "per_channel"):
            raise ValueError(f"{where}: method={v!r} must be 'per_tensor' or 'per_channel'")
        logger.warning("%s: method=%r is ignored, as in Neural Compressor's PyTorch pruner; the pattern decides "
                       "the pruned blocks", where, v)
    v = e["parameters"]
    if v is not None:
        if not isinstance(v, Mapping):
            raise TypeError(f"{where}: parameters={v!r} must be a mapping")
        logger.warning("%s: parameters=%r is ignored, as in Neural Compressor's PyTorch pruner", where, dict(v))


def _check_v2_other(e: Dict[str, Any], where: str, set_keys: set) -> None:
    v = e["low_memory_usage"]
    if not _is_bool(v):
        raise TypeError(f"{where}: low_memory_usage={v!r} must be True or False")
    if v:
        logger.warning("%s: low_memory_usage=True has no effect: prunekit keeps one float32 score per weight "
                       "only for gradient criteria", where)
    v = e["criterion_type"]
    if v is not None:
        if not isinstance(v, str):
            raise TypeError(f"{where}: criterion_type={v!r} must be a string")
        if "criterion_type" in set_keys and v != e["pruning_type"]:
            logger.warning("%s: criterion_type=%r is ignored: as in Neural Compressor, pruning_type=%r decides "
                           "the criterion", where, v, e["pruning_type"])
    v = e["criterion_reduce_type"]
    if v not in ("mean", "sum", "max"):
        raise ValueError(f"{where}: criterion_reduce_type={v!r} must be 'mean', 'sum' or 'max'")
    if v != "mean":
        raise ValueError(f"{where}: criterion_reduce_type={v!r} is not supported: prunekit ranks a block by the mean "
                         "of its entries' scores; write criterion_reduce_type: mean (the default)")
    v = e["resume_from_pruned_checkpoint"]
    if not _is_bool(v) and v not in ("True", "False", "true", "false"):
        raise TypeError(f"{where}: resume_from_pruned_checkpoint={v!r} must be True or False")
    if v in (True, "True", "true"):
        logger.warning("%s: resume_from_pruned_checkpoint=True has no effect (Neural Compressor 2.x never read "
                       "it); prunekit keeps the masks a model already carries", where)
    v = e["reg_coeff"]
    if isinstance(v, bool) or not isinstance(v, numbers.Real) or v < 0:
        raise ValueError(f"{where}: reg_coeff={v!r} must be a number >= 0")
    v = e["reg_type"]
    if v is not None:
        if v == "group_lasso":
            raise ValueError(f"{where}: reg_type='group_lasso' is not supported: prunekit adds no regularization "
                             "term; leave reg_type out")
        raise ValueError(f"{where}: reg_type={v!r} is not a regularizer; Neural Compressor knew only 'group_lasso'")
    v = e["backend"]
    if v is not None:
        if not isinstance(v, str):
            raise TypeError(f"{where}: backend={v!r} must be a string or None")
        logger.warning("%s: backend=%r has no effect: prunekit prunes PyTorch (and TensorPlay) models itself",
                       where, v)


def _classifier_head(model: nn.Module) -> Optional[str]:
    """Neural Compressor 2.x's rule: the last module (Dropout aside), if it is a Linear or Conv2d."""
    names: List[str] = []
    last_lc: Optional[str] = None
    for n, m in model.named_modules():
        t = type(m).__name__
        if t == "Dropout":
            continue
        names.append(n)
        if t in ("Linear", "Conv2d"):
            last_lc = n
    if last_lc is not None and names and names[-1] == last_lc:
        return last_lc
    return None


# ---------------------------------------------------------------------- reading configs
_NC_TAGS = ("!Pruner", "!PrunerV2")  # Neural Compressor's YAML tags for one pruner entry


def _yaml_load(path: str) -> Any:
    """A Neural Compressor YAML file through prunekit's hostile reader (its ``!Pruner`` tags read as dicts)."""
    try:
        return read_yaml(path, what="Neural Compressor config", mapping_tags=_NC_TAGS)
    except FileNotFoundError:
        raise UnreadableFileError(f"config file not found: {path}") from None


_SECTIONS = {"weight_compression_pytorch": "1.x", "weight_compression_v2": "2.x"}


def _from_document(doc: Any, source: str, layout: Optional[str]) -> NCConfig:
    if isinstance(doc, Mapping) and "pruning" in doc:
        pruning = doc["pruning"]
        approach = pruning.get("approach") if isinstance(pruning, Mapping) else None
        if not isinstance(approach, Mapping) or not approach:
            raise ValueError(f"{source}: 'pruning' has no 'approach' section; write pruning: approach: "
                             "weight_compression_pytorch: {...} (1.x) or weight_compression_v2: {...} (2.x)")
        unknown = [k for k in approach if k not in _SECTIONS]
        if unknown:
            extra = (" (Neural Compressor's epoch-based legacy pruner, which prunekit does not read)"
                     if "weight_compression" in unknown else "")
            raise ValueError(f"{source}: pruning.approach.{unknown[0]} is not a section prunekit reads{extra}; use "
                             "weight_compression_pytorch (1.x) or weight_compression_v2 (2.x)")
        if len(approach) > 1:
            raise ValueError(f"{source}: pruning.approach has both {sorted(approach)}; keep one")
        (section, block), = approach.items()
        found = _SECTIONS[section]
        if layout is not None and layout != found:
            raise ValueError(f"{source}: layout={layout!r} but the file's section {section} is the {found} layout")
        return _from_block(block if block is not None else {}, source + f": pruning.approach.{section}", found)
    if isinstance(doc, Mapping):
        return _from_block(doc, source, layout or _guess_layout(doc, source))
    raise TypeError(f"{source}: a Neural Compressor config is a mapping of keys, got {type(doc).__name__}")


def _guess_layout(block: Mapping[str, Any], source: str) -> str:
    keys = set(block)
    for e in block.get("pruners", None) or block.get("pruning_configs", None) or []:
        if isinstance(e, Mapping):
            keys |= set(e)
    v2_only = sorted(k for k in keys if (k in V2_KEYS or k in V2_OTHER or k == "pruning_configs")
                     and k not in V1_KEYS and k not in V1_UNUSED)
    v1_only = sorted(k for k in keys if (k in V1_KEYS or k in V1_UNUSED) and k not in V2_KEYS and k not in V2_OTHER)
    if v2_only and v1_only:
        raise ValueError(f"{source}: mixes Neural Compressor 1.x keys ({v1_only}) and 2.x keys ({v2_only}); "
                         "write one layout (pass layout='1.x' or '2.x' to be told which keys to rename)")
    return "2.x" if v2_only else "1.x"


def _from_block(block: Any, source: str, layout: str) -> NCConfig:
    if not isinstance(block, Mapping):
        raise TypeError(f"{source}: expected a mapping of keys, got {type(block).__name__}")
    block = dict(block)
    entries_key = "pruning_configs" if (layout == "2.x" and "pruning_configs" in block) else "pruners"
    entries = block.pop(entries_key, None)
    other = "pruners" if entries_key == "pruning_configs" else "pruning_configs"
    if other in block:
        raise ValueError(f"{source}: unknown key {other!r}; the {layout} layout lists its entries under "
                         f"{'pruners' if layout == '1.x' else 'pruning_configs (or pruners in YAML)'}")
    if entries is None:
        entries = []
    if isinstance(entries, Mapping):
        entries = [entries]
    if not isinstance(entries, (list, tuple)):
        raise TypeError(f"{source}: {entries_key}={entries!r} must be a list of entries")
    return NCConfig(layout, block, entries, source)


def load_config(config: Any, layout: Optional[str] = None) -> NCConfig:
    """Read a Neural Compressor pruning config: a YAML path, a dict or a :class:`WeightPruningConfig`.

    A whole Neural Compressor YAML file (``model:``, ``pruning: approach: ...``)
    or just its approach block are accepted; ``layout`` (``"1.x"`` or
    ``"2.x"``) is found from the section name or the keys when not given.

    Examples:
        >>> from prunekit.compat.neural_compressor import load_config
        >>> cfg = load_config({"pruning_type": "magnitude", "pruning_configs": [{"op_names": ["fc"]}]})
        >>> cfg.layout, cfg.to_pruning_config().pruners[0].names
        ('2.x', ['fc'])
    """
    if isinstance(config, NCConfig):
        return config
    if isinstance(config, WeightPruningConfig):
        return config._nc
    if isinstance(config, (str, os.PathLike)):
        path = os.fspath(config)
        return _from_document(_yaml_load(path), f"config {path}", layout)
    if isinstance(config, Mapping):
        return _from_document(config, "config", layout)
    raise TypeError(f"config={config!r} ({type(config).__name__}): pass a YAML path, a dict or a "
                    "WeightPruningConfig")


# ---------------------------------------------------------------------- 2.x config object
class WeightPruningConfig:
    """Neural Compressor 2.x's pruning config: global keys plus ``pruning_configs`` entries.

    Same arguments and defaults as ``neural_compressor.config.WeightPruningConfig``;
    the values are checked when it is built. Pass it to
    :func:`prunekit.training.prepare_pruning` (or this module's
    :func:`prepare_pruning`, :class:`Pruning`, :func:`prepare_compression`).

    Examples:
        >>> from prunekit.compat.neural_compressor import WeightPruningConfig
        >>> cfg = WeightPruningConfig([{"op_names": ["layer2"], "pattern": "2:4", "target_sparsity": 0.5}],
        ...                           pruning_type="magnitude", target_sparsity=0.8)
        >>> [(p.names, p.pattern, p.target_sparsity) for p in cfg.to_pruning_config().pruners]
        [(['layer2'], '2:4', 0.5)]
        >>> WeightPruningConfig(pruning_scope="everywhere")
        Traceback (most recent call last):
        ...
        ValueError: WeightPruningConfig: pruning_scope='everywhere' is not a scope; use 'global' (one ranking across layers) or 'local' (every layer alike).
    """

    def __init__(self, pruning_configs: Optional[Sequence[Mapping[str, Any]]] = None, target_sparsity: float = 0.9,
                 pruning_type: str = "snip_momentum", pattern: str = "4x1", op_names: Optional[List[str]] = None,
                 excluded_op_names: Optional[List[str]] = None, backend: Optional[str] = None, start_step: int = 0,
                 end_step: int = 0, pruning_scope: str = "global", pruning_frequency: int = 1,
                 min_sparsity_ratio_per_op: float = 0.0, max_sparsity_ratio_per_op: float = 0.98,
                 sparsity_decay_type: str = "exp", pruning_op_types: Optional[List[str]] = None,
                 low_memory_usage: bool = False, **kwargs: Any) -> None:
        self.backend = backend
        self.pruning_configs = [{}] if pruning_configs is None else pruning_configs
        self.weight_compression: Dict[str, Any] = {
            "target_sparsity": target_sparsity,
            "pruning_type": pruning_type,
            "pattern": pattern,
            "op_names": [] if op_names is None else op_names,
            "excluded_op_names": [] if excluded_op_names is None else excluded_op_names,
            "start_step": start_step,
            "end_step": end_step,
            "pruning_scope": pruning_scope,
            "pruning_frequency": pruning_frequency,
            "min_sparsity_ratio_per_op": min_sparsity_ratio_per_op,
            "max_sparsity_ratio_per_op": max_sparsity_ratio_per_op,
            "sparsity_decay_type": sparsity_decay_type,
            "pruning_op_types": ["Conv", "Linear"] if pruning_op_types is None else pruning_op_types,
            "low_memory_usage": low_memory_usage,
            "backend": backend,
        }
        self.weight_compression.update(kwargs)
        if isinstance(self.pruning_configs, Mapping):
            self.pruning_configs = [self.pruning_configs]
        if not isinstance(self.pruning_configs, (list, tuple)):
            raise TypeError(f"WeightPruningConfig: pruning_configs={pruning_configs!r} must be a list of dicts")
        self._nc = NCConfig("2.x", self.weight_compression, self.pruning_configs, "WeightPruningConfig")
        self._nc.to_pruning_config()  # every value checked now, not at the first training step

    def to_pruning_config(self, model: Optional[nn.Module] = None) -> PruningConfig:
        """The prunekit config (the model's final classifier left out when ``model`` is given)."""
        return self._nc.to_pruning_config(model)

    def __repr__(self) -> str:
        return f"WeightPruningConfig(pruning_configs={self.pruning_configs!r}, **{self.weight_compression!r})"


# ---------------------------------------------------------------------- entry points
class Pruning:
    """Neural Compressor's ``Pruning(config)``: set ``model``, call the callbacks in your loop.

    The call order of Neural Compressor's PyTorch pruner: ``prune = Pruning(config)``,
    ``prune.model = model``, optionally ``update_items_for_all_pruners(**kw)``
    (1.x) / ``update_config(**kw)`` (2.x) and ``prepare()``, then
    ``on_train_begin()`` (builds the pruners), per epoch ``on_epoch_begin(epoch)``,
    per step ``on_step_begin(local_step)``, ``on_before_optimizer_step()``,
    ``optimizer.step()``, ``on_after_optimizer_step()``, ``on_step_end()``,
    ``on_epoch_end()``, and ``on_train_end()``; ``on_before_eval()`` /
    ``on_after_eval()`` around evaluation. ``get_sparsity_ratio()`` returns
    Neural Compressor's three figures.

    No optimizer is known to this API, so the pruned entries of the weights are
    zeroed again at every ``on_step_end`` (as Neural Compressor did): momentum
    cannot move them.

    Examples:
        >>> import torch, torch.nn as nn
        >>> from prunekit.compat.neural_compressor import Pruning
        >>> _ = torch.manual_seed(0)
        >>> model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
        >>> prune = Pruning({"prune_type": "magnitude", "pattern": "tile_pattern_1x1", "target_sparsity": 0.5})
        >>> prune.model = model
        >>> prune.on_train_begin()
        >>> prune.on_step_begin(0); prune.on_before_optimizer_step(); prune.on_after_optimizer_step(); prune.on_step_end()
        >>> [round(x, 4) for x in prune.get_sparsity_ratio()]
        [0.5, 0.4734, 0.5]
    """

    def __init__(self, config: Any) -> None:
        self._config = load_config(config)
        self.config_file_path = config if isinstance(config, (str, os.PathLike)) else None
        self.model: Optional[nn.Module] = None
        self.pruners: List[Any] = []
        self.callbacks: Optional[PruningCallbacks] = None

    @property
    def pruners_info(self) -> List[Dict[str, Any]]:
        """Every pruner's settings, merged over the globals and the defaults (Neural Compressor's names)."""
        return self._config.entries()

    @property
    def pruner_info(self) -> List[Dict[str, Any]]:
        """The 1.x name of :attr:`pruners_info`."""
        return self.pruners_info

    def update_items_for_all_pruners(self, **kwargs: Any) -> None:
        """Set ``key=value`` for every pruner (before ``on_train_begin``)."""
        if self.callbacks is not None:
            raise ValueError("update the config before on_train_begin(): the pruners are already built")
        self._config.update(**kwargs)

    def update_config(self, *args: Any, **kwargs: Any) -> None:
        """The 2.x name of :meth:`update_items_for_all_pruners`."""
        if args:
            raise TypeError(f"update_config takes keys only, e.g. update_config(start_step=1); got {args!r}")
        self.update_items_for_all_pruners(**kwargs)

    def prepare(self) -> None:
        """Kept for scripts that call it; the pruners are built by :meth:`on_train_begin`."""

    # ------------------------------------------------------------------ callbacks
    def on_train_begin(self, dataloader: Any = None) -> None:
        """Build the pruners on ``self.model`` (masks attached, target checked)."""
        if not isinstance(self.model, nn.Module):
            raise ValueError(f"set prune.model to the torch.nn.Module to prune before on_train_begin() "
                             f"(it is {type(self.model).__name__})")
        if self.callbacks is not None:
            raise ValueError("on_train_begin() was already called: the pruners exist")
        self.callbacks = _build(self.model, self._config, None)
        self.pruners = self.callbacks.pruners

    def _cb(self) -> PruningCallbacks:
        if self.callbacks is None:
            raise ValueError("call on_train_begin() first: it builds the pruners")
        return self.callbacks

    def on_epoch_begin(self, epoch: int) -> None:
        self._cb().call_event("on_epoch_begin", epoch)

    def on_step_begin(self, local_step: int = 0) -> None:
        self._cb().call_event("on_step_begin", local_step)

    def on_before_optimizer_step(self) -> None:
        self._cb().call_event("on_before_optimizer_step")

    def on_after_optimizer_step(self) -> None:
        self._cb().call_event("on_after_optimizer_step")

    def on_step_end(self) -> None:
        cb = self._cb()
        with cb.transaction():  # both or neither
            cb.call_event("on_step_end")
            if cb.optimizer is None:
                cb.call_event("mask_weights")

    def on_epoch_end(self) -> None:
        self._cb().call_event("on_epoch_end")

    def on_train_end(self) -> None:
        self._cb().call_event("on_train_end")
        logger.info("sparsity (elementwise over Linear/Conv, elementwise over all, blockwise): %s",
                    self.get_sparsity_ratio())

    def on_before_eval(self) -> None:
        self._cb().call_event("on_before_eval")

    def on_after_eval(self) -> None:
        self._cb().call_event("on_after_eval")

    def on_after_compute_loss(self, input: Any, student_output: Any, student_loss: Any,
                              teacher_output: Any = None) -> Any:
        """``prepare_compression``'s loss hook: pruning leaves the loss as it is."""
        return student_loss

    # ------------------------------------------------------------------ figures
    def get_sparsity_ratio(self) -> Tuple[float, float, float]:
        """Neural Compressor's three figures: zero weights of the pruned layers over all Linear/Conv
        weights, the same zeros over all parameters, and zero blocks (under each pruner's pattern,
        counted in weights) over all Linear/Conv weights."""
        cb = self._cb()
        zeros = 0
        block_zeros = 0
        for p in cb.pruners:
            numel = 0
            units = zero_units = 0
            for n, mask in p.masks.items():
                zeros += int((mask == 0).sum())
                numel += mask.numel()
                pruned = p.pattern.unit_pruned(mask)
                units += pruned.numel()
                zero_units += int(pruned.sum())
            if units:
                block_zeros += int(numel * (zero_units / units))
        lc = sum(m.weight.numel() for m in self.model.modules()
                 if (type(m).__name__ == "Linear" or re.search(r"Conv.d", type(m).__name__))
                 and getattr(m, "weight", None) is not None)
        params = sum(p.numel() for p in self.model.parameters())
        return (zeros / lc if lc else 0.0, zeros / params if params else 0.0, block_zeros / lc if lc else 0.0)

    def __repr__(self) -> str:
        return f"Pruning({self._config!r}, built={self.callbacks is not None})"


def prepare_pruning(model: nn.Module, config: Any, optimizer: Any = None, dataloader: Any = None,
                    loss_func: Any = None, framework: str = "pytorch", device: Optional[str] = None) -> PruningCallbacks:
    """Neural Compressor 2.x's ``prepare_pruning``: prune ``model`` while ``optimizer`` trains it.

    ``config`` is a :class:`WeightPruningConfig`, a YAML path or a dict of
    either layout. Every ``optimizer.step()`` is one pruning step (through the
    optimizer's step hooks; the model and optimizer are not patched). Returns
    :class:`prunekit.training.PruningCallbacks`. Without an optimizer, call its
    callbacks yourself.
    """
    if framework != "pytorch":
        raise ValueError(f"framework={framework!r}: prunekit prunes PyTorch (and TensorPlay) models; "
                         "write framework='pytorch'")
    if dataloader is not None and optimizer is None:
        raise ValueError("prepare_pruning(dataloader=...) without an optimizer runs Neural Compressor's one-shot "
                         "pruners (sparse_gpt, retrain_free); prunekit does that in prunekit.oneshot")
    if device is not None:
        logger.info("device=%r: prunekit prunes where the model's weights are", device)
    return _build(model, load_config(config), optimizer)


class CompressionManager:
    """What ``prepare_compression`` returns: ``model`` and ``callbacks`` (a :class:`Pruning`, built)."""

    def __init__(self, model: nn.Module, config: Any) -> None:
        self.model = model
        self.callbacks = Pruning(config)
        self.callbacks.model = model

    def __repr__(self) -> str:
        return f"CompressionManager(callbacks={self.callbacks!r})"


def prepare_compression(model: nn.Module, confs: Any) -> CompressionManager:
    """Neural Compressor 2.x's ``prepare_compression(model, config)`` for pruning configs.

    Returns a :class:`CompressionManager`; call ``manager.callbacks.on_train_begin()``
    and the other callbacks in your loop. Only pruning configs are served.

    Examples:
        >>> import torch.nn as nn
        >>> from prunekit.compat.neural_compressor import WeightPruningConfig, prepare_compression
        >>> model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
        >>> manager = prepare_compression(model, WeightPruningConfig(pattern="1x1", target_sparsity=0.5))
        >>> manager.callbacks.on_train_begin(); list(manager.callbacks.pruners[0].modules)
        ['0']
    """
    if isinstance(confs, (list, tuple)):
        if len(confs) != 1:
            raise ValueError(f"prepare_compression got {len(confs)} configs; prunekit serves one pruning config "
                             "(quantization-aware training and distillation are not part of prunekit)")
        confs = confs[0]
    return CompressionManager(model, confs)
