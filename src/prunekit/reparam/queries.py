"""Questions about a module's pruning that compute nothing, and the label errors use.

* which tensors are reparameterized (:func:`is_masked`, :func:`pruned_names`,
  :func:`iter_masked`), their mask (:func:`get_mask`) and the stored tensor
  (:func:`stored`);
* which class a pruned module had before pruning (:func:`base_class`);
* where a dotted path lives (:func:`owner_of`);
* naming: :func:`describe` labels a module or tensor for error messages,
  :func:`with_context` puts that label in front of an exception's message.
"""

from __future__ import annotations

from typing import Any, FrozenSet, Iterator, Optional, Tuple

from torch import Tensor, nn

from .._backend import Backend, is_module, is_tensor

__all__ = ["base_class", "describe", "get_mask", "is_masked", "iter_masked", "orig_and_mask", "owner_of", "pruned_names",
           "stored", "with_context"]


# ------------------------------------------------------- the reparameterization
def is_masked(module: nn.Module, name: str) -> bool:
    """Whether ``module.name`` is reparameterized as ``name_orig``/``name_mask`` (by prunekit or torch).

    Examples:
        >>> import torch, prunekit
        >>> m = prunekit.l1_unstructured(torch.nn.Linear(3, 2), "weight", amount=1)
        >>> is_masked(m, "weight"), is_masked(m, "bias")
        (True, False)
    """
    return name + "_orig" in getattr(module, "_parameters", {}) and name + "_mask" in getattr(module, "_buffers", {})


def get_mask(module: nn.Module, name: str) -> Optional[Tensor]:
    """The mask buffer of ``module.name``, or ``None`` when it is not masked.

    Examples:
        >>> import torch, prunekit
        >>> m = prunekit.custom_from_mask(torch.nn.Linear(2, 1), "weight", torch.tensor([[1, 0]]))
        >>> get_mask(m, "weight").tolist(), get_mask(m, "bias")
        ([[1.0, 0.0]], None)
    """
    return module._buffers[name + "_mask"] if is_masked(module, name) else None


def stored(module: nn.Module, name: str) -> Optional[Tensor]:
    """The stored tensor of ``name``: ``name_orig`` when masked, else ``module.name`` (``None`` if absent).

    Never computes the effective value.

    Examples:
        >>> import torch, prunekit
        >>> m = prunekit.l1_unstructured(torch.nn.Linear(3, 2), "weight", amount=1)
        >>> stored(m, "weight") is m.weight_orig, stored(m, "bias") is m.bias
        (True, True)
    """
    if is_masked(module, name):
        return module._parameters[name + "_orig"]
    return getattr(module, name, None)


def stored_to_prune(module: nn.Module, name: str) -> Tensor:
    """The stored tensor of ``name`` (``name_orig`` once masked); a ValueError naming the module when it has none.

    Examples:
        >>> import torch
        >>> m = torch.nn.Linear(2, 2)
        >>> stored_to_prune(m, "weight") is m.weight
        True
        >>> stored_to_prune(m, "kernel")
        Traceback (most recent call last):
        ...
        ValueError: Linear(in_features=2, out_features=2, bias=True) has no tensor 'kernel' to prune
    """
    t = stored(module, name)
    if not is_tensor(t):
        raise ValueError(f"{describe(module)} has no tensor {name!r} to prune")
    return t


def orig_and_mask(module: nn.Module, name: str) -> Tuple[nn.Parameter, Tensor]:
    """``(name_orig, name_mask)`` of a masked ``name``; a ValueError naming the tensor when it is not masked.

    Examples:
        >>> import torch, prunekit
        >>> m = prunekit.l1_unstructured(torch.nn.Linear(3, 2), "weight", amount=1)
        >>> orig, mask = orig_and_mask(m, "weight"); orig is m.weight_orig, mask is m.weight_mask
        (True, True)
    """
    orig, mask = module._parameters.get(name + "_orig"), module._buffers.get(name + "_mask")
    if orig is None or mask is None:
        raise ValueError(f"{describe(module, name)} is not masked: it has no {name}_orig parameter and "
                         f"{name}_mask buffer pair")
    return orig, mask


def iter_masked(model: nn.Module) -> Iterator[Tuple[str, nn.Module, str]]:
    """``(module name, module, tensor name)`` for every ``name_orig``/``name_mask`` pair, whoever pruned it.

    Examples:
        >>> import torch, prunekit
        >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
        >>> _ = prunekit.identity(net[1], "bias")
        >>> [(q, n) for q, _, n in iter_masked(net)]
        [('1', 'bias')]
    """
    for qual, sub in model.named_modules():
        for bname in list(sub._buffers):
            if bname.endswith("_mask") and is_masked(sub, bname[: -len("_mask")]):
                yield qual, sub, bname[: -len("_mask")]


def owner_of(model: nn.Module, path: str) -> Tuple[nn.Module, str]:
    """The submodule that owns the tensor at ``path`` and the tensor's name in it.

    Examples:
        >>> import torch
        >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2))
        >>> owner_of(net, "0.weight")[0] is net[0], owner_of(net, "0.weight")[1]
        (True, 'weight')
    """
    prefix, _, leaf = path.rpartition(".")
    return (model.get_submodule(prefix) if prefix else model), leaf


# ----------------------------------------------------------- the pruned class
def base_class(module: nn.Module) -> type:
    """The module's class as it was before pruning.

    Examples:
        >>> import torch, prunekit
        >>> m = prunekit.l1_unstructured(torch.nn.Linear(4, 2), "weight", 0.5)
        >>> base_class(m) is torch.nn.Linear, isinstance(m, torch.nn.Linear)
        (True, True)
    """
    cls = type(module)
    for c in cls.__mro__:  # the pruned class may be wrapped (torch's parametrize subclasses it)
        if "_prunekit_base" in c.__dict__:
            return c.__dict__["_prunekit_base"] if c is cls else cls
    return cls


def pruned_names(module: nn.Module) -> FrozenSet[str]:
    """Names of the tensors of ``module`` that prunekit reparameterizes.

    Examples:
        >>> import torch, prunekit
        >>> m = prunekit.identity(prunekit.identity(torch.nn.Linear(2, 2), "weight"), "bias")
        >>> sorted(pruned_names(m)), pruned_names(torch.nn.Linear(2, 2))
        (['bias', 'weight'], frozenset())
    """
    for c in type(module).__mro__:
        names = c.__dict__.get("_prunekit_names")
        if names is not None:
            return names
    return frozenset()


# --------------------------------------------------------------------- naming
def describe(module: Any, name: Optional[str] = None) -> str:
    """A short label for error messages: ``Linear(in=64, out=32).weight [32, 64] float32``.

    Examples:
        >>> import torch
        >>> describe(torch.nn.Linear(3, 2, bias=False), "weight")
        'Linear(in_features=3, out_features=2, bias=False).weight [2, 3] float32'
    """
    label = base_class(module).__name__ if is_module(module) else type(module).__name__
    extra = getattr(module, "extra_repr", lambda: "")()
    if extra and len(extra) < 60:
        label += f"({extra})"
    if name is None:
        return label
    label += f".{name}"
    t = _held_tensor(module, name)
    if t is not None and is_tensor(t):
        label += f" {list(t.shape)} {Backend.dtype_label(t.dtype)}"
    return label


def _held_tensor(module: nn.Module, name: str) -> Optional[Tensor]:
    """The parameter, ``name_orig`` or buffer held for ``name``: what :func:`describe` shows the shape of."""
    params = getattr(module, "_parameters", {})
    if name in params:
        return params[name]
    if name + "_orig" in params:
        return params[name + "_orig"]
    return getattr(module, "_buffers", {}).get(name)


def with_context(err: BaseException, module: nn.Module, name: Optional[str]) -> BaseException:
    """The same exception type with the module and tensor named in front of the message.

    Examples:
        >>> import torch
        >>> str(with_context(ValueError("amount must be in [0, 1]"), torch.nn.Linear(2, 2, bias=False), "weight"))
        'Linear(in_features=2, out_features=2, bias=False).weight [2, 2] float32: amount must be in [0, 1]'
    """
    where = describe(module, name)
    msg = str(err)
    if msg.startswith(where.split(" ")[0]):
        return err
    try:
        new = type(err)(f"{where}: {msg}")
    except Exception:  # exotic exception type: keep it as it is
        return err
    new.__cause__ = err.__cause__
    return new
