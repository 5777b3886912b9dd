"""A load fills a staged copy first; only when every rank has it does the commit move it into the model.

:class:`StagedLoad` builds the flat state dict ``dcp.load`` fills: for each
entry of the model's state dict (``model.<key>``), of the pruning state
(``pruning.<...>``) and of the extra entries, a fresh tensor shaped and
placed like the target (a ``DTensor`` like the parameter's shard), or the
current value of a non-tensor entry. Tensors pruned in the checkpoint but not
in the model are staged as ``name_orig`` and ``name_mask`` (the mask in the
checkpoint's dtype) without touching the model. Flat names follow DCP's own
flattening (mappings by key, lists that hold tensors or mappings by index).

:meth:`StagedLoad.commit` is a context manager: it reparameterizes what the
checkpoint prunes, swaps every staged tensor with its target (the target
gets the checkpoint's values, the staged tensor keeps the old ones: one
tensor's worth of extra memory at a time), puts non-tensor entries into
their containers, loads stateful extras and the pruning state, and then
yields. Any exception -- in the commit or in the ``with`` block,
``KeyboardInterrupt`` included -- undoes all of it in reverse order, so the
model, the pruning state and the extras are as before.

The price is one copy of this rank's part of the state (its shards, not the
whole model) for the duration of the load.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Tuple

import torch
from torch import Tensor, nn

from .. import methods, reparam
from ..reparam._internal import Snapshot, drop_cache
from .errors import DistributedCheckpointError
from .layout import is_dtensor

__all__ = ["StagedLoad", "flat_leaves"]

Path = Tuple[Any, ...]


def _fqn(path: Path) -> str:
    return ".".join(str(p) for p in path)


def _terminal(value: Any) -> bool:
    """DCP's rule: a mapping is traversed; a list only if it holds a tensor or a traversed container."""
    if isinstance(value, Mapping):
        return False
    if not isinstance(value, list):
        return True
    return not any(isinstance(v, Tensor) or (isinstance(v, (Mapping, list)) and not _terminal(v)) for v in value)


def flat_leaves(obj: Any, path: Path = (), parent: Any = None, key: Any = None
                ) -> Iterator[Tuple[str, Any, Any, Any]]:
    """``(flat name, container, key in it, value)`` for every leaf of ``obj`` as DCP flattens it.

    Examples:
        >>> import torch
        >>> [(n, k, v) for n, _, k, v in flat_leaves({"a": {"b": 1, "c": [torch.zeros(1)]}, "d": [1, 2]})]
        [('a.b', 'b', 1), ('a.c.0', 0, tensor([0.])), ('d', 'd', [1, 2])]
    """
    if isinstance(obj, Mapping):
        for k, v in obj.items():
            yield from flat_leaves(v, path + (k,), obj, k)
    elif not _terminal(obj):
        for i, v in enumerate(obj):
            yield from flat_leaves(v, path + (i,), obj, i)
    else:
        yield _fqn(path), parent, key, obj


def _local(t: Tensor) -> Tensor:
    return t.to_local() if is_dtensor(t) else t


def _rebuild(obj: Any, path: Path, flat: Mapping[str, Any]) -> Any:
    if isinstance(obj, Mapping):
        return {k: _rebuild(v, path + (k,), flat) for k, v in obj.items()}
    if not _terminal(obj):
        return [_rebuild(v, path + (i,), flat) for i, v in enumerate(obj)]
    return flat[_fqn(path)]


def _clone_tree(obj: Any) -> Any:
    if isinstance(obj, Tensor):
        return obj.detach().clone()
    if isinstance(obj, Mapping):
        return {k: _clone_tree(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_clone_tree(v) for v in obj]
    return obj


def _is_stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


class StagedLoad:
    """The flat state dict a load fills (:attr:`flat`), and the commit that applies it (:meth:`commit`).

    Example (a checkpoint loaded by hand into the staged copy):
        >>> import torch
        >>> model = torch.nn.Linear(2, 1)
        >>> staged = StagedLoad("ckpt")
        >>> staged.add_model(model, {"model.weight": None, "model.bias": None})
        >>> sorted(staged.flat)
        ['model.bias', 'model.weight']
        >>> _ = staged.flat["model.weight"].fill_(7.0); _ = staged.flat["model.bias"].fill_(1.0)
        >>> with staged.commit():
        ...     pass
        >>> model.weight.tolist(), model.bias.tolist()
        ([[7.0, 7.0]], [1.0])
    """

    def __init__(self, folder: str) -> None:
        self.folder = folder
        self.flat: Dict[str, Any] = {}
        self._staged: Dict[str, Tensor] = {}
        self._model: Optional[nn.Module] = None
        self._new_masks: List[Tuple[nn.Module, str, torch.dtype]] = []
        self._model_keys: List[Tuple[str, str]] = []  # (flat name, key in the prepared model's state dict)
        self._pruning: Any = None
        self._pruning_state: Any = None
        self._pruning_leaves: List[Tuple[str, Any, Any]] = []
        self._plain: List[Tuple[str, Any, Any, Any]] = []
        self._stateful: List[Tuple[Any, str, Any]] = []

    # ------------------------------------------------------------------ staging
    def _put(self, name: str, value: Any, *, fresh: bool = True, dtype: Optional[torch.dtype] = None) -> None:
        if name in self.flat:
            raise DistributedCheckpointError(f"{self.folder}: two entries of the state are both named {name!r}; "
                                             "rename one of the extra entries")
        if isinstance(value, Tensor):
            value = value.detach()
            if fresh:
                value = torch.empty_like(value, dtype=dtype or value.dtype)
            self._staged[name] = value
        self.flat[name] = value

    def add_model(self, model: nn.Module, meta: Mapping[str, Any]) -> None:
        """Stage ``model``'s state dict, as the checkpoint described by ``meta`` (its entries) will fill it."""
        quals: Dict[int, List[str]] = {}
        by_qual: Dict[str, nn.Module] = {}
        for qual, module in model.named_modules(remove_duplicate=False):
            by_qual[qual] = module
            quals.setdefault(id(module), []).append(qual)
        renames: Dict[str, Tuple[str, torch.dtype]] = {}  # state dict key of a parameter -> (prefix, mask dtype)
        seen = set()
        for key, entry in meta.items():
            if not (key.startswith("model.") and key.endswith("_mask")):
                continue
            qual, _, tensor = key[len("model."):].rpartition(".")
            name = tensor[: -len("_mask")]
            module = by_qual.get(qual)
            if module is None or name in reparam.pruned_names(module):
                continue
            if name not in module._parameters or module._parameters[name] is None:
                raise DistributedCheckpointError(
                    f"{self.folder}: checkpoint entry {key!r}: the model has no parameter "
                    f"{qual + '.' if qual else ''}{name}; load into a model of the same architecture")
            dtype = getattr(getattr(entry, "properties", None), "dtype", None) or torch.float32
            if not (dtype == torch.bool or dtype.is_floating_point):
                raise DistributedCheckpointError(
                    f"{self.folder}: checkpoint entry {key!r} is a mask of dtype {dtype}; masks are bool or floating")
            if (id(module), name) not in seen:
                seen.add((id(module), name))
                self._new_masks.append((module, name, dtype))
            for q in quals[id(module)]:
                renames[f"{q}.{name}" if q else name] = (f"{q}.{name}" if q else name, dtype)
        self._model = model
        for flat, _, key, value in flat_leaves({"model": model.state_dict()}):
            if key in renames and isinstance(value, Tensor):
                base, dtype = renames[key]
                for suffix, dt in (("_orig", None), ("_mask", dtype)):
                    self._put(f"model.{base}{suffix}", value, dtype=dt)
                    self._model_keys.append((f"model.{base}{suffix}", base + suffix))
            elif isinstance(value, Tensor):
                self._put(flat, value)
                self._model_keys.append((flat, key))
            else:
                self._put(flat, value)  # loaded, not applied (as dcp.load into a state dict does)

    def add_pruning(self, pruning: Any, meta: Mapping[str, Any]) -> None:
        """Stage the pruning state (its ``state_dict()`` is a copy already), with a place for saved scores."""
        state = pruning.state_dict()
        for i, (pruner, saved) in enumerate(zip(pruning.pruners, state["pruners"])):
            for layer, mask in pruner.masks.items():
                key = f"pruning.pruners.{i}.scores.{layer}"
                if key in meta and layer not in saved["scores"]:
                    dtype = getattr(getattr(meta[key], "properties", None), "dtype", None) or torch.float32
                    saved["scores"][layer] = torch.zeros_like(mask, dtype=dtype)
        for flat, parent, key, value in flat_leaves({"pruning": state}):
            self._put(flat, value, fresh=False)
            self._pruning_leaves.append((flat, parent, key))
        self._pruning, self._pruning_state = pruning, state

    def add_extra(self, extra: Mapping[str, Any]) -> None:
        """Stage the extra entries: tensors and mappings load in place, stateful objects through their state dicts."""
        for top, obj in extra.items():
            if top in ("model", "pruning"):
                raise DistributedCheckpointError(
                    f"{self.folder}: extra entry {top!r} would overwrite the {top} entry; name it differently")
            if not isinstance(obj, (Tensor, Mapping, list)) and _is_stateful(obj):
                state = obj.state_dict()
                for flat, _, _, value in flat_leaves(state, (top,)):
                    self._put(flat, value)
                self._stateful.append((obj, top, state))
                continue
            wrapper = {top: obj}
            for flat, parent, key, value in flat_leaves(wrapper):
                self._put(flat, value)
                # a top-level non-tensor value has no container of the caller's to be put back into
                self._plain.append((flat, None if parent is wrapper else parent, key, value))

    # ------------------------------------------------------------------ commit
    def _check_tensors(self) -> None:
        for name, staged in self._staged.items():
            if self.flat.get(name) is not staged:
                raise DistributedCheckpointError(
                    f"{self.folder}: checkpoint entry {name!r} holds a {type(self.flat.get(name)).__name__}, "
                    "not a tensor, where the target has a tensor")

    def _swap(self, name: str, target: Tensor, undo: List[Callable[[], object]]) -> None:
        staged = self._staged[name]
        dst, src = _local(target.detach()), _local(staged)
        if dst.shape != src.shape or dst.dtype != src.dtype or is_dtensor(target) != is_dtensor(staged):
            raise DistributedCheckpointError(
                f"{self.folder}: entry {name!r} is {tuple(src.shape)} {src.dtype} here, the target "
                f"{tuple(dst.shape)} {dst.dtype}; load into a model sharded the same way")
        old = dst.clone()
        dst.copy_(src)
        src.copy_(old)
        undo.append(lambda: dst.copy_(src))

    def _commit_model(self, undo: List[Callable[[], object]]) -> None:
        from .fsdp import remask

        model = self._model
        assert model is not None
        snapshots = [Snapshot(m) for m in {id(m): m for m, _, _ in self._new_masks}.values()]
        modules = list(model.modules())

        def restore() -> None:
            for s in reversed(snapshots):
                s.restore()
            for m in modules:
                drop_cache(m)

        undo.append(restore)
        for module, name, dtype in self._new_masks:
            methods.identity(module, name, mask_dtype=dtype)
        state = model.state_dict()
        for name, key in self._model_keys:
            target = state.get(key)
            if not isinstance(target, Tensor):
                raise DistributedCheckpointError(f"{self.folder}: the model has no tensor {key!r} to load "
                                                 f"checkpoint entry {name!r} into")
            self._swap(name, target, undo)
        remask(model)  # keep pruned entries of the shards at zero
        for m in modules:
            drop_cache(m)

    def _commit_extra(self, undo: List[Callable[[], object]]) -> None:
        for name, parent, key, value in self._plain:
            new = self.flat[name]
            if isinstance(value, Tensor):
                self._swap(name, value, undo)
            elif parent is not None:
                old = parent[key]
                parent[key] = new
                undo.append(functools.partial(parent.__setitem__, key, old))
        for obj, top, state in self._stateful:
            old = _clone_tree(obj.state_dict())
            undo.append(functools.partial(obj.load_state_dict, old))
            obj.load_state_dict(_rebuild(state, (top,), self.flat))

    @contextlib.contextmanager
    def commit(self) -> Iterator[None]:
        """Apply everything staged; undo all of it if anything fails before the ``with`` block ends."""
        self._check_tensors()
        undo: List[Callable[[], object]] = []
        try:
            with torch.no_grad():
                if self._model is not None:
                    self._commit_model(undo)
                self._commit_extra(undo)
            if self._pruning is None:
                yield
                return
            for name, parent, key in self._pruning_leaves:
                parent[key] = self.flat[name]
            transaction = getattr(self._pruning, "transaction", None)
            with transaction() if transaction is not None else contextlib.nullcontext():
                self._pruning.load_state_dict(self._pruning_state)
                yield
        except BaseException:
            with torch.no_grad():
                for step in reversed(undo):
                    step()
            raise
