"""Typed configuration for training-aware pruning.

A :class:`PruningConfig` holds one :class:`PrunerConfig` per pruner. Build it
from a dict, a list of dicts or a YAML file (``PruningConfig.from_dict``,
``PruningConfig.from_yaml``, or :func:`load_config` for any of those).

Keys (with defaults) -- the first spelling is Intel Neural Compressor's
original one, the ones in brackets are its later spellings, accepted as aliases:

=====================================================  ==================  ===============================================
key [aliases]                                          default             meaning
=====================================================  ==================  ===============================================
``prune_type`` [``pruning_type``]                      ``"snip_momentum"`` registered pruner name (``magnitude``, ``snip``,
                                                                           ``snip_momentum``, ``pattern_lock``, yours)
``target_sparsity``                                    ``0.9``             fraction of the selected weights pruned at
                                                                           ``end_step`` (for ``N:M`` it is ``(M-N)/M``)
``pattern``                                            ``"4x1"``           ``"NxM"``, ``"channelx1"``, ``"1xchannel"``, ``"N:M"``
``prune_domain`` [``pruning_scope``]                   ``"global"``        ``global``: one ranking across the pruner's layers;
                                                                           ``local``: every layer at the same ratio
``start_step``                                         ``0``               first optimizer step that updates masks
``end_step``                                           ``0``               step at which the target is reached
                                                                           (``== start_step``: one-shot)
``sparsity_decay_type``                                ``"exp"``           ``exp``, ``cos``, ``linear``, ``cube``
``update_frequency_on_step`` [``pruning_frequency``]   ``1``               steps between mask updates (``end_step`` always updates)
``min_sparsity_ratio_per_layer``                       ``0.0``             no layer ends denser than this
[``min_sparsity_ratio_per_op``]
``max_sparsity_ratio_per_layer``                       ``0.98``            no layer ends sparser than this; what a capped layer
[``max_sparsity_ratio_per_op``]                                            cannot take goes to the others
``names`` [``op_names``]                               ``[]``              regular expressions (``re.search`` on the module's
                                                                           qualified name); empty = every layer of the right type
``excluded_names`` [``excluded_op_names``]             ``[]``              regular expressions of modules to leave alone
``extra_excluded_names``                               ``[]``              more exclusions, added to ``excluded_names``
``prune_layer_type`` [``pruning_op_types``]            ``["Linear",        module class names (``"Conv"`` = Conv1d/2d/3d)
                                                       "Conv1d", "Conv2d",
                                                       "Conv3d"]``
=====================================================  ==================  ===============================================

Keys given at the top level are defaults for every entry of ``pruners``; each
entry overrides them. A wrong key, type or value raises ``ValueError`` or
``TypeError`` naming the key, the value and what is allowed (with a "did you
mean" for a misspelled key).

Examples:
    >>> from prunekit.training import PruningConfig
    >>> cfg = PruningConfig.from_dict({
    ...     "target_sparsity": 0.8, "pattern": "1x1", "prune_type": "magnitude", "end_step": 100,
    ...     "pruners": [{"names": ["^features"]}, {"names": ["^classifier"], "pattern": "2:4"}],
    ... })
    >>> [(p.names, p.pattern, p.target_sparsity) for p in cfg.pruners]
    [(['^features'], '1x1', 0.8), (['^classifier'], '2:4', 0.5)]
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import os
import re
import reprlib
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Union

from ..kernels.patterns import NInMPattern, get_pattern
from .registry import PRUNERS, did_you_mean
from .schedules import DECAY_TYPES

__all__ = ["PrunerConfig", "PruningConfig", "load_config", "ALIASES"]

#: later spelling -> canonical key
ALIASES: Dict[str, str] = {
    "pruning_type": "prune_type",
    "pruning_scope": "prune_domain",
    "pruning_frequency": "update_frequency_on_step",
    "op_names": "names",
    "excluded_op_names": "excluded_names",
    "min_sparsity_ratio_per_op": "min_sparsity_ratio_per_layer",
    "max_sparsity_ratio_per_op": "max_sparsity_ratio_per_layer",
    "pruning_op_types": "prune_layer_type",
}

_DOMAINS = ("global", "local")
_CONV_ALIASES = {"Conv": ["Conv1d", "Conv2d", "Conv3d"]}


def _default_layer_types() -> List[str]:
    return ["Linear", "Conv1d", "Conv2d", "Conv3d"]


@dataclass
class PrunerConfig:
    """One pruner's settings (see the module docstring for every key).

    Constructing it validates every field; errors name the key and the value.

    Examples:
        >>> from prunekit.training import PrunerConfig
        >>> PrunerConfig(prune_type="magnitude", target_sparsity=0.5, pattern="1x1").prune_domain
        'global'
        >>> PrunerConfig(target_sparsity=1.5)
        Traceback (most recent call last):
        ...
        ValueError: pruner config: target_sparsity=1.5 is out of range; use a number in [0, 1], e.g. 0.9
    """

    prune_type: str = "snip_momentum"
    target_sparsity: Optional[float] = None
    pattern: str = "4x1"
    prune_domain: str = "global"
    start_step: int = 0
    end_step: int = 0
    sparsity_decay_type: str = "exp"
    update_frequency_on_step: int = 1
    min_sparsity_ratio_per_layer: float = 0.0
    max_sparsity_ratio_per_layer: float = 0.98
    names: List[str] = field(default_factory=list)
    excluded_names: List[str] = field(default_factory=list)
    extra_excluded_names: List[str] = field(default_factory=list)
    prune_layer_type: List[str] = field(default_factory=_default_layer_types)
    where: str = field(default="pruner config", repr=False, compare=False)

    # ------------------------------------------------------------------ validation
    def __post_init__(self) -> None:
        w = self.where
        self.prune_type = _as_str(w, "prune_type", self.prune_type)
        if self.prune_type not in PRUNERS:
            raise ValueError(
                f"{w}: prune_type={_show(self.prune_type)} is not a registered pruner; use one of {sorted(PRUNERS)}."
                + did_you_mean(self.prune_type, PRUNERS)
            )
        self.pattern = _as_str(w, "pattern", self.pattern)
        try:
            pat = get_pattern(self.pattern)
        except ValueError as e:
            raise ValueError(f"{w}: {e}") from None
        self.prune_domain = _as_str(w, "prune_domain", self.prune_domain).lower()
        if self.prune_domain not in _DOMAINS:
            raise ValueError(
                f"{w}: prune_domain={_show(self.prune_domain)} is not a scope; use 'global' (one ranking across "
                f"layers) or 'local' (every layer alike).{did_you_mean(self.prune_domain, _DOMAINS)}"
            )
        self.sparsity_decay_type = _as_str(w, "sparsity_decay_type", self.sparsity_decay_type).lower()
        if self.sparsity_decay_type not in DECAY_TYPES:
            raise ValueError(
                f"{w}: sparsity_decay_type={_show(self.sparsity_decay_type)} is not a schedule; use one of "
                f"{sorted(DECAY_TYPES)}.{did_you_mean(self.sparsity_decay_type, DECAY_TYPES)}"
            )
        self.start_step = _as_int(w, "start_step", self.start_step, minimum=0)
        self.end_step = _as_int(w, "end_step", self.end_step, minimum=0)
        if self.end_step < self.start_step:
            raise ValueError(
                f"{w}: end_step={self.end_step} is before start_step={self.start_step}; "
                f"use end_step >= start_step (equal = one-shot pruning at start_step)"
            )
        self.update_frequency_on_step = _as_int(w, "update_frequency_on_step", self.update_frequency_on_step, minimum=1)
        self.min_sparsity_ratio_per_layer = _as_ratio(w, "min_sparsity_ratio_per_layer", self.min_sparsity_ratio_per_layer)
        self.max_sparsity_ratio_per_layer = _as_ratio(w, "max_sparsity_ratio_per_layer", self.max_sparsity_ratio_per_layer)
        if self.min_sparsity_ratio_per_layer > self.max_sparsity_ratio_per_layer:
            raise ValueError(
                f"{w}: min_sparsity_ratio_per_layer={self.min_sparsity_ratio_per_layer} is above "
                f"max_sparsity_ratio_per_layer={self.max_sparsity_ratio_per_layer}; use min <= max"
            )
        if pat.fixed_sparsity is not None:
            if self.target_sparsity is None:
                self.target_sparsity = pat.fixed_sparsity
            else:
                t = _as_ratio(w, "target_sparsity", self.target_sparsity)
                if not math.isclose(t, pat.fixed_sparsity, abs_tol=1e-9):
                    kept = f"{pat.n} of every {pat.m}" if isinstance(pat, NInMPattern) else "a fixed share of its"
                    raise ValueError(
                        f"{w}: target_sparsity={t} does not match pattern {_show(self.pattern)}, which keeps "
                        f"{kept} weights (sparsity {pat.fixed_sparsity:g}); set "
                        f"target_sparsity: {pat.fixed_sparsity:g} or leave it out"
                    )
                self.target_sparsity = pat.fixed_sparsity
        elif self.target_sparsity is None:
            self.target_sparsity = 0.9
        self.target_sparsity = _as_ratio(w, "target_sparsity", self.target_sparsity)
        if self.prune_type != "pattern_lock":
            if self.target_sparsity > self.max_sparsity_ratio_per_layer + 1e-12:
                raise ValueError(
                    f"{w}: target_sparsity={self.target_sparsity} is above max_sparsity_ratio_per_layer="
                    f"{self.max_sparsity_ratio_per_layer}, so no layer may reach it; raise "
                    f"max_sparsity_ratio_per_layer or lower target_sparsity"
                )
            if self.target_sparsity < self.min_sparsity_ratio_per_layer - 1e-12:
                raise ValueError(
                    f"{w}: target_sparsity={self.target_sparsity} is below min_sparsity_ratio_per_layer="
                    f"{self.min_sparsity_ratio_per_layer}; every layer would prune more than the target"
                )
        self.names = _as_regexes(w, "names", self.names)
        self.excluded_names = _as_regexes(w, "excluded_names", self.excluded_names)
        self.extra_excluded_names = _as_regexes(w, "extra_excluded_names", self.extra_excluded_names)
        types = _as_str_list(w, "prune_layer_type", self.prune_layer_type)
        if not types:
            raise ValueError(f"{w}: prune_layer_type=[] selects no layer; write e.g. ['Linear', 'Conv2d']")
        self.prune_layer_type = types

    # ------------------------------------------------------------------ derived
    @property
    def layer_type_names(self) -> List[str]:
        """``prune_layer_type`` with ``"Conv"`` expanded to Conv1d/Conv2d/Conv3d."""
        out: List[str] = []
        for t in self.prune_layer_type:
            out.extend(_CONV_ALIASES.get(t, [t]))
        return out

    @property
    def all_excluded_names(self) -> List[str]:
        return list(self.excluded_names) + list(self.extra_excluded_names)

    def to_dict(self) -> Dict[str, Any]:
        """Plain dict of the canonical keys (round-trips through :meth:`from_dict`)."""
        d = dataclasses.asdict(self)
        d.pop("where", None)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str = "pruner config") -> "PrunerConfig":
        """Build from a mapping that may use alias spellings.

        Examples:
            >>> from prunekit.training import PrunerConfig
            >>> PrunerConfig.from_dict({"pruning_type": "snip", "pruning_scope": "local"}).prune_domain
            'local'
            >>> PrunerConfig.from_dict({"traget_sparsity": 0.5})
            Traceback (most recent call last):
            ...
            ValueError: pruner config: unknown key 'traget_sparsity'. Did you mean 'target_sparsity'?
        """
        return cls(**_canonical(d, where), where=where)


@dataclass
class PruningConfig:
    """Several pruners' settings: ``pruners`` is a list of :class:`PrunerConfig`.

    Examples:
        >>> from prunekit.training import PruningConfig
        >>> cfg = PruningConfig.from_dict({"prune_type": "magnitude", "target_sparsity": 0.5})
        >>> len(cfg.pruners), cfg.pruners[0].prune_type
        (1, 'magnitude')
    """

    pruners: List[PrunerConfig] = field(default_factory=lambda: [PrunerConfig()])

    def __post_init__(self) -> None:
        if isinstance(self.pruners, PrunerConfig):
            self.pruners = [self.pruners]
        if not isinstance(self.pruners, (list, tuple)) or not self.pruners:
            raise TypeError(f"pruning config: pruners={_show(self.pruners)}; write a non-empty list of pruner entries")
        out = []
        for i, p in enumerate(self.pruners):
            if isinstance(p, Mapping):
                p = PrunerConfig.from_dict(p, where=f"pruners[{i}]")
            if not isinstance(p, PrunerConfig):
                raise TypeError(f"pruning config: pruners[{i}]={_show(p)} is neither a dict nor a PrunerConfig")
            out.append(p)
        self.pruners = out

    @classmethod
    def from_dict(cls, d: Union[Mapping[str, Any], Sequence[Mapping[str, Any]]]) -> "PruningConfig":
        """Global keys at the top level, overridden by each entry of ``pruners``.

        A list of dicts is read as the ``pruners`` list with no global keys.
        """
        if isinstance(d, (list, tuple)):
            d = {"pruners": list(d)}
        if not isinstance(d, Mapping):
            raise TypeError(f"pruning config: expected a dict (or a list of pruner dicts), got {type(d).__name__}")
        d = dict(d)
        entries = d.pop("pruners", None)
        if "pruner" in d and entries is None:
            raise ValueError("pruning config: unknown key 'pruner'. Did you mean 'pruners'?")
        top = _canonical(d, "pruning config")
        if entries is None:
            return cls([PrunerConfig(**top, where="pruning config")])
        if isinstance(entries, Mapping):
            entries = [entries]
        if not isinstance(entries, (list, tuple)) or not entries:
            raise TypeError(
                f"pruning config: pruners={_show(entries)}; write a non-empty list of dicts, "
                "e.g. pruners: [{names: ['^fc']}]"
            )
        out = []
        for i, e in enumerate(entries):
            where = f"pruners[{i}]"
            if not isinstance(e, Mapping):
                raise TypeError(f"{where}: expected a dict of keys, got {_show(e)}")
            own = _canonical(e, where)
            merged = dict(top)
            if "pattern" in own and "target_sparsity" not in own and _is_n_in_m(own["pattern"]):
                # an entry that picks an N:M pattern gets that pattern's sparsity, not the global target
                merged.pop("target_sparsity", None)
            merged.update(own)
            out.append(PrunerConfig(**merged, where=where))
        return cls(out)

    @classmethod
    def from_yaml(cls, path: Union[str, "os.PathLike[str]"]) -> "PruningConfig":
        """Read a YAML file (needs ``pyyaml``: ``pip install prunekit[yaml]``), or strict JSON for ``.json``.

        The file goes through prunekit's hostile reader (:func:`prunekit.io.read_config`):
        a regular file of at most 1 MiB, parsed safely with alias bombs, deep nesting
        and duplicate keys refused, or a ``ValueError`` naming the path.

        Examples:
            >>> import os, tempfile
            >>> from prunekit.training import PruningConfig
            >>> p = os.path.join(tempfile.mkdtemp(), "prune.yaml")
            >>> _ = open(p, "w").write("prune_type: magnitude\\ntarget_sparsity: 0.8\\n")
            >>> PruningConfig.from_yaml(p).pruners[0].target_sparsity
            0.8
        """
        from ..io import read_config

        return cls.from_dict(read_config(path, what="pruning config"))

    def to_dict(self) -> Dict[str, Any]:
        return {"pruners": [p.to_dict() for p in self.pruners]}


def load_config(config: Any, model: Any = None) -> PruningConfig:
    """A :class:`PruningConfig` from a config, a pruner config, a dict, a list of dicts or a YAML (or JSON) path.

    Any other object with a ``to_pruning_config(model)`` method (such as
    :class:`prunekit.compat.neural_compressor.WeightPruningConfig`) is asked for
    its :class:`PruningConfig`; ``model`` is passed on (it may be ``None``).

    Examples:
        >>> from prunekit.training import load_config
        >>> load_config({"prune_type": "magnitude"}).pruners[0].pattern
        '4x1'
    """
    if isinstance(config, PruningConfig):
        return config
    convert = getattr(config, "to_pruning_config", None)
    if callable(convert) and not isinstance(config, type):
        out = convert(model)
        if not isinstance(out, PruningConfig):
            raise TypeError(f"{type(config).__name__}.to_pruning_config() returned {type(out).__name__}, "
                            "not a PruningConfig")
        return out
    if isinstance(config, PrunerConfig):
        return PruningConfig([config])
    if config is None:
        return PruningConfig()
    if isinstance(config, (str, os.PathLike)):
        return PruningConfig.from_yaml(config)
    if isinstance(config, (Mapping, list, tuple)):
        return PruningConfig.from_dict(config)
    raise TypeError(
        f"config={_show(config)} ({type(config).__name__}): pass a dict, a list of dicts, a YAML path, "
        "a PrunerConfig, a PruningConfig or a Neural Compressor WeightPruningConfig "
        "(prunekit.compat.neural_compressor)"
    )


def _as_config(config: Any) -> PrunerConfig:
    """One pruner's config: a :class:`PrunerConfig` as is, a dict through :meth:`PrunerConfig.from_dict`."""
    if isinstance(config, PrunerConfig):
        return config
    if isinstance(config, Mapping):
        return PrunerConfig.from_dict(config)
    raise TypeError(f"config={config!r} ({type(config).__name__}): pass a PrunerConfig or a dict of pruner keys")


# ---------------------------------------------------------------------- helpers
_SHORT = reprlib.Repr()
_SHORT.maxstring = _SHORT.maxother = 120
_SHORT.maxlist = _SHORT.maxtuple = _SHORT.maxdict = _SHORT.maxset = 8
_SHORT.maxlevel = 3


def _show(value: Any) -> str:
    """``repr(value)``, cut short: an error message quotes a value from a config file, never all of it."""
    return _SHORT.repr(value)


_FIELDS = [f.name for f in dataclasses.fields(PrunerConfig) if f.name != "where"]


def _canonical(d: Mapping[str, Any], where: str) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    spelled: Dict[str, str] = {}
    for key, value in d.items():
        if not isinstance(key, str):
            raise TypeError(f"{where}: key {_show(key)} is not a string")
        canon = ALIASES.get(key, key)
        if canon not in _FIELDS:
            known = _FIELDS + list(ALIASES) + (["pruners"] if where == "pruning config" else [])
            raise ValueError(f"{where}: unknown key {_show(key)}." + (did_you_mean(key, known) or
                             f" Known keys: {sorted(_FIELDS)}"))
        if canon in out:
            raise ValueError(
                f"{where}: {_show(spelled[canon])} and {_show(key)} are two spellings of the same key; keep one"
            )
        out[canon] = value
        spelled[canon] = key
    return out


def _is_n_in_m(pattern: Any) -> bool:
    try:
        return get_pattern(pattern).fixed_sparsity is not None
    except (TypeError, ValueError):
        return False


def _as_str(where: str, key: str, value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{where}: {key}={_show(value)} ({type(value).__name__}) must be a string")
    return value


def _as_int(where: str, key: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        else:
            raise TypeError(f"{where}: {key}={_show(value)} ({type(value).__name__}) must be an integer >= {minimum}")
    if value < minimum:
        raise ValueError(f"{where}: {key}={value} must be an integer >= {minimum}")
    return int(value)


def _as_ratio(where: str, key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{where}: {key}={_show(value)} ({type(value).__name__}) must be a number in [0, 1], e.g. 0.9")
    v = float(value)
    if not 0.0 <= v <= 1.0:
        raise ValueError(f"{where}: {key}={_show(value)} is out of range; use a number in [0, 1], e.g. 0.9")
    return v


def _as_str_list(where: str, key: str, value: Any) -> List[str]:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise TypeError(f"{where}: {key}={_show(value)} must be a list of strings, e.g. ['fc1', 'conv.*']")
    return list(value)


def _as_regexes(where: str, key: str, value: Any) -> List[str]:
    out = _as_str_list(where, key, value)
    for pattern in out:
        try:
            re.compile(pattern)
        except re.error as e:
            raise ValueError(f"{where}: {key} entry {_show(pattern)} is not a valid regular expression ({e})") from None
    return out


