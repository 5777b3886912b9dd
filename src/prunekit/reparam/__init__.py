"""The one mask module: ``name = name_orig * name_mask`` and the surgery around it.

Every package of prunekit (the pruning methods, training, compaction,
checkpoints, state dicts, reports) asks this package, and only it, whether a
tensor is pruned, what its effective value is, and to drop a mask. Its public
API (``__all__``):

==============================  ===============================================
``masked(t, mask)``             the one definition of mask application (below)
``is_masked(module, name)``     is ``name`` reparameterized (prunekit or torch)?
``get_mask(module, name)``      its mask buffer, or ``None``
``stored(module, name)``        ``name_orig`` if masked, else ``name`` itself
``effective(module, name)``     the value the forward pass uses, detached
``sync(module)``                carry writes through a pruned name into ``name_orig``
``unmask(module, name, bake)``  drop the reparameterization, mask baked or not
``iter_masked(model)``          every masked ``(module name, module, name)``
``owner_of(model, path)``       ``(module, "weight")`` for ``"layer1.0.weight"``
``remove(module, name)``        torch's ``remove``: ``unmask`` with ``bake``
``is_pruned(module)``           torch's ``is_pruned``
==============================  ===============================================

To prune a tensor with a mask you computed, call
:func:`prunekit.methods.apply_mask` (``prunekit.reparam.apply_mask`` is its
deprecated old name): installing a mask needs a pruning method as the hook, and
the methods live in the layer above this one.

The package, one module per concept: :mod:`.queries` (questions that compute
nothing, and the labels errors use), :mod:`.value` (the effective value:
computed, cached, served, written through), :mod:`.classes` (the pruned
subclass, copies and pickles), :mod:`.hooks` (the method as a forward
pre-hook, torch's hooks, what may be pruned), :mod:`.lifecycle` (install and
drop, all or nothing). :mod:`._internal` is the tier other packages of
prunekit use and users do not. The names of the value -- *stored*, *mask*,
*effective*, *masked* -- are defined in :mod:`.value` and in
docs/architecture.md.

Mask application, one definition: ``masked(t, mask)`` is ``t * mask`` in the
dtype of ``t``, except that an entry whose mask is zero is exactly ``+0``
whatever ``t`` holds there (a negative value, ``inf`` and ``NaN`` included); a
mask value other than 0 and 1 scales its entry. ``remove``, the no-grad value
of ``name``, state-dict conversion, compressed checkpoints, training and
compaction all use it. With gradients on, ``name`` is autograd's
``name_orig * name_mask`` (one multiplication per forward, as in torch): the
same values, except that a masked entry reads ``-0.0`` where ``name_orig`` is
negative (equal to ``0``) and ``NaN`` where it is not finite; forcing ``+0``
there would cost about three times the multiplication in every training step.

When a tensor ``name`` of a module is pruned:

* the ``nn.Parameter`` moves, as the same object, to ``name_orig`` (optimizers
  that hold it keep working);
* the mask is registered as the buffer ``name_mask``;
* the module's class becomes a per-(class, pruned names) subclass, with the
  same ``__name__``/``__module__``, that serves ``module.name`` through a
  property computing the effective value;
* the pruning method is registered as a forward pre-hook, as in
  ``torch.nn.utils.prune``, so code that looks for it there finds it.

Serving ``name`` through a property rather than a hook-refreshed attribute is
what fixes several faults of ``torch.nn.utils.prune`` at their root:

* the value is always current, even when a parent reads it without calling
  the module's ``forward`` (``nn.MultiheadAttention`` reads
  ``out_proj.weight`` directly);
* no derived, non-leaf tensor sits in ``module.__dict__``, so ``deepcopy``,
  pickle and ``torch.save`` work in any state;
* under ``no_grad`` (or for a frozen ``name_orig``) the value is cached and
  reused until ``name_orig`` or ``name_mask`` change (identity, storage or
  in-place version), so inference costs what a dense module costs. With
  gradients on, every read builds a fresh product, so gradients reach
  ``name_orig`` (zero where masked).

Writes through a pruned name, one rule with or without gradients: a write
lands in ``name_orig`` at the unpruned entries and the mask still applies (the
tensor stays pruned; ``name_orig`` keeps its values at pruned entries and
stays the same Parameter). That covers ``module.weight.mul_(2)``,
``module.weight.data += d``, ``module.weight.data.copy_(x)``,
``module.weight.data = x`` and ``module.weight = nn.Parameter(x)`` (the last
two need ``name``'s shape), i.e. how PEFT merges adapters, how EMA and
initialisation code write. The value handed to the module's own ``forward``
is the cache, served as it is (dense speed); a value handed to any other
reader may be written, through a ``.data`` alias that shares no version
counter, so the next access to the module (a read of ``name`` or
``name_orig``, a forward, the state dict, a copy, ``remove``, pruning again)
compares it with ``name_orig * name_mask`` and carries a difference into
``name_orig`` -- one comparison, then none while nobody else holds the value.
The cache therefore never disagrees with ``name_orig * name_mask``. To merge
densely on purpose (the update not masked), ``prunekit.remove`` first. When
both a write through ``name`` and a direct change of ``name_orig``/the mask
happen before the next access, the direct change wins and a warning is logged.
``torch.jit.trace``/``torch.compile``/``torch.export`` see the product itself
(never a cached constant); ``torch.jit.script`` is refused with a message
saying to trace, export or ``remove`` first. PyTorch modules only; on
TensorPlay modules assigning to ``name`` raises (write into ``name_orig``).

Examples:
    >>> import torch, prunekit
    >>> from prunekit import reparam
    >>> m = prunekit.custom_from_mask(torch.nn.Linear(2, 1, bias=False), "weight", torch.tensor([[1, 0]]))
    >>> reparam.stored(m, "weight") is m.weight_orig, reparam.get_mask(m, "weight").tolist()
    (True, [[1.0, 0.0]])
    >>> torch.equal(reparam.effective(m, "weight"), reparam.masked(m.weight_orig, m.weight_mask))
    True
"""

from __future__ import annotations

import warnings
from typing import Any

from . import _internal, classes, value
from .classes import _rebuild as _rebuild  # pickles of pruned modules name prunekit.reparam._rebuild
from .classes import observe_pruned
from .hooks import find_hook, is_pruned, iter_pruned
from .lifecycle import remove, unmask
from .queries import (base_class, describe, get_mask, is_masked, iter_masked, owner_of, pruned_names, stored,
                      stored_to_prune)
from .value import effective, effective_for_reading, masked, sync

__all__ = [
    "apply_mask",
    "base_class",
    "describe",
    "effective",
    "effective_for_reading",
    "find_hook",
    "get_mask",
    "is_masked",
    "is_pruned",
    "iter_masked",
    "iter_pruned",
    "masked",
    "observe_pruned",
    "owner_of",
    "pruned_names",
    "remove",
    "stored",
    "stored_to_prune",
    "sync",
    "unmask",
]

# Names importable from prunekit.reparam before it was a package that are not public: the internal tier
# (prunekit.reparam._internal, where prunekit's own code imports them from) and the old spellings of the
# value's helpers. They still resolve here, for code written against the old module.
_OLD_NAMES = {
    **{name: getattr(_internal, name) for name in _internal.__all__},
    "assign": value.assign,
    "current_value": value.effective,  # the effective value, fresh: one name for it
    "masked_product": value.effective_with_grad,
    "refresh_flat_weights": classes.refresh_flat_weights,
}


def __getattr__(name: str) -> Any:
    if name == "apply_mask":
        warnings.warn("prunekit.reparam.apply_mask is deprecated: call prunekit.methods.apply_mask (installing a "
                      "mask needs a pruning method, from the layer above reparam)", DeprecationWarning, stacklevel=2)
        from ..methods import apply_mask  # the one import upward, for this deprecated name (.importlinter)

        return apply_mask
    if name in _OLD_NAMES:
        return _OLD_NAMES[name]
    raise AttributeError(f"module 'prunekit.reparam' has no attribute {name!r}")
