"""Whether a module's new sizes agree: with its tensors' shapes, its compaction handler and its own invariants.

A compaction description says which shapes and size attributes change. These checks
decide, without changing or allocating anything, whether the changes are ones
compaction could have made:

* :func:`slot_sizes` -- the new size of each of the handler's slots, read off the new
  tensor shapes (a slot's entries say which axis of which tensor it spans);
* :func:`expected_attrs` -- what the handler sets for those sizes, and which of its
  attributes the shapes determine;
* :func:`check_size_value` -- an attribute's new value: a size of the same type, no larger;
* :func:`check_layer` -- a layer's invariants (a Linear's features are its weight's
  shape, a convolution's channels divide by its groups, an attention's heads times the
  head size is the width of all heads, ...).

A refusal is an :class:`Inconsistent` exception with the reason;
:mod:`prunekit.compact.surgery.rebuild` names the file and the module.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Set, Tuple

from torch import Tensor, nn

from ..handlers import ModuleHandler

__all__ = ["Inconsistent", "check_layer", "check_size_value", "current_shape", "expected_attrs", "plain", "resolve",
           "slot_sizes", "tensor_of"]


class Inconsistent(Exception):
    """Why a described change is not one compaction makes (the caller names the file and the module)."""


def tensor_of(owner: nn.Module, leaf: str) -> Optional[Tensor]:
    """The parameter or buffer ``leaf`` of ``owner`` (never a computed attribute), or None.

    Examples:
        >>> from torch import nn
        >>> tensor_of(nn.Linear(2, 3), "weight").shape, tensor_of(nn.Linear(2, 3), "forward")
        (torch.Size([3, 2]), None)
    """
    if leaf in owner._parameters:
        return owner._parameters[leaf]
    if leaf in owner._buffers:
        return owner._buffers[leaf]
    return None


def resolve(module: nn.Module, path: str) -> Tuple[nn.Module, str]:
    """The submodule that owns the dotted ``path`` and the last name in it (only submodules are walked).

    Examples:
        >>> from torch import nn
        >>> m = nn.Sequential(nn.Linear(2, 3))
        >>> resolve(m, "0.in_features")[0] is m[0], resolve(m, "0.in_features")[1]
        (True, 'in_features')
    """
    prefix, _, leaf = path.rpartition(".")
    try:
        owner = module.get_submodule(prefix) if prefix else module
    except AttributeError:
        raise Inconsistent(f"path {path!r}: {type(module).__name__} has no submodule {prefix!r}") from None
    return owner, leaf


def plain(v: Any) -> Any:
    """A value as JSON holds it (tuples become lists), for comparisons.

    Examples:
        >>> plain((4,)), plain(4)
        ([4], 4)
    """
    return list(v) if isinstance(v, (tuple, list)) else v


# ----------------------------------------------------------------------------- sizes from shapes
def slot_sizes(handler: ModuleHandler, module: nn.Module, shape_of: Callable[[str], Optional[Tuple[int, ...]]]
               ) -> Tuple[Dict[str, int], Dict[str, int], Set[str]]:
    """``(original sizes, new sizes the tensors determine, slots they do not)`` of a module's slots.

    ``shape_of(path)`` gives a tensor's new shape. Each axis of a tensor that slots span
    holds their sizes (plus any part no slot covers), so an axis spanned by one slot
    whose size is not yet known gives it; every axis must agree.

    Examples:
        >>> from torch import nn
        >>> from prunekit.compact import REGISTRY
        >>> lin = nn.Linear(8, 16)
        >>> new = {"weight": (4, 8), "bias": (4,)}
        >>> slot_sizes(REGISTRY.lookup(lin), lin, lambda p: new.get(p, current_shape(lin, p)))
        ({'in': 8, 'out': 16}, {'in': 8, 'out': 4}, set())
    """
    slots = handler.slots(module)
    base = {s: spec.size for s, spec in slots.items()}
    groups: Dict[Tuple[str, int], Dict[str, int]] = {}
    for sname, spec in slots.items():
        for e in spec.entries:
            g = groups.setdefault((e.path, e.axis), {})
            g[sname] = g.get(sname, 0) + 1
    shapes = {k: current_shape(module, k[0]) for k in groups}
    current = {k: shape for k, shape in shapes.items() if shape is not None}
    groups = {k: g for k, g in groups.items() if k in current}

    def new_shape(path: str) -> Tuple[int, ...]:
        shape = shape_of(path)
        if shape is None:
            raise Inconsistent(f"tensor {path!r} has no new shape")
        return shape

    def left(key: Tuple[str, int], mult: Dict[str, int]) -> int:  # new axis size minus what known slots take
        path, axis = key
        rest = current[key][axis] - sum(m * base[s] for s, m in mult.items())
        return new_shape(path)[axis] - rest - sum(m * known[s] for s, m in mult.items() if s in known)

    known: Dict[str, int] = {}
    progress = True
    while progress:
        progress = False
        for key, mult in groups.items():
            unknown = [s for s in mult if s not in known]
            if len(unknown) == 1:
                s = unknown[0]
                size, r = divmod(left(key, mult), mult[s])
                if r or not 0 <= size <= base[s]:
                    raise Inconsistent(f"tensor {key[0]!r} has {new_shape(key[0])[key[1]]} along axis {key[1]}, which no "
                                       f"size of its {s!r} dimension (at most {base[s]}) gives")
                known[s] = size
                progress = True
    for key, mult in groups.items():
        if all(s in known for s in mult) and left(key, mult) != 0:
            raise Inconsistent(f"tensor {key[0]!r} has {new_shape(key[0])[key[1]]} along axis {key[1]}; the module's other "
                               f"tensors say {new_shape(key[0])[key[1]] - left(key, mult)}")
    return base, known, {s for s in slots if s not in known}


def current_shape(module: nn.Module, path: str) -> Optional[Tuple[int, ...]]:
    """The shape of the parameter or buffer at ``path`` under ``module`` now, or None.

    Examples:
        >>> from torch import nn
        >>> current_shape(nn.Sequential(nn.Linear(2, 3)), "0.weight"), current_shape(nn.Linear(2, 3), "nope")
        ((3, 2), None)
    """
    prefix, _, leaf = path.rpartition(".")
    try:
        owner = module.get_submodule(prefix) if prefix else module
    except AttributeError:
        return None
    t = tensor_of(owner, leaf)
    return None if t is None else tuple(t.shape)


def expected_attrs(handler: ModuleHandler, module: nn.Module, shape_of: Callable[[str], Optional[Tuple[int, ...]]]
                   ) -> Tuple[Dict[str, Any], Set[str]]:
    """What the handler sets for the new shapes, and the keys the shapes determine (the rest: range checks only).

    Examples:
        >>> from torch import nn
        >>> from prunekit.compact import REGISTRY
        >>> conv = nn.Conv2d(8, 8, 3, groups=4)  # a grouped conv's input channels span no weight axis
        >>> new = {"weight": (4, 2, 3, 3), "bias": (4,)}
        >>> a, exact = expected_attrs(REGISTRY.lookup(conv), conv, lambda p: new.get(p, current_shape(conv, p)))
        >>> a["out_channels"], sorted(exact)
        (4, ['out_channels'])
    """
    base, known, unknown = slot_sizes(handler, module, shape_of)
    a = handler.attrs(module, {**base, **known})
    if not unknown:
        return a, set(a)
    exact = set(a)
    # an attribute that moves when an undetermined size moves is not determined by the shapes: probe with
    # the undetermined sizes doubled and halved (far enough apart for sizes counted in heads or groups)
    for probe in ({s: 2 * base[s] + 1 for s in unknown}, {s: base[s] // 2 for s in unknown}):
        try:
            b = handler.attrs(module, {**base, **known, **probe})
        except Exception:
            return a, set()
        exact &= {k for k in a if k in b and plain(a[k]) == plain(b[k])}
    return a, exact


# ----------------------------------------------------------------------------- invariants of layers
_AttrOf = Callable[[nn.Module, str], Any]
_ShapeOf = Callable[[nn.Module, str], Optional[Tuple[int, ...]]]


def check_layer(o: nn.Module, attr_of: _AttrOf, shape_of: _ShapeOf) -> None:
    """Refuse a layer whose size attributes and tensor shapes disagree (after the planned changes).

    ``attr_of(module, name)`` and ``shape_of(module, leaf)`` give the values as they would be.

    Examples:
        >>> from torch import nn
        >>> lin = nn.Linear(8, 16)
        >>> try:
        ...     check_layer(lin, lambda m, n: 7 if n == "in_features" else getattr(m, n), lambda m, n: (16, 8))
        ... except Inconsistent as e:
        ...     print(e)
        Linear's weight would have shape [16, 8], and its out_features/in_features say [16, 7]
    """
    def attr(leaf: str) -> Any:
        return attr_of(o, leaf)

    def want(leaf: str, expected: Tuple[int, ...], what: str) -> None:
        got = shape_of(o, leaf)
        if got is not None and tuple(got[: len(expected)]) != tuple(expected):
            raise Inconsistent(f"{type(o).__name__}'s {leaf} would have shape {list(got)}, and its {what} say {list(expected)}")

    if isinstance(o, nn.Linear):
        want("weight", (attr("out_features"), attr("in_features")), "out_features/in_features")
        want("bias", (attr("out_features"),), "out_features")
    elif isinstance(o, nn.modules.conv._ConvNd):
        g, cin, cout = attr("groups"), attr("in_channels"), attr("out_channels")
        if type(g) is not int or g < 1 or cin % g or cout % g:
            raise Inconsistent(f"{type(o).__name__} would have {cin} input and {cout} output channels in {g} groups")
        w = (cin, cout // g) if o.transposed else (cout, cin // g)
        want("weight", w, "channels and groups")
        want("bias", (cout,), "out_channels")
    elif isinstance(o, nn.modules.batchnorm._NormBase):
        for leaf in ("weight", "bias", "running_mean", "running_var"):
            want(leaf, (attr("num_features"),), "num_features")
    elif isinstance(o, nn.GroupNorm):
        c, g = attr("num_channels"), attr("num_groups")
        if type(g) is not int or g < 1 or c % g:
            raise Inconsistent(f"GroupNorm would have {c} channels in {g} groups")
        want("weight", (c,), "num_channels")
        want("bias", (c,), "num_channels")
    elif isinstance(o, nn.LayerNorm):
        want("weight", tuple(attr("normalized_shape")), "normalized_shape")
        want("bias", tuple(attr("normalized_shape")), "normalized_shape")
    elif isinstance(o, nn.Embedding):
        want("weight", (attr("num_embeddings"), attr("embedding_dim")), "num_embeddings/embedding_dim")
    elif _is_conv1d(o):
        want("weight", (attr("nx"), attr("nf")), "nx/nf")
        want("bias", (attr("nf"),), "nf")
    _head_invariants(o, attr_of)


def _is_conv1d(o: nn.Module) -> bool:
    """Hugging Face's ``Conv1D`` (a Linear with its weight transposed: ``nx`` inputs, ``nf`` outputs)."""
    return type(o).__name__ == "Conv1D" and type(getattr(o, "nf", None)) is int and type(getattr(o, "nx", None)) is int


def _first_int(o: nn.Module, attr_of: _AttrOf, names: Tuple[str, ...]) -> Optional[Tuple[str, int]]:
    for n in names:
        if type(getattr(o, n, None)) is int:
            return n, attr_of(o, n)
    return None


def _head_invariants(o: nn.Module, attr_of: _AttrOf) -> None:
    """Attention: heads times the head size is the width of all heads; GPT-2's fused q/k/v is three of it."""
    heads = _first_int(o, attr_of, ("num_heads", "num_attention_heads", "n_heads"))
    size = _first_int(o, attr_of, ("attention_head_size", "head_dim", "key_value_proj_dim"))
    total = _first_int(o, attr_of, ("all_head_size", "split_size", "inner_dim"))
    if heads and size and total and heads[1] * size[1] != total[1]:
        raise Inconsistent(f"{type(o).__name__} would have {heads[0]}={heads[1]} heads of {size[0]}={size[1]}, "
                           f"and {total[0]}={total[1]}")
    c_attn = getattr(o, "c_attn", None)
    if (total and total[0] == "split_size" and not getattr(o, "is_cross_attention", False)
            and isinstance(c_attn, nn.Module) and _is_conv1d(c_attn) and attr_of(c_attn, "nf") != 3 * total[1]):
        raise Inconsistent(f"{type(o).__name__}'s fused c_attn would have nf={attr_of(c_attn, 'nf')}, three times "
                           f"split_size={total[1]} is {3 * total[1]}")


# ----------------------------------------------------------------------------- values
def check_size_value(current: Any, value: Any, path: str) -> Any:
    """The value to set for ``path`` (a size: an int or a tuple of ints, no larger than now).

    Examples:
        >>> check_size_value(16, 8, "out_features"), check_size_value((16,), [8], "normalized_shape")
        (8, (8,))
        >>> try:
        ...     check_size_value(1e-5, 1000.0, "eps")
        ... except Inconsistent as e:
        ...     print(e)
        attribute 'eps' holds float 1e-05; compaction changes only sizes
    """
    if type(current) is int:
        if type(value) is not int or not 0 <= value <= current:
            raise Inconsistent(f"attribute {path!r} is {current} and compaction only shrinks it: give an int in "
                               f"[0, {current}], not {value!r}")
        return value
    if isinstance(current, tuple) and current and all(type(c) is int for c in current):
        if (not isinstance(value, (list, tuple)) or len(value) != len(current)
                or not all(type(v) is int and 0 <= v <= c for v, c in zip(value, current))):
            raise Inconsistent(f"attribute {path!r} is {list(current)}: give as many ints, none larger, not {value!r}")
        return tuple(value)
    raise Inconsistent(f"attribute {path!r} holds {type(current).__name__} {current!r}; compaction changes only sizes")
