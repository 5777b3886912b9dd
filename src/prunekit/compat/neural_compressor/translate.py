"""One Neural Compressor config entry translated into a prunekit :class:`~prunekit.training.PrunerConfig`.

Names are translated (pattern prefixes, N:M as *N pruned*, ``*_progressive``
types, 2.x spellings of prunekit's keys); keys Neural Compressor accepted but
never used are checked and warned about; errors name the key as written.
"""

from __future__ import annotations

import logging
import math
import numbers
import re
from typing import Any, Dict, List, Mapping, Optional, Tuple

from torch import nn

from ...kernels.patterns import get_pattern
from ...training import PrunerConfig
from ...training.config import ALIASES
from ...training.registry import did_you_mean
from .keys import _ONE_SHOT_TYPES, _PRUNEKIT_TYPES, V2_KEYS, V2_OTHER, V1_KEYS

__all__: List[str] = []

logger = logging.getLogger(__name__)


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
