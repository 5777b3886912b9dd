"""Neural Compressor's pruning configs as written: :class:`NCConfig`, :class:`WeightPruningConfig`, :func:`load_config`."""

from __future__ import annotations

import copy
import logging
import os
from typing import Any, Dict, List, Mapping, Optional, Sequence

from torch import nn

from ...io.errors import UnreadableFileError
from ...io.reader import read_yaml
from ...training import PruningConfig
from ...training.registry import did_you_mean
from .keys import _LAYOUTS, _NO_DEFAULT, V1_KEYS, V1_UNUSED, V2_KEYS, V2_OTHER
from .translate import _classifier_head, _spelling_hint, _translate

__all__ = ["NCConfig", "WeightPruningConfig", "load_config"]

logger = logging.getLogger(__name__)


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
    :func:`prunekit.training.prepare_pruning` (or :mod:`prunekit.compat.neural_compressor`'s
    ``prepare_pruning``, ``Pruning``, ``prepare_compression``).

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
