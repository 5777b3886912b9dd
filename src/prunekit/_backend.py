"""The tensor framework behind a tensor or module: PyTorch or TensorPlay.

The core (kernels, reparameterization, methods, container, global pruning,
state-dict helpers, training pruners) never names ``torch`` for tensor work:
it asks :func:`backend_of` for the :class:`Backend` of the tensor or module it
was given and calls the framework's own functions through it, so TensorPlay
models are pruned with TensorPlay tensors end to end.

Most operations are spelled the same in both frameworks and are reached
through ``backend.ns`` (``torch`` or ``tensorplay``): ``b.ns.cat``,
``b.ns.bool``, ``b.ns.bincount``... The :class:`Backend` methods cover what
differs, so that call sites stay free of framework tests:

* ``topk`` / ``kthvalue`` return ``(values, indices)`` taken by position
  (TensorPlay 1.0.0 returns a plain tuple, no ``.values``);
* ``numel`` (TensorPlay has no ``nelement``);
* the reductions whose results rank weights -- ``vector_norm``,
  ``matrix_nuclear_norm``, ``row_mean``, ``topk``, ``kthvalue`` -- see
  "Identical rankings" below;
* ``ones_like`` / ``empty_like`` with a memory format (TensorPlay's take none);
* ``version`` (the in-place version counter, ``None`` where a tensor has none);
* ``is_inference_mode_enabled`` / ``inference_mode`` (TensorPlay keeps the
  first in ``tensorplay.autograd``);
* ``mul_``: in TensorPlay 1.0.0 ``t.mul_(m)`` is a silent no-op when ``m`` is
  a float32 tensor of ``t``'s shape, so the backend writes ``t * m`` back.

Identical rankings
------------------
The same weights must give the same masks in both frameworks. Selection itself
is exact (:mod:`prunekit.kernels.select` compares values and breaks ties by
position), but a score that is a *reduction* -- a channel norm, a block mean --
depends on the order in which a framework adds its terms: TensorPlay's norms
and torch's of the same weights differ in the last bit about a third of the
time, and now and then (10 of 8,000 small random matrices) two channels that
tie in one framework are one ulp apart in the other, and different channels
get pruned. So the TensorPlay backend runs these
reductions with torch's CPU kernels on a zero-copy DLPack view of the
TensorPlay tensor and hands the result back as a TensorPlay tensor: scores are
bit-identical to torch's (and to ``torch.nn.utils.prune``'s), whichever
framework holds the model. torch is a hard dependency of prunekit, so this
costs no import; where DLPack cannot share a tensor (a device torch was not
built for) TensorPlay's own kernel is used instead.

TensorPlay is optional: it is never imported here. A TensorPlay object can
only exist once the user imported ``tensorplay``, so it is looked up in
``sys.modules`` when an object is not a torch one.
"""

from __future__ import annotations

import math
import os
import sys
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence, Tuple

import torch

if TYPE_CHECKING:  # typing_extensions ships with torch; TypeGuard is in typing from Python 3.10
    from typing_extensions import TypeGuard

__all__ = [
    "Backend",
    "TORCH",
    "FrameworkMismatchError",
    "backend_of",
    "backend_of_class",
    "is_module",
    "is_tensor",
    "optimizer_backend",
    "require_torch",
    "same_backend",
]


class FrameworkMismatchError(TypeError):
    """Tensors or modules of two frameworks (PyTorch and TensorPlay) were mixed in one call."""


class Backend:
    """Operations the core needs, for one framework. ``ns`` is the framework module itself."""

    def __init__(self, name: str, ns: Any, tensor_type: type, module_type: type, parameter_type: type) -> None:
        self.name = name
        self.ns = ns
        self.Tensor = tensor_type
        self.Module = module_type
        self.Parameter = parameter_type
        self.no_grad: Callable[[], Any] = ns.no_grad
        self.enable_grad: Callable[[], Any] = ns.enable_grad
        self.is_grad_enabled: Callable[[], bool] = ns.is_grad_enabled
        self.bool = ns.bool
        self.float32 = ns.float32
        self.float64 = ns.float64
        self.float16 = ns.float16
        self.bfloat16 = ns.bfloat16
        self.int16 = ns.int16
        self.int32 = ns.int32
        self.int64 = ns.int64
        self.contiguous_format = ns.contiguous_format
        self.channels_last = ns.channels_last

    def __repr__(self) -> str:
        return f"<prunekit backend {self.name}>"

    # ------------------------------------------------------------- autograd
    def is_inference_mode_enabled(self) -> bool:
        return bool(self.ns.is_inference_mode_enabled())

    def inference_mode(self, mode: bool = True) -> Any:
        return self.ns.inference_mode(mode)

    # -------------------------------------------------------------- tensors
    @staticmethod
    def numel(t: Any) -> int:
        return t.numel()

    @staticmethod
    def topk(t: Any, k: int, largest: bool = True, sorted: bool = True) -> Tuple[Any, Any]:
        """``(values, indices)`` of the ``k`` largest (or smallest) entries of a 1-D tensor."""
        r = t.topk(k, largest=largest, sorted=sorted)
        return r[0], r[1]

    @staticmethod
    def kthvalue(t: Any, k: int) -> Tuple[Any, Any]:
        """``(value, index)`` of the ``k``-th smallest entry (1-based) of a 1-D tensor."""
        r = t.kthvalue(k)
        return r[0], r[1]

    @staticmethod
    def version(t: Any) -> Optional[int]:
        """The in-place version counter, or ``None`` where the tensor keeps none (inference tensors)."""
        try:
            return t._version
        except (AttributeError, RuntimeError):
            return None

    @staticmethod
    def mul_(t: Any, other: Any) -> Any:
        """In-place ``t *= other``; returns ``t``."""
        return t.mul_(other)

    def vector_norm(self, x: Any, order: float, dims: Sequence[int]) -> Any:
        """``linalg.vector_norm(x, ord=order, dim=dims)``."""
        return self.ns.linalg.vector_norm(x, ord=order, dim=list(dims))

    def matrix_nuclear_norm(self, mat: Any) -> Any:
        """Nuclear norm of each matrix of a batch ``[B, r, c]``."""
        return self.ns.linalg.matrix_norm(mat, ord="nuc")

    @staticmethod
    def row_mean(x: Any) -> Any:
        """Mean of each row of a 2-D tensor (1-D result)."""
        return x.mean(dim=1)

    def ones_like(self, t: Any, contiguous: bool = True) -> Any:
        """Ones shaped like ``t`` (contiguous memory unless ``contiguous=False``)."""
        if contiguous:
            return self.ns.ones_like(t, memory_format=self.contiguous_format)
        return self.ns.ones_like(t)

    def empty_like(self, t: Any, dtype: Any, channels_last: bool = False) -> Any:
        fmt = self.channels_last if channels_last else self.contiguous_format
        return self.ns.empty_like(t, dtype=dtype, memory_format=fmt)

    def as_dtype(self, dtype: Any) -> Any:
        """``dtype`` as this framework's dtype; a dtype of the other framework is translated by name."""
        if isinstance(dtype, type(self.bool)):
            return dtype
        name = _dtype_name(dtype)
        if name is not None and isinstance(getattr(self.ns, name, None), type(self.bool)):
            return getattr(self.ns, name)
        raise TypeError(
            f"mask_dtype must be a {self.name} dtype such as {self.name}.bool or {self.name}.float32, got {dtype!r}"
        )

    def is_dtype(self, dtype: Any) -> bool:
        return isinstance(dtype, type(self.bool))

    @staticmethod
    def dtype_label(dtype: Any) -> str:
        """``float32`` for ``torch.float32`` and ``tensorplay.float32``."""
        return _dtype_name(dtype) or str(dtype)


def _dtype_name(dtype: Any) -> Optional[str]:
    name = getattr(dtype, "name", None)  # tensorplay.DType is an enum
    if isinstance(name, str):
        return name
    text = str(dtype)
    if text.startswith(("torch.", "tensorplay.")):
        return text.split(".", 1)[1]
    return None


def _torch_view(t: Any) -> Optional[torch.Tensor]:
    """A torch tensor sharing ``t``'s memory (DLPack), or ``None`` where it cannot be shared."""
    try:
        return torch.from_dlpack(t.detach())
    except (RuntimeError, TypeError, ValueError, BufferError, AttributeError):
        return None


class _TensorPlayBackend(Backend):
    """TensorPlay 1.0.0, with its gaps worked around.

    Ranking reductions run torch's kernels on a DLPack view (module docstring,
    "Identical rankings"), so their results are bit-identical to torch's.
    """

    def _from_torch(self, t: torch.Tensor) -> Any:
        return self.ns.from_dlpack(t.contiguous())

    def topk(self, t: Any, k: int, largest: bool = True, sorted: bool = True) -> Tuple[Any, Any]:  # type: ignore[override]
        v = _torch_view(t)
        if v is None:
            return Backend.topk(t, k, largest=largest, sorted=sorted)
        r = v.topk(k, largest=largest, sorted=sorted)
        return self._from_torch(r.values), self._from_torch(r.indices)

    def kthvalue(self, t: Any, k: int) -> Tuple[Any, Any]:  # type: ignore[override]
        v = _torch_view(t)
        if v is None:
            return Backend.kthvalue(t, k)
        r = v.kthvalue(k)
        return self._from_torch(r.values), self._from_torch(r.indices)

    def row_mean(self, x: Any) -> Any:  # type: ignore[override]
        v = _torch_view(x)
        return x.mean(dim=1) if v is None else self._from_torch(v.mean(dim=1))

    def is_inference_mode_enabled(self) -> bool:
        return bool(self.ns.autograd.is_inference_mode_enabled())

    @staticmethod
    def mul_(t: Any, other: Any) -> Any:
        # TensorPlay 1.0.0: t.mul_(other) (and t *= other) with a float32 `other` of t's own shape
        # leaves t unchanged; copy_ of the product is correct and still bumps t's version.
        if other.dtype == t.dtype and tuple(other.shape) == tuple(t.shape):
            return t.copy_(t * other)
        return t.mul_(other)

    def vector_norm(self, x: Any, order: float, dims: Sequence[int]) -> Any:
        dims = list(dims)
        v = _torch_view(x)
        if v is not None:
            return self._from_torch(torch.linalg.vector_norm(v, ord=order, dim=dims))
        # no DLPack view: TensorPlay's own kernels (norms may differ from torch's in the last bit)
        if len(dims) <= 1:
            return self.ns.linalg.vector_norm(x, ord=order, dim=dims)
        # several dims: plain reductions (TensorPlay's multi-dim vector_norm is far slower than them)
        if order == 2.0:
            return (x * x).sum(dim=dims).sqrt()
        if order == 1.0:
            return x.abs().sum(dim=dims)
        if order == math.inf:
            return x.abs().amax(dim=dims)
        if order == -math.inf:
            return x.abs().amin(dim=dims)
        if order == 0.0:
            return (x != 0).sum(dim=dims).to(x.dtype)
        # any other order: one flattened dim, the fast single-dim kernel
        keep = [d for d in range(x.dim()) if d not in {d % x.dim() for d in dims}]
        flat = x.permute(*keep, *dims).reshape(*[x.shape[d] for d in keep], -1)
        return self.ns.linalg.vector_norm(flat, ord=order, dim=[-1])

    def matrix_nuclear_norm(self, mat: Any) -> Any:
        v = _torch_view(mat)
        if v is not None:
            return self._from_torch(torch.linalg.matrix_norm(v, ord="nuc"))
        _point_tensorplay_at_numpy_lapack()
        return self.ns.linalg.matrix_norm(mat, ord="nuc")

    def ones_like(self, t: Any, contiguous: bool = True) -> Any:
        # no memory_format argument; ones_like keeps t's layout, ones() is contiguous
        if contiguous:
            return self.ns.ones(tuple(t.shape), dtype=t.dtype, device=t.device)
        return self.ns.ones_like(t)

    def empty_like(self, t: Any, dtype: Any, channels_last: bool = False) -> Any:
        out = self.ns.empty(tuple(t.shape), dtype=dtype, device=t.device)
        return out.contiguous(memory_format=self.channels_last) if channels_last else out


_LAPACK_CHECKED = False


def _point_tensorplay_at_numpy_lapack() -> None:
    """Make TensorPlay's SVD find numpy's ILP64 OpenBLAS even when SciPy is loaded.

    TensorPlay 1.0.0 resolves LAPACK at its first SVD from the OpenBLAS already
    loaded in the process; once SciPy (scikit-learn) has loaded its own LP64
    ``libscipy_openblas``, that resolution fails, and the failure is cached for
    the life of the process. ``TP_LAPACK_LIB`` names the library explicitly:
    unless the user set it, point it at the ILP64 OpenBLAS bundled with numpy
    (the one TensorPlay looks for) before the first SVD. Best effort: nothing
    happens where numpy's bundled library is not found.
    """
    global _LAPACK_CHECKED
    if _LAPACK_CHECKED:
        return
    _LAPACK_CHECKED = True
    if os.environ.get("TP_LAPACK_LIB"):
        return
    import glob
    import importlib.util

    spec = importlib.util.find_spec("numpy")
    if spec is None or not spec.origin:
        return
    pkg = os.path.dirname(spec.origin)
    for pattern in (pkg + ".libs/libscipy_openblas64_*.so*", os.path.join(pkg, ".dylibs", "libscipy_openblas64_*.dylib"),
                    pkg + ".libs/libscipy_openblas64_*.dll"):
        found = sorted(glob.glob(pattern))
        if found:
            os.environ["TP_LAPACK_LIB"] = found[0]
            return


TORCH = Backend("torch", torch, torch.Tensor, torch.nn.Module, torch.nn.Parameter)
_TP: Optional[Backend] = None


def _tensorplay() -> Optional[Backend]:
    """The TensorPlay backend if ``tensorplay`` is imported (never imports it)."""
    global _TP
    if _TP is None:
        tp = sys.modules.get("tensorplay")
        if tp is None or not hasattr(tp, "nn"):
            return None
        _TP = _TensorPlayBackend("tensorplay", tp, tp.Tensor, tp.nn.Module, tp.nn.Parameter)
    return _TP


def tensorplay_backend() -> Backend:
    """The TensorPlay backend, importing ``tensorplay`` (ImportError with the install hint if absent)."""
    try:
        import tensorplay  # noqa: F401
    except ImportError as e:
        raise ImportError(
            "TensorPlay is not installed; install prunekit's extra: pip install 'prunekit[tensorplay]'"
        ) from e
    b = _tensorplay()
    assert b is not None
    return b


def backend_of(obj: Any) -> Optional[Backend]:
    """The backend of a tensor or module (``None`` for anything else).

    Examples:
        >>> import torch
        >>> from prunekit._backend import backend_of
        >>> backend_of(torch.ones(2)).name, backend_of(torch.nn.Linear(2, 2)).name, backend_of(3)
        ('torch', 'torch', None)
    """
    if isinstance(obj, (torch.Tensor, torch.nn.Module)):
        return TORCH
    tp = _tensorplay()
    if tp is not None and isinstance(obj, (tp.Tensor, tp.Module)):
        return tp
    return None


def backend_of_class(cls: type) -> Optional[Backend]:
    """The backend of a module class."""
    if issubclass(cls, torch.nn.Module):
        return TORCH
    tp = _tensorplay()
    if tp is not None and issubclass(cls, tp.Module):
        return tp
    return None


def is_module(obj: Any) -> TypeGuard[torch.nn.Module]:
    """A ``torch.nn.Module`` or a ``tensorplay.nn.Module`` (typed as the torch class, as prunekit's signatures do)."""
    if isinstance(obj, torch.nn.Module):
        return True
    tp = _tensorplay()
    return tp is not None and isinstance(obj, tp.Module)


def is_tensor(obj: Any) -> TypeGuard[torch.Tensor]:
    """A ``torch.Tensor`` or a TensorPlay tensor (typed as the torch class, as prunekit's signatures do)."""
    if isinstance(obj, torch.Tensor):
        return True
    tp = _tensorplay()
    return tp is not None and isinstance(obj, tp.Tensor)


def optimizer_backend(obj: Any) -> Optional[Backend]:
    """The backend of an optimizer (``torch.optim.Optimizer`` or ``tensorplay.optim.Optimizer``), else ``None``.

    Both keep per-parameter state in ``optimizer.state[param]`` (a dict of
    tensors) and offer ``register_step_pre_hook`` / ``register_step_post_hook``.

    Examples:
        >>> import torch
        >>> from prunekit._backend import optimizer_backend
        >>> optimizer_backend(torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)).name
        'torch'
    """
    if isinstance(obj, torch.optim.Optimizer):
        return TORCH
    tp = _tensorplay()
    if tp is not None and isinstance(obj, tp.ns.optim.Optimizer):
        return tp
    return None


def same_backend(b: Backend, obj: Any, what: str, where: str) -> None:
    """Raise :class:`FrameworkMismatchError` if tensor ``obj`` is not of backend ``b``."""
    ob = backend_of(obj)
    if ob is not None and ob is not b:
        hint = ("tensorplay.from_dlpack(t)" if b.name == "tensorplay" else "torch.from_dlpack(t)")
        raise FrameworkMismatchError(
            f"{where}: {what} is a {ob.name} tensor but the module is a {b.name} module; "
            f"pass a {b.name} tensor (convert with {hint})"
        )


def require_torch(model: Any, feature: str) -> None:
    """Raise a clear ``TypeError`` if ``model`` (a module, or an iterable of modules) is not PyTorch.

    For the parts of prunekit that work on PyTorch models only (compaction,
    sparse inference).

    Examples:
        >>> import torch
        >>> from prunekit._backend import require_torch
        >>> require_torch(torch.nn.Linear(2, 2), "prunekit.compact")
    """
    b = backend_of(model)
    if b is None or b is TORCH:
        return
    raise TypeError(
        f"{feature} works on PyTorch models only; got a {b.name} {type(model).__name__}. "
        f"The pruning API (prunekit.l1_unstructured, ..., global_unstructured, remove, the state-dict "
        f"helpers) supports {b.name} models; for {feature} use a torch.nn model"
    )
