"""The channel tracer's op tables: which torch operations move channel labels how.

Every torch function seen between handled modules is looked up by name (in-place
variants such as ``add_`` by their out-of-place name) in one of these tables; the
tracer's rule for that table (:mod:`prunekit.compact.trace.rules`) updates the labels.
An operation in no table blocks the channels it touches.
"""

from __future__ import annotations

from typing import Any, List

from torch import Tensor

__all__ = [
    "CAT", "HARMLESS_MUTATORS", "MATMUL", "MULTI", "POINTWISE", "POOL", "REDUCE", "SAME", "SAME_LABELS",
    "SHAPE", "SOFTMAX", "base_name", "op_name", "tensors_in",
]


def names(*groups: str) -> frozenset:
    """One set of op names from space-separated strings."""
    out = set()
    for g in groups:
        out.update(g.split())
    return frozenset(out)


# Element-wise operations: each output element combines input elements at the same
# (broadcast) position. In-place variants ("add_") are matched after stripping "_".
POINTWISE = names(
    "add sub mul div true_divide rsub __add__ __radd__ __iadd__ __sub__ __rsub__ __isub__",
    "__mul__ __rmul__ __imul__ __truediv__ __rtruediv__ __itruediv__ __div__ __neg__ __pos__",
    "__pow__ __rpow__ pow neg abs exp log sqrt rsqrt square reciprocal sin cos erf tanh sigmoid",
    "relu relu6 gelu silu mish hardswish hardsigmoid hardtanh leaky_relu elu selu celu softplus",
    "softsign logsigmoid prelu dropout dropout1d dropout2d dropout3d alpha_dropout feature_alpha_dropout",
    "clamp clamp_min clamp_max clip where masked_fill maximum minimum addcmul addcdiv lerp sign",
    "threshold glu_never",
)
# Operations that only move elements around (or change dtype/device): apply them to the shadow.
SHAPE = names(
    "view reshape flatten unflatten permute transpose t contiguous unsqueeze squeeze expand",
    "expand_as __getitem__ narrow select movedim moveaxis swapaxes swapdims view_as reshape_as",
    "clone repeat flip roll detach",
)
SAME = names("to type float double half bfloat16 cpu cuda requires_grad_ __deepcopy__")
MULTI = names("split chunk unbind tensor_split split_with_sizes")
CAT = names("cat concat concatenate stack hstack vstack")
REDUCE = names("mean sum amax amin max min std var norm logsumexp prod nansum nanmean")
SOFTMAX = names("softmax log_softmax _softmax")
POOL = names(
    "avg_pool1d avg_pool2d avg_pool3d max_pool1d max_pool2d max_pool3d adaptive_avg_pool1d",
    "adaptive_avg_pool2d adaptive_avg_pool3d adaptive_max_pool1d adaptive_max_pool2d",
    "adaptive_max_pool3d lp_pool1d lp_pool2d interpolate upsample max_pool2d_with_indices",
    "_max_pool2d boolean_dispatch pixel_shuffle_never",
)
MATMUL = names("matmul __matmul__ __rmatmul__ bmm mm")
HARMLESS_MUTATORS = names("requires_grad_ retain_grad share_memory_")


def base_name(name: str) -> str:
    """The out-of-place name of an in-place op ("add_" -> "add"; dunders unchanged)."""
    return name[:-1] if name.endswith("_") and not name.endswith("__") else name


# one-tensor calls of these (no other argument) copy their input's labels when the shape is kept
SAME_LABELS = frozenset(
    n for n in POINTWISE | SAME | {p + "_" for p in POINTWISE | SAME} if base_name(n) in POINTWISE | SAME
) - {"__deepcopy__"}


def op_name(func: Any) -> str:
    """The name a torch function is looked up by (a property's getter by its property name)."""
    name = getattr(func, "__name__", None) or str(func)
    if name == "__get__":  # properties: Tensor.shape.__get__, Tensor.T.__get__
        owner = getattr(func, "__self__", None)
        name = getattr(owner, "__name__", "__get__")
    return name


def tensors_in(obj: Any) -> List[Tensor]:
    """Every tensor in ``obj`` (nested lists, tuples and dict values)."""
    out: List[Tensor] = []
    stack = [obj]
    while stack:
        o = stack.pop()
        if isinstance(o, Tensor):
            out.append(o)
        elif isinstance(o, (list, tuple)):
            stack.extend(o)
        elif isinstance(o, dict):
            stack.extend(o.values())
    return out
