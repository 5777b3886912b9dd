"""The tracer: runs the model once and records which channels are coupled.

Handled modules (see :mod:`prunekit.compact.handlers`) are leaves: after each one ran,
its handler binds its inputs to its slots and labels its outputs. Every torch function
*between* leaves goes through a ``TorchFunctionMode`` to the rules of
:mod:`prunekit.compact.trace.rules`, which move the labels the way the op moves elements.
A module whose handler comes from an ancestor class whose ``forward`` it replaces is
followed op by op instead (see :mod:`prunekit.compact.trace.functional`). A handler that
fails on a call blocks the module's channels and those of its inputs; the trace goes on.
"""

from __future__ import annotations

import functools
import logging
import sys
import weakref
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn
from torch.nn.modules import module as global_module_hooks
from torch.overrides import TorchFunctionMode

from . import shadows as lbl
from ..proofs.constants import ConstMap, from_slot, lookup
from ..errors import TraceError
from ...transaction import run_then_clean
from .inputs import flatten_output, split_inputs
from .functional import call_input, matches
from .ops import op_name, tensors_in
from .results import SlotInfo
from .rules import OpRules
from .unionfind import UnionFind

logger = logging.getLogger(__name__)

__all__ = ["OUTPUT_REASON", "TraceError", "Tracer"]

OUTPUT_REASON = "these channels are part of the model's output"
_NO_FORWARD = object()  # a module without a forward attribute of its own


class Tracer(OpRules):
    """Runs the model once and builds the union-find of coupled channels.

    Handlers talk to it through :meth:`slot`, :meth:`bind`, :meth:`emit`,
    :meth:`tie`, :meth:`block` and :meth:`shadow`.
    """

    def __init__(self, model: nn.Module, registry: Any, exact: bool = True, options: Optional[Dict[str, Any]] = None) -> None:
        self.model = model
        self.registry = registry
        self.exact = exact
        self.options: Dict[str, Any] = dict(options or {})
        self.uf = UnionFind()
        self.shadows: Dict[int, Tuple[Any, Tensor, Tensor]] = {}  # id -> (weak ref, shadow, core)
        self.slots: Dict[Tuple[str, str], SlotInfo] = {}
        self.handlers: Dict[str, Any] = {}
        # handled modules whose forward replaces the handler's (followed op by op), and those running now
        self.through: Dict[str, nn.Module] = {}
        self.running: List[str] = []
        # cuts into equal parts: (ids, one row per part; the reason) -- checked once the channels are grouped
        self.parts: List[Tuple[Tensor, str]] = []
        self.named: List[Tuple[str, nn.Module]] = list(model.named_modules())
        self.names: Dict[int, str] = {id(m): n for n, m in self.named}
        self.by_name: Dict[str, nn.Module] = dict(self.named)
        self._slot_ids: Dict[Tuple[str, str], Tensor] = {}
        self._id_pool = torch.arange(0)  # 0, 1, 2, ...: slot ids are slices of it (never written)
        self._specs: Dict[str, Dict[str, Any]] = {}
        self.stack: List[str] = []
        self.leaf_depth = 0
        self.last_op = ""
        self.order: List[str] = []
        # constants: id(tensor) -> (weak ref, ConstMap); reads: every bind's (ids, values or None)
        self.consts: Dict[int, Tuple[Any, ConstMap]] = {}
        self.reads: List[Tuple[Tensor, Optional[Tensor]]] = []
        # set by run(), undone by _cleanup(): installed hooks, wrapped forwards, training flags, fast path
        self._hooks: List[Any] = []
        self._wrapped: List[Tuple[nn.Module, Any, Any]] = []  # (module, its own forward attribute or none, wrapper)
        self._was_training: List[Tuple[nn.Module, bool]] = []
        self._fastpath = True

    # ---- handler API
    @property
    def where(self) -> str:
        """The module being traced: the leaf whose handler runs, else the innermost module of this
        model whose code is running (found on the call stack only when a reason needs it)."""
        if self.stack:
            return self.stack[-1] or "<model>"
        return self._module_of(sys._getframe(1))

    def _module_of(self, frame: Any) -> str:
        names = self.names
        while frame is not None:
            code = frame.f_code
            if code.co_argcount and code.co_varnames[0] == "self":
                obj = frame.f_locals.get("self")
                if isinstance(obj, nn.Module) and id(obj) in names:
                    return names[id(obj)] or "<model>"
            frame = frame.f_back
        return "<model>"

    def slot(self, module_name: str, slot_name: str) -> Tensor:
        """Element ids of one slot (allocated on first use)."""
        key = (module_name, slot_name)
        info = self.slots.get(key)
        if info is None:
            specs = self._specs.get(module_name)
            if specs is None:  # one handler.slots() call per module
                specs = self._specs[module_name] = self.handlers[module_name].slots(self.by_name[module_name])
            spec = specs[slot_name]
            info = SlotInfo(module_name, slot_name, self.uf.add(spec.size), spec)
            self.slots[key] = info
            if spec.tie > 1:  # heads / norm groups: consecutive blocks move together
                self.tie(torch.arange(info.start, info.start + spec.size).view(-1, spec.tie))
        ids = self._slot_ids.get(key)
        if ids is None:
            end = info.start + info.spec.size
            if end > self._id_pool.numel():  # one arange for many slots: a slot's ids are a view of it
                self._id_pool = torch.arange(max(2 * self._id_pool.numel(), end, 4096))
            ids = self._slot_ids[key] = self._id_pool[info.start : end]
        return ids

    def shadow(self, t: Any) -> Optional[Tensor]:
        """The shadow of ``t`` (canonical: stride 0 exactly along its constant dims), or None."""
        if not isinstance(t, Tensor):
            return None
        entry = self.shadows.get(id(t))
        if entry is None or entry[0]() is not t:
            return None
        return entry[1]

    def entry_of(self, t: Tensor) -> Optional[Tuple[Any, Tensor, Tensor]]:
        """(weak ref, shadow, core) of ``t``; the core is the shadow narrowed along its constant dims."""
        entry = self.shadows.get(id(t))
        if entry is None or entry[0]() is not t:
            return None
        return entry

    def consts_of(self, t: Any) -> Optional[ConstMap]:
        """What is known constant about ``t``'s channels (see :mod:`prunekit.compact.proofs.constants`)."""
        if not self.consts or not isinstance(t, Tensor):
            return None
        entry = self.consts.get(id(t))
        if entry is None or entry[0]() is not t:
            return None
        return entry[1]

    def set_consts(self, t: Tensor, cm: Optional[ConstMap]) -> None:
        key = id(t)
        if cm is None or cm[0].numel() == 0:
            self.consts.pop(key, None)
            return
        consts = self.consts

        def _gone(ref: Any, key: int = key) -> None:
            e = consts.get(key)
            if e is not None and e[0] is ref:
                del consts[key]

        self.consts[key] = (weakref.ref(t, _gone), cm)

    def values_in(self, x: Any, dim: int) -> Optional[Tensor]:
        """Per index of dimension ``dim`` of input ``x``: its constant value, NaN if unknown
        (None when nothing about ``x`` is known). For handlers that compute their outputs' constants."""
        cm = self.consts_of(x)
        if cm is None:
            return None
        entry = self.entry_of(x)
        if entry is None:
            return None
        dim = dim % x.dim()
        s = entry[2]
        if s.shape[dim] != x.shape[dim]:
            s = s.expand(tuple(x.shape[dim] if i == dim else n for i, n in enumerate(s.shape)))
        if s.numel() != x.shape[dim]:
            return None  # labels vary along other dims too
        return lookup(cm, s.reshape(-1))

    def set_shadow(
        self, t: Tensor, s: Optional[Tensor], canonical: bool = False, labeled: bool = False, core: Optional[Tensor] = None
    ) -> None:
        """Record ``s`` as the shadow of ``t`` (None or all -1: no channel ids).

        ``canonical``: ``s`` is already canonical; ``labeled``: it has an id >= 0;
        ``core``: its core, if known (implies canonical).
        """
        key = id(t)
        if self.consts:
            self.consts.pop(key, None)
        if s is None:
            self.shadows.pop(key, None)
            return
        if s.shape != t.shape:
            raise RuntimeError(f"internal: shadow shape {tuple(s.shape)} != tensor shape {tuple(t.shape)}")
        if core is None:
            if canonical:
                core = lbl.core(s)
            else:
                core = lbl.canonical_core(s)
                if core.shape != s.shape:
                    s = core.expand(s.shape)
        if not labeled and not bool((core >= 0).any()):
            self.shadows.pop(key, None)
            return
        # A weak reference: activations are freed as the model runs (as without tracing);
        # the entry goes with its tensor (an id can be reused by a later tensor).
        shadows = self.shadows

        def _gone(ref: Any, key: int = key) -> None:
            e = shadows.get(key)
            if e is not None and e[0] is ref:
                del shadows[key]

        self.shadows[key] = (weakref.ref(t, _gone), s, core)

    def tie(self, ids: Tensor) -> None:
        """Union each row of a 2-D id tensor into one unit."""
        ids = ids.reshape(ids.shape[0], -1)
        first = ids[:, :1].expand_as(ids)
        self.uf.union_pairs(torch.stack([first.reshape(-1), ids.reshape(-1)], dim=1))

    def union(self, a: Tensor, b: Tensor) -> None:
        self.uf.union_pairs(torch.stack([a.reshape(-1), b.reshape(-1)], dim=1))

    def block(self, ids: Any, reason: str) -> None:
        if isinstance(ids, Tensor):
            ids = lbl.core(ids) if ids.dim() else ids
        else:
            ids = torch.tensor(list(ids), dtype=torch.long)
        self.uf.block(ids, reason)

    def bind(self, x: Any, dim: int, ids: Tensor, what: str = "") -> None:
        """Couple dimension ``dim`` of input ``x`` with a consumer slot's ids."""
        if not isinstance(x, Tensor):
            return
        dim = dim % x.dim()
        if x.shape[dim] != ids.numel():
            self.block(ids, f"input of module '{self.where}' has {x.shape[dim]} channels, expected {ids.numel()}")
            return
        entry = self.entry_of(x)
        if entry is None:
            self.block(ids, f"input of module '{self.where}' does not come from a prunable layer")
            return
        s = entry[2]
        if s.shape[dim] != x.shape[dim]:  # the same ids along the channel dim: spell them out
            s = s.expand(tuple(x.shape[dim] if i == dim else n for i, n in enumerate(s.shape)))
        if s.numel() == ids.numel():  # labels vary along the channel dim only (the usual case)
            fixed = s  # the union-find flattens both when it solves
            self.uf.union_rows(s, ids)
            cm = self.consts_of(x) if self.consts else None
            self.reads.append((ids, None if cm is None else lookup(cm, s.reshape(-1))))
        else:
            s = torch.unique(s.movedim(dim, -1).reshape(-1, ids.numel()), dim=0)
            pairs = torch.stack([s, ids.view(1, -1).expand_as(s)], dim=-1).reshape(-1, 2)
            fixed = pairs[:, 0]
            self.reads.append((pairs[:, 1], None))  # several labels per index: nothing is known
            ids = pairs[:, 1]
            self.uf.union_pairs(pairs)
        # channels fed by a fixed (unlabeled) value cannot go
        self.uf.block(ids, f"input of module '{self.where}' mixes prunable and fixed channels", where_negative=fixed)

    def read(self, ids: Tensor, values: Optional[Tensor]) -> None:
        """Record the constants a reader slot sees without a bind (see :class:`~prunekit.compact.handlers.TracerAPI`)."""
        self.reads.append((ids.reshape(-1), None if values is None else values.to(torch.float64).reshape(-1)))

    def emit(self, out: Any, dim: int, ids: Tensor, values: Optional[Tensor] = None) -> None:
        """Label dimension ``dim`` of output ``out`` with a producer slot's ids.

        ``values``: per index, the constant every element of that channel provably holds
        (NaN: not known), e.g. a Linear's bias where its weight rows are masked.
        """
        if not isinstance(out, Tensor):
            return
        if values is not None:
            self._emit(out, dim, ids)
            self.set_consts(out, from_slot(ids, values))
            return
        self._emit(out, dim, ids)

    def _emit(self, out: Tensor, dim: int, ids: Tensor) -> None:
        dim = dim % out.dim()
        shape = [1] * out.dim()
        shape[dim] = ids.numel()
        core = ids.view(shape)
        # shadows are never mutated: a zero-copy view; slot ids are distinct, so it is canonical
        if ids.numel() > 1:
            self.set_shadow(out, core.expand(out.shape), core=core, labeled=True)
        else:
            self.set_shadow(out, core.expand(out.shape))

    # ---- hooks (on leaves only: ops between leaves find their module on the call stack, see where)
    def _pre(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        self.leaf_depth += 1

    def _post(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        self.leaf_depth -= 1
        if self.leaf_depth == 0:
            self._trace_leaf(module, self.names[id(module)], args, kwargs, output)

    def _trace_leaf(self, module: nn.Module, name: str, args: Any, kwargs: Any, output: Any) -> None:
        self.order.append(name)
        self.stack.append(name)
        try:
            with torch._C.DisableTorchFunction():  # the handler's own tensor work is not traced
                self.handlers[name].trace(module, name, self, args, kwargs, output)
        except Exception as exc:  # the handler does not understand this call: its channels stay
            self._handler_failed(module, name, args, kwargs, output, exc)
        finally:
            self.stack.pop()

    def _handler_failed(self, module: nn.Module, name: str, args: Any, kwargs: Any, output: Any, exc: Exception) -> None:
        """Block the slots of ``module`` and the channels of its inputs; its outputs carry no labels."""
        reason = (f"the compaction handler {type(self.handlers[name]).__name__} does not understand this call of "
                  f"module '{name or '<model>'}' ({type(module).__name__}): {type(exc).__name__}: {exc}")
        logger.info("%s", reason)
        specs = self._specs.get(name)
        for sname in specs or ():
            self.block(self.slot(name, sname), reason)
        for t in tensors_in((args, kwargs)):
            s = self.shadow(t)
            if s is not None:
                self.block(s, reason)
        for t in tensors_in(output):
            self.set_shadow(t, None)

    def through_call(self, name: str, args: tuple, kwargs: dict, out: Any) -> bool:
        """A functional op inside the forward of a module followed op by op: when it is that module's
        layer (its own tensors and settings), trace it with the module's handler and return True."""
        for mname in reversed(self.running):
            module = self.through[mname]
            if matches(name, module, args, kwargs):
                x = call_input(args, kwargs)
                depth, self.leaf_depth = self.leaf_depth, 1  # the handler's reads are not traced as ops
                try:
                    self._trace_leaf(module, mname, (x,), {}, out)
                finally:
                    self.leaf_depth = depth
                return True
        return False

    def _traced_forward(self, module: nn.Module, name: str) -> Any:
        """``module.forward`` wrapped to count the leaf depth and trace the leaf after it ran: what the
        pre- and post-hook pair does, without the hooked call path (for modules without forward hooks,
        whose output is then exactly what forward returns)."""
        forward = module.forward
        tracer = self

        def traced_forward(*args: Any, **kwargs: Any) -> Any:
            tracer.leaf_depth += 1
            output = forward(*args, **kwargs)
            tracer.leaf_depth -= 1
            if tracer.leaf_depth == 0:
                tracer._trace_leaf(module, name, args, kwargs, output)
            return output

        return traced_forward

    def _through_forward(self, module: nn.Module, name: str) -> Any:
        """``module.forward`` wrapped for a module whose forward replaces its handler's class's: a call
        that computes what that class's forward computes is traced as one layer (FalconLinear's
        ``x @ W.T + b``, timm's last-dimension LayerNorm); any other is followed op by op, with
        ``name`` recorded as running (its functional calls see it, :meth:`through_call`)."""
        forward = module.forward
        tracer, running = self, self.running

        def through_forward(*args: Any, **kwargs: Any) -> Any:
            if tracer.leaf_depth:
                return forward(*args, **kwargs)
            own = tracer._as_parent(module, forward, args, kwargs)
            if own is not None:
                tracer._trace_leaf(module, name, args, kwargs, own)
                return own
            running.append(name)
            try:
                return forward(*args, **kwargs)
            finally:
                running.pop()

        return through_forward

    def _as_parent(self, module: nn.Module, forward: Any, args: tuple, kwargs: dict) -> Optional[Tensor]:
        """The module's output, when its handler's class's forward gives the same on these inputs; else None."""
        cls = self.registry.registered_class(module)

        def fresh(a: Any) -> Any:  # a forward that writes into its input must not change the traced run's
            return a.clone() if isinstance(a, Tensor) else a

        try:
            with torch._C.DisableTorchFunction():
                own = forward(*map(fresh, args), **{k: fresh(v) for k, v in kwargs.items()})
                ref = cls.forward(module, *map(fresh, args), **{k: fresh(v) for k, v in kwargs.items()})
        except Exception:  # the class's forward does not take these inputs: not that layer
            return None
        if not (isinstance(own, Tensor) and isinstance(ref, Tensor)) or own.shape != ref.shape or own.dtype != ref.dtype:
            return None
        scale = float(ref.abs().max()) if ref.numel() else 0.0
        return own if torch.allclose(own, ref, rtol=1e-5, atol=1e-6 * max(scale, 1e-12)) else None

    # ---- run
    def run(self, example_inputs: Any, ignored: Sequence[str]) -> Any:
        """Run the model once on ``example_inputs``, tracing it; returns the model's output.

        Afterwards the channels of the output and of the ``ignored`` modules are blocked,
        and the model is exactly as before (hooks, wrappers, training flags and the fused
        attention switch put back, also when the run fails).
        """
        self._choose_handlers()
        self._hooks, self._wrapped = [], []
        self._was_training = [(m, m.training) for _, m in self.named]
        args, kwargs = split_inputs(example_inputs)
        # No autograd: nothing here needs gradients, and recording them costs about a
        # quarter of the forward pass. Fused inference fast paths (nn.MultiheadAttention,
        # nn.TransformerEncoder[Layer]) stay off: they are skipped whenever a torch function
        # mode is active, and the fast-path switch is turned off as well while tracing.
        self._fastpath = torch.backends.mha.get_fastpath_enabled()
        output = run_then_clean(functools.partial(self._traced, args, kwargs), self._cleanup)
        for t in tensors_in(flatten_output(output)):
            s = self.shadow(t)
            if s is not None:
                self.block(s, OUTPUT_REASON)
        self._balance_parts()
        for name in ignored:
            for (mname, sname), info in list(self.slots.items()):
                if mname == name or mname.startswith(name + "."):
                    self.block(self.slot(mname, sname), f"module '{mname}' is in ignored_layers")
            if name in self.handlers:
                for sname in self.handlers[name].slots(self.by_name[name]):
                    self.block(self.slot(name, sname), f"module '{name}' is in ignored_layers")
        self.shadows.clear()
        return output

    def _balance_parts(self) -> None:
        """Block every unit that has not as many channels in each part of a cut into equal parts (the
        parts' bounds follow the size, so they stay right only when each part loses as many)."""
        if not self.parts:
            return
        roots = self.uf.solve()
        for ids, reason in self.parts:
            k = ids.shape[0]
            valid = ids >= 0
            r = roots.index_select(0, ids.clamp_min(0).reshape(-1)).view(k, -1)
            part = torch.arange(k).view(-1, 1).expand_as(r)
            counts = torch.zeros(self.uf.n * k, dtype=torch.long)
            counts.index_add_(0, (r * k + part)[valid], torch.ones(int(valid.sum()), dtype=torch.long))
            counts = counts.view(-1, k)
            uneven = (counts.max(dim=1).values != counts.min(dim=1).values).nonzero().view(-1)
            if uneven.numel():
                self.block(uneven, reason)
        self.parts.clear()

    def _choose_handlers(self) -> None:
        """The handled modules (the outermost module with a handler) and their slot descriptions."""
        for name, module in self.named:
            h = self.registry.lookup(module)
            # a module inside a leaf is part of it (named_modules lists parents first)
            parts = name.split(".")
            if h is not None and not any(
                p in self.handlers and p not in self.through for p in (".".join(parts[:i]) for i in range(1, len(parts)))
            ):
                self.handlers[name] = h
                if not self.registry.traces_forward(module):
                    self.through[name] = module
        # Every leaf's slots described now, in one warm loop: inside the forward pass each
        # description would run right after a layer's compute has pushed it out of the caches.
        for name, h in self.handlers.items():
            try:
                self._specs[name] = h.slots(self.by_name[name])
            except Exception:  # described again when the module runs, and raised there as before
                pass

    def _traced(self, args: tuple, kwargs: dict) -> Any:
        """The traced forward pass; a failure becomes a :class:`TraceError` naming the op and the module."""
        try:
            # hooks and eval mode inside the body: an interrupt while installing them removes them too
            self._install()
            if any(t for _, t in self._was_training):
                self.model.eval()
            torch.backends.mha.set_fastpath_enabled(False)
            with torch.no_grad(), _TracingMode(self):
                return self.model(*args, **kwargs)
        except TraceError:
            raise
        except Exception as exc:
            failed = getattr(exc, "_prunekit_op", self.last_op)
            tb = exc.__traceback__
            while tb is not None and tb.tb_next is not None:
                tb = tb.tb_next  # the innermost frame: where the forward pass failed
            where = self.stack[-1] if self.stack else self._module_of(tb.tb_frame if tb else None)
            raise TraceError(
                f"the model's forward pass failed while prunekit traced it, at op '{failed}' in module "
                f"'{where}': {type(exc).__name__}: {exc}. Check that example_inputs are what "
                "model(*example_inputs) accepts."
            ) from exc

    def _install(self) -> None:
        """Wrap the forward of every handled module (forward hooks where hooks may replace its output),
        each recorded for :meth:`_cleanup` as it is installed."""
        plain = not getattr(global_module_hooks, "_global_forward_hooks", True)  # no hook replaces any output
        for name in self.handlers:
            module = self.by_name[name]
            if name in self.through:
                wrapper = self._through_forward(module, name)
                self._wrapped.append((module, module.__dict__.get("forward", _NO_FORWARD), wrapper))
                module.__dict__["forward"] = wrapper
            elif plain and not module._forward_hooks:
                wrapper = self._traced_forward(module, name)
                self._wrapped.append((module, module.__dict__.get("forward", _NO_FORWARD), wrapper))
                module.__dict__["forward"] = wrapper
            else:  # forward hooks may replace the output: trace what they return
                self._hooks.append(module.register_forward_pre_hook(self._pre, with_kwargs=True))
                self._hooks.append(module.register_forward_hook(self._post, with_kwargs=True))

    def _cleanup(self) -> None:
        """Undo :meth:`_traced`'s changes to the model; idempotent: run again if an interrupt cuts it short."""
        torch.backends.mha.set_fastpath_enabled(self._fastpath)
        hooks, wrapped = self._hooks, self._wrapped
        while hooks:
            hooks[-1].remove()
            hooks.pop()
        while wrapped:  # the instance's own forward attribute back as it was (usually none)
            module, before, wrapper = wrapped[-1]
            if module.__dict__.get("forward") is wrapper:
                if before is _NO_FORWARD:
                    del module.__dict__["forward"]
                else:
                    module.__dict__["forward"] = before
            wrapped.pop()
        for m, t in self._was_training:
            if m.training != t:
                m.training = t
        self.stack.clear()
        self.running.clear()
        self.leaf_depth = 0


class _TracingMode(TorchFunctionMode):
    """Sends every torch function called between leaves to the tracer's op rules."""

    def __init__(self, tracer: Tracer) -> None:
        super().__init__()
        self._tracer = tracer
        self._op_names: Dict[Any, str] = {}

    def _name_of(self, func: Any) -> str:
        """:func:`~prunekit.compact.trace.ops.op_name`, cached per function (an unhashable one is named again)."""
        try:
            return self._op_names[func]
        except (KeyError, TypeError):  # first call of this function (or unhashable)
            name = op_name(func)
            try:
                self._op_names[func] = name
            except TypeError:
                pass
            return name

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        try:
            out = func(*args, **kwargs)
        except Exception as exc:
            if not hasattr(exc, "_prunekit_op"):
                setattr(exc, "_prunekit_op", self._name_of(func))  # the innermost failing op names the error
            raise
        tracer = self._tracer
        if tracer.leaf_depth == 0:  # inside a leaf its handler speaks for the ops
            name = self._name_of(func)
            tracer.last_op = name
            tracer.on_op(func, args, kwargs, out, name)
        return out
