"""How each kind of torch operation moves channel labels (the tracer's op rules).

:meth:`OpRules.on_op` looks an operation up by name in :data:`RULES` (each op table of
:mod:`prunekit.compact.trace.ops` mapped to its rule) and applies the rule to the shadows
of its inputs. A rule that meets a call it cannot prove safe blocks the channels
involved, with a reason naming the op and the module; an op in no table blocks them all.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterable, List, Optional, Tuple

import torch
from torch import Tensor

from . import shadows as lbl
from ..proofs.constants import ConstMap, apply_pointwise, by_label, keep_zeros, lookup, merge
from ..errors import TraceError
from .cuts import CUT_OPS, cuts
from .functional import FUNCTIONAL
from .ops import base_name
from .ops import CAT, HARMLESS_MUTATORS, MATMUL, MULTI, POINTWISE, POOL, REDUCE, SAME, SAME_LABELS, SHAPE, SOFTMAX, op_name, tensors_in

_SAME_VALUE_REDUCTIONS = frozenset({"mean", "nanmean", "amax", "amin", "max", "min"})
_PRODUCTS = frozenset({"mul", "__mul__", "__rmul__", "__imul__"})
_NUMERATOR_ONLY = frozenset({"div", "true_divide", "__truediv__", "__itruediv__", "__div__"})
_ZERO_KEEPING = _PRODUCTS | _NUMERATOR_ONLY

if TYPE_CHECKING:  # pragma: no cover
    from .unionfind import UnionFind

logger = logging.getLogger(__name__)

__all__ = ["RULES", "OpRules", "Rule"]


class OpRules:
    """The op rules, mixed into :class:`~prunekit.compact.trace.tracer.Tracer` (they use its shadows and union-find)."""

    # provided by Tracer (its attributes, and below its methods the rules call)
    running: List[str]
    parts: List[Tuple[Tensor, str]]
    through_call: Callable[[str, tuple, dict, Any], bool]
    shadows: Dict[int, Tuple[Any, Tensor, Tensor]]
    uf: "UnionFind"
    last_op: str
    consts: Dict[int, Any]

    if TYPE_CHECKING:  # pragma: no cover

        @property
        def where(self) -> str: ...
        def shadow(self, t: Any) -> Optional[Tensor]: ...
        def entry_of(self, t: Tensor) -> Optional[Tuple[Any, Tensor, Tensor]]: ...
        def consts_of(self, t: Any) -> Optional[ConstMap]: ...
        def set_consts(self, t: Tensor, cm: Optional[ConstMap]) -> None: ...
        def set_shadow(
            self, t: Tensor, s: Optional[Tensor], canonical: bool = False, labeled: bool = False,
            core: Optional[Tensor] = None,
        ) -> None: ...
        def union(self, a: Tensor, b: Tensor) -> None: ...
        def block(self, ids: Any, reason: str) -> None: ...

    def on_op(self, func: Any, args: tuple, kwargs: dict, out: Any, name: Optional[str] = None) -> None:
        """Move the labels (and known constants) of ``func(*args, **kwargs)``'s inputs to its output ``out``."""
        if name is None:
            name = op_name(func)
        self.last_op = name
        if (
            len(args) == 1 and not kwargs and name in SAME_LABELS and isinstance(out, Tensor) and isinstance(args[0], Tensor)
        ):  # relu(x), x.float(), ...: the output has the input's labels (the common case)
            x = args[0]
            entry = self.shadows.get(id(x))
            if entry is None or entry[0]() is not x:
                return  # not a channel tensor: nothing to record
            if out.shape == x.shape:
                self.set_shadow(out, entry[1], core=entry[2], labeled=True)
                if self.consts and self.consts_of(x) is not None:
                    self._consts_pointwise(name, func, args, kwargs, out)
                return
        if self.running and name in FUNCTIONAL and self.through_call(name, args, kwargs, out):
            return  # a layer's functional form inside its module's own forward: its handler traced it
        ins = [t for t in tensors_in((args, kwargs)) if self.shadow(t) is not None]
        if not ins:
            return
        base = base_name(name)
        outs = tensors_in(out)
        rule = RULES.get(base)
        if rule is None and not outs and base not in HARMLESS_MUTATORS and not name.endswith("_") and name not in (
            "__setitem__",
            "copy_",
        ):
            return  # a query (size, dim, item, ...) on a channel tensor: harmless
        try:
            if rule is None:
                self._unknown(name, ins, outs)
            else:
                rule(self, func, name, args, kwargs, out)
            if self.consts:
                self._propagate_consts(base, name, func, args, kwargs, out, outs)
        except TraceError:
            raise
        except Exception as exc:  # a rule failed on an unusual call: be conservative
            logger.debug("shadow rule for %s failed: %s", name, exc)
            self._unknown(name, ins, outs)

    # ---- constants (mask propagation): see prunekit.compact.proofs.constants
    def _propagate_consts(self, base: str, name: str, func: Any, args: tuple, kwargs: dict, out: Any, outs: List[Tensor]) -> None:
        known = [cm for cm in map(self.consts_of, tensors_in((args, kwargs))) if cm is not None]
        if not known or not outs:
            return
        if base in POINTWISE:
            self._consts_pointwise(name, func, args, kwargs, out)
            return
        cm: Optional[ConstMap] = None
        if base in SAME or base in SHAPE or base in MULTI or base in CAT:
            cm = merge(*known)  # elements move, values stay
        elif base in REDUCE:
            cm = merge(*known) if base in _SAME_VALUE_REDUCTIONS else (None if base == "logsumexp" else keep_zeros(merge(*known)))
        elif base in POOL:
            cm = merge(*known) if base.startswith(("max", "adaptive", "interpolate", "upsample", "_max")) else keep_zeros(merge(*known))
        elif base in MATMUL or base == "scaled_dot_product_attention":
            cm = keep_zeros(merge(*known))  # weighted sums of zeros
        if cm is None:
            return
        for o in outs:
            if self.shadow(o) is not None:
                self.set_consts(o, cm)

    def _consts_pointwise(self, name: str, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        if not isinstance(out, Tensor) or self.shadow(out) is None:
            return
        operands = [("arg", i, a) for i, a in enumerate(args) if isinstance(a, Tensor)]
        operands += [("kw", k, v) for k, v in kwargs.items() if isinstance(v, Tensor)]
        labeled = [op for op in operands if self.shadow(op[2]) is not None]
        others = [op for op in operands if self.shadow(op[2]) is None]
        base = base_name(name)
        zero_kept = base in _ZERO_KEEPING
        if len(labeled) == 1 and all(t.numel() == 1 for _, _, t in others):
            where, key, t = labeled[0]
            cm = self.consts_of(t)
            if cm is None:
                return
            vals = apply_pointwise(func, args, kwargs, [(where, key)], [cm[1].to(t.dtype)])
            if vals is None:
                return
            ok = ~torch.isnan(vals)
            self.set_consts(out, (cm[0][ok], vals[ok]) if bool(ok.any()) else None)
        elif len(labeled) == 1:  # with a tensor that varies: x * mask keeps zeros at most
            cm = self.consts_of(labeled[0][2])
            if zero_kept and (base not in _NUMERATOR_ONLY or labeled[0][:2] == ("arg", 0)):
                self.set_consts(out, keep_zeros(cm))
        elif len(labeled) == 2 and not others:
            (wa, ka, a), (wb, kb, b) = labeled
            sa, sb = self._labels(a), self._labels(b)
            shape = out.shape
            full = [s.expand(shape) if s.shape != shape else s for s in (sa, sb)]
            ca, cb = (c.reshape(-1) for c in lbl.squeeze_constant(*full))
            va, vb = lookup(self.consts_of(a), ca), lookup(self.consts_of(b), cb)
            res: Optional[Tensor]
            if base in _PRODUCTS:
                res = va * vb
                res[(va == 0) | (vb == 0)] = 0.0  # zero times anything finite
            else:
                res = apply_pointwise(func, args, kwargs, [(wa, ka), (wb, kb)], [va.to(a.dtype), vb.to(b.dtype)])
                if res is None:
                    return
            self.set_consts(out, by_label(torch.where(ca >= 0, ca, cb), res))

    def _unknown(self, name: str, ins: List[Tensor], outs: List[Tensor]) -> None:
        reason = f"op '{name}' in module '{self.where}' is not understood by the channel tracer"
        for t in ins:
            self.block(self.shadow(t), reason)
        for o in outs:
            self.set_shadow(o, None)

    def _operand(self, a: Any, shape: torch.Size) -> Optional[Tuple[Tensor, torch.Size]]:
        if isinstance(a, Tensor):
            s = self.shadow(a)
            if s is None:
                s = lbl.fixed(a.shape)
            return s, a.shape
        return None

    def _labels(self, t: Any) -> Tensor:
        """The shadow of ``t``; a RuntimeError when it has none (the rule does not apply: on_op blocks the op)."""
        s = self.shadow(t)
        if s is None:
            raise RuntimeError(f"no channel labels on an operand of {self.last_op}")
        return s

    # ---- the rules (one per op table: see RULES below)
    def _pointwise(self, func: Any, name: str, args: tuple, kwargs: dict, out: Any) -> None:
        if not isinstance(out, Tensor):
            return
        shape = out.shape
        tensors = [a for a in args if isinstance(a, Tensor)] + [a for a in kwargs.values() if isinstance(a, Tensor)]
        if len(tensors) == 1 and tensors[0].shape == shape:  # relu(x), x * 2.0, ...: same labels
            entry = self.entry_of(tensors[0])
            if entry is None:
                self.set_shadow(out, None)
            else:
                self.set_shadow(out, entry[1], core=entry[2], labeled=True)
            return
        if len(tensors) == 2 and self._same_labels_add(tensors[0], tensors[1], shape, out):
            return
        operands = [op for op in (self._operand(a, shape) for a in list(args) + list(kwargs.values())) if op is not None]
        # stored shadows always hold an id >= 0; tensors without one got the all -1 lbl.fixed()
        labeled = [(s, sh) for s, sh in operands if not lbl.is_fixed(s)]
        if not labeled:
            self.set_shadow(out, None)
            return
        full = [s.expand(shape) if s.shape != shape else s for s, _ in labeled]
        # varying dims of each labeled operand (in output coordinates)
        for s, sh in operands:
            if any(s is ls for ls, _ in labeled):
                continue
            # a fixed operand: fine if it is constant along every channel dimension
            nd = len(shape)
            padded = [1] * (nd - len(sh)) + list(sh)
            for ls in full:
                for d in lbl.varying_dims(ls):
                    if padded[d] > 1:
                        self.block(ls, f"op '{name}' in module '{self.where}' combines channels with a fixed tensor that varies along them")
                        break
        full = lbl.squeeze_constant(*full)
        base = full[0]
        for other in full[1:]:
            self.union(base, other)
            base = torch.where(base >= 0, base, other)
            # positions labeled on one side only: the unlabeled side is an activation
            # without channel ids that varies along the channel -> not removable
            one_sided = (full[0] >= 0) != (other >= 0)
            if bool(one_sided.any()):
                self.block(base[one_sided], f"op '{name}' in module '{self.where}' adds channels to fixed values")
        self.set_shadow(out, base.expand(shape))

    def _same_labels_add(self, a: Tensor, b: Tensor, shape: torch.Size, out: Tensor) -> bool:
        """The residual add: two labeled operands of the output's shape whose labels vary along
        the same dims and are all ids. Their cores are joined and ``out`` takes ``a``'s labels,
        as the general rule would give, on the small cores only. False when this does not apply."""
        if a.shape != shape or b.shape != shape:
            return False
        ea, eb = self.entry_of(a), self.entry_of(b)
        if ea is None or eb is None or ea[2].shape != eb[2].shape or ea[2].numel() == 0:
            return False
        ca, cb = ea[2], eb[2]
        if ca is not cb:
            if int(torch.minimum(ca, cb).min()) < 0:
                return False  # some positions hold no id: the general rule decides
            self.union(ca, cb)
        elif int(ca.min()) < 0:
            return False
        self.set_shadow(out, ea[1], core=ca, labeled=True)
        return True

    def _same(self, func: Any, name: str, args: tuple, kwargs: dict, out: Any) -> None:
        """dtype and device changes: the output has the input's labels."""
        entry = self.entry_of(args[0]) if isinstance(args[0], Tensor) else None
        if isinstance(out, Tensor) and entry is not None and out.shape == args[0].shape:
            self.set_shadow(out, entry[1], core=entry[2], labeled=True)

    def _cut(self, name: str, args: tuple, kwargs: dict, out: Any) -> None:
        """Block the channels a cut at positions fixed in the model's code would move; record cuts into
        equal parts for the check once channels are grouped (see :mod:`prunekit.compact.trace.cuts`)."""
        entry = self.entry_of(args[0]) if isinstance(args[0], Tensor) else None
        if entry is None:
            return
        core = entry[2]
        varying = lbl.varying_dims(core)
        if not varying:
            return
        found = [c for c in cuts(name, args, kwargs, out) if c.dim in varying]
        for c in found:
            n = args[0].shape[c.dim]
            where = self.where
            if c.unsafe is not None:
                if bool(c.unsafe.any()):
                    self.block(core.index_select(c.dim, c.unsafe.nonzero().view(-1)),
                               f"op '{name}' in module '{where}' takes {c.what} of {n} channels, at positions fixed in "
                               "the model's code that compaction cannot move")
            elif len(varying) == 1:
                self.parts.append((core.reshape(c.parts, -1), f"op '{name}' in module '{where}' cuts {n} channels "
                                   f"into {c.parts} equal parts: a unit that would not lose as many channels in every "
                                   "part stays"))
            else:
                self.block(core, f"op '{name}' in module '{where}' cuts channels that vary along several dimensions "
                                 "into parts")

    def _multi(self, func: Any, name: str, args: tuple, kwargs: dict, out: Any) -> None:
        """split, chunk, unbind: each piece of the output is the same piece of the input's shadow."""
        self._cut(name, args, kwargs, out)
        res = func(self.shadow(args[0]), *args[1:], **kwargs)
        for o, s in zip(out, res):
            self.set_shadow(o, s)

    def _shape(self, func: Any, name: str, args: tuple, kwargs: dict, out: Any) -> None:
        if not isinstance(out, Tensor):
            return
        s_in = self.shadow(args[0])
        if s_in is None:
            self.set_shadow(out, None)
            return
        if name in CUT_OPS:
            self._cut(name, args, kwargs, out)
        try:
            res = func(s_in, *args[1:], **kwargs)
        except RuntimeError:  # e.g. view() of an expanded shadow
            res = func(s_in.contiguous(), *args[1:], **kwargs)
        if not isinstance(res, Tensor) or res.shape != out.shape:
            raise RuntimeError("shape rule mismatch")
        name = op_name(func)
        if name in ("view", "reshape", "unflatten", "view_as", "reshape_as") and len(lbl.varying_dims(res)) > len(
            lbl.varying_dims(s_in)
        ):
            self.block(
                s_in,
                f"op '{name}' in module '{self.where}' splits a channel dimension (e.g. into heads); "
                "register a handler for this module to prune it",
            )
            self.set_shadow(out, None)
            return
        self.set_shadow(out, res)

    def _cat(self, func: Any, name: str, args: tuple, kwargs: dict, out: Any) -> None:
        seq = args[0]
        shadows = []
        for t in seq:
            s = self.shadow(t)
            shadows.append(s if s is not None else lbl.fixed(t.shape))
        # positions that came from a fixed tensor stay -1; consumers block them
        if op_name(func) in ("cat", "concat", "concatenate") and isinstance(out, Tensor) and len(
            {s.dim() for s in shadows}
        ) == 1 and shadows[0].dim():
            cdim = kwargs.get("dim", args[1] if len(args) > 1 else 0) % shadows[0].dim()
            # narrow the dims constant in every piece (not the cat dim): the result is the same view
            narrow = [
                d for d in range(shadows[0].dim()) if d != cdim and all(s.shape[d] > 1 and s.stride(d) == 0 for s in shadows)
            ]
            small = [s for s in shadows]
            for d in narrow:
                small = [s.narrow(d, 0, 1) for s in small]
            res = torch.cat(small, dim=cdim).expand(out.shape)
        else:
            res = func(shadows, *args[1:], **kwargs)
        self.set_shadow(out, res)

    def _softmax(self, func: Any, name: str, args: tuple, kwargs: dict, out: Any) -> None:
        s = self._labels(args[0])
        dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
        if dim is None or not isinstance(out, Tensor):
            raise RuntimeError("softmax without dim")
        if (dim % s.dim()) in lbl.varying_dims(s):
            self.block(s, f"op '{name}' in module '{self.where}' normalizes across channels")
            self.set_shadow(out, None)
        else:
            self.set_shadow(out, s, canonical=True)

    def _reduce(self, func: Any, name: str, args: tuple, kwargs: dict, out: Any) -> None:
        x = args[0]
        dim = kwargs.get("dim", args[1] if len(args) > 1 and not isinstance(args[1], bool) else None)
        keepdim = kwargs.get("keepdim", args[2] if len(args) > 2 and isinstance(args[2], bool) else False)
        value = out[0] if isinstance(out, tuple) else out
        if not isinstance(value, Tensor):
            return
        if name in ("norm",) and dim is None and len(args) > 2:
            dim = args[2]
        s = self._labels(x)
        dims = list(range(s.dim())) if dim is None else ([dim] if isinstance(dim, int) else list(dim))
        dims = sorted({d % s.dim() for d in dims})
        varying = lbl.varying_dims(s)
        if any(d in varying for d in dims):
            self.block(s, f"op '{name}' in module '{self.where}' reduces across channels")
            self.set_shadow(value, None)
            return
        r = s
        for d in reversed(dims):
            r = r.narrow(d, 0, 1)
            if not keepdim:
                r = r.squeeze(d)
        r = r.reshape(value.shape)
        self.set_shadow(value, r)
        if isinstance(out, tuple):
            for o in out[1:]:
                self.set_shadow(o, None)

    def _pool(self, func: Any, name: str, args: tuple, kwargs: dict, out: Any) -> None:
        s = self._labels(args[0])
        value = out[0] if isinstance(out, tuple) else out
        if s.dim() < 2:
            raise RuntimeError("pool on 1-d")
        # channel-wise ops over trailing spatial dims: labels must not vary spatially
        lead = 2 if value.dim() == s.dim() and s.dim() >= 3 else 1
        if torch.Size(s.shape[lead:]).numel() and any(d >= lead for d in lbl.varying_dims(s)):
            self.block(s, f"op '{name}' in module '{self.where}' pools across channels")
            self.set_shadow(value, None)
            return
        r = s
        for _ in range(lead, s.dim()):
            r = r.select(lead, 0)
        r = r.reshape(r.shape + (1,) * (value.dim() - r.dim())).expand(value.shape)
        self.set_shadow(value, r)
        if isinstance(out, tuple):
            for o in out[1:]:
                self.set_shadow(o, None)

    def _pad(self, func: Any, name: str, args: tuple, kwargs: dict, out: Any) -> None:
        """F.pad: trailing dims grow; fine where the labels do not vary along them (spatial padding)."""
        entry = self.entry_of(args[0])
        pad = kwargs.get("pad", args[1] if len(args) > 1 else None)
        if entry is None or not isinstance(out, Tensor) or pad is None:
            raise RuntimeError("pad operands")
        core = entry[2]
        padded = range(core.dim() - len(pad) // 2, core.dim())
        if any(d in lbl.varying_dims(core) for d in padded):
            self.block(core, f"op '{name}' in module '{self.where}' pads a channel dimension")
            self.set_shadow(out, None)
            return
        self.set_shadow(out, core.expand(out.shape), core=core, labeled=True)

    def _contract(self, name: str, a: Tensor, b: Tensor) -> Tuple[Tensor, Tensor, bool, bool]:
        """Union the contracted dims of a @ b; returns broadcast shadows and whether each varies."""
        sa = self.shadow(a)
        sb = self.shadow(b)
        sa = sa if sa is not None else lbl.fixed(a.shape)
        sb = sb if sb is not None else lbl.fixed(b.shape)
        if sa.dim() < 2 or sb.dim() < 2:
            raise RuntimeError("1-d matmul")
        va = (sa.dim() - 1) in lbl.varying_dims(sa)
        vb = (sb.dim() - 2) in lbl.varying_dims(sb)
        if va or vb:
            # rows of a (..., n, k) against columns of b (..., k, m), per contracted index
            ca = lbl.core(sa, keep=(sa.dim() - 1,))  # constant dims add no new columns
            cb = lbl.core(sb, keep=(sb.dim() - 2,))
            ra = torch.unique(ca.movedim(-1, 0).reshape(ca.shape[-1], -1), dim=1)  # (k, ra)
            rb = torch.unique(cb.movedim(-2, 0).reshape(cb.shape[-2], -1), dim=1)  # (k, rb)
            pa = ra.unsqueeze(2).expand(-1, -1, rb.shape[1])
            pb = rb.unsqueeze(1).expand(-1, ra.shape[1], -1)
            pairs = torch.stack([pa.reshape(-1), pb.reshape(-1)], dim=1)
            one_sided = (pairs[:, 0] >= 0) != (pairs[:, 1] >= 0)
            if bool(one_sided.any()):
                self.block(pairs[one_sided].max(dim=1).values, f"op '{name}' in module '{self.where}' contracts channels with fixed values")
            self.uf.union_pairs(pairs)
        return sa, sb, va, vb

    def _matmul(self, func: Any, name: str, args: tuple, kwargs: dict, out: Any) -> None:
        a, b = args[0], args[1]
        if name == "__rmatmul__":
            a, b = b, a
        if not (isinstance(a, Tensor) and isinstance(b, Tensor) and isinstance(out, Tensor)):
            raise RuntimeError("matmul operands")
        sa, sb, va, vb = self._contract(name, a, b)
        rows = None if va else sa.narrow(-1, 0, 1)  # (..., n, 1)
        cols = None if vb else sb.narrow(-2, 0, 1)  # (..., 1, m)
        res = self._free_labels(name, rows, cols, out)
        self.set_shadow(out, res)

    def _free_labels(self, name: str, rows: Optional[Tensor], cols: Optional[Tensor], out: Tensor) -> Optional[Tensor]:
        rl = rows is not None and bool((rows >= 0).any())
        cl = cols is not None and bool((cols >= 0).any())
        if rl and cl:
            self.block(rows, f"op '{name}' in module '{self.where}' forms an outer product of channels")
            self.block(cols, f"op '{name}' in module '{self.where}' forms an outer product of channels")
            return None
        if rl and rows is not None:
            return rows.expand(out.shape)
        if cl and cols is not None:
            return cols.expand(out.shape)
        return None

    def _sdpa(self, func: Any, name: str, args: tuple, kwargs: dict, out: Any) -> None:
        names = ["query", "key", "value", "attn_mask"]
        vals = dict(zip(names, args))
        vals.update({k: v for k, v in kwargs.items() if k in names})
        q, k, v = vals["query"], vals["key"], vals["value"]
        self._contract("scaled_dot_product_attention", q, k.transpose(-2, -1))  # q . k over the last dims
        sv = self.shadow(v)
        if sv is None:
            self.set_shadow(out, None)
            return
        if (sv.dim() - 2) in lbl.varying_dims(sv):
            self.block(sv, f"op 'scaled_dot_product_attention' in module '{self.where}' mixes value channels across tokens")
            self.set_shadow(out, None)
            return
        cols = sv.narrow(-2, 0, 1)
        self.set_shadow(out, cols.expand(out.shape))


#: A rule: how one op moves the labels of its inputs to its outputs (``rule(tracer, func, name, args,
#: kwargs, out)``; ``name`` is the op's name as called, e.g. ``"add_"``).
Rule = Callable[[OpRules, Any, str, tuple, dict, Any], None]


def _table(*tables: Tuple[Iterable[str], Rule]) -> Dict[str, Rule]:
    """One dict from op name to rule (an op named by two tables gets the first one's rule)."""
    out: Dict[str, Rule] = {}
    for names, rule in tables:
        for n in names:
            out.setdefault(n, rule)
    return out


#: op (out-of-place name, see :func:`~prunekit.compact.trace.ops.base_name`) -> its rule; an op in no
#: table blocks the channels it touches (a query such as ``size`` that returns no tensor excepted)
RULES: Dict[str, Rule] = _table(
    (POINTWISE, OpRules._pointwise),
    (SAME, OpRules._same),
    (SHAPE, OpRules._shape),
    (MULTI, OpRules._multi),
    (CAT, OpRules._cat),
    (SOFTMAX, OpRules._softmax),
    (REDUCE, OpRules._reduce),
    (POOL, OpRules._pool),
    (("pad",), OpRules._pad),
    (MATMUL, OpRules._matmul),
    (("scaled_dot_product_attention",), OpRules._sdpa),
)
