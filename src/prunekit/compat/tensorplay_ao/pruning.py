"""TensorPlay's pruning API (``tensorplay.ao.pruning``), provided by prunekit -- not part of TensorPlay.

TensorPlay documents this module ("Pruning - tensorplay.ao.pruning") but its
1.0.0 release ships none. prunekit implements the API it documents, for
``tensorplay.nn`` modules as for ``torch.nn`` ones, and, when installed beside
TensorPlay, serves it under this name from the file shown below (FILE), so
TensorPlay's examples and tests run unchanged::

    import tensorplay as tp
    from tensorplay.ao.pruning import l1_unstructured, ln_structured, is_pruned

Every name here is prunekit's own object (``tensorplay.ao.pruning.l1_unstructured
is prunekit.l1_unstructured``); ``__all__`` is the API TensorPlay documents:
the methods ``l1_unstructured``, ``random_unstructured``, ``custom_from_mask``,
``global_unstructured``, ``identity``, ``ln_structured``, ``random_structured``,
their classes, ``remove``, ``is_pruned``, ``validate_pruning_amount``,
``compute_nparams_to_prune``, ``BasePruningMethod`` and ``PruningContainer``.

Documentation: prunekit's README (sections "The pruning API" and
"TensorPlay"; it is also the package's description:
``importlib.metadata.metadata("prunekit")["Description"]``), ``help(prunekit)``,
and each object's own ``help()``. Install: ``pip install "prunekit[tensorplay]"``.

Switch off: set ``PRUNEKIT_TENSORPLAY_AO=0`` in the environment. A TensorPlay
release that ships its own ``tensorplay.ao.pruning`` is always imported
instead of this one. How it works: ``help(_prunekit_tensorplay_ao)``.
"""

from prunekit import (
    BasePruningMethod,
    CustomFromMask,
    Identity,
    L1Unstructured,
    LnStructured,
    PruningContainer,
    RandomStructured,
    RandomUnstructured,
    __version__,
    compute_nparams_to_prune,
    custom_from_mask,
    global_unstructured,
    identity,
    is_pruned,
    l1_unstructured,
    ln_structured,
    random_structured,
    random_unstructured,
    remove,
    validate_pruning_amount,
)

#: the distribution that provides this module, and its version
provided_by = f"prunekit {__version__}"

__all__ = [
    "BasePruningMethod",
    "CustomFromMask",
    "Identity",
    "L1Unstructured",
    "LnStructured",
    "PruningContainer",
    "RandomStructured",
    "RandomUnstructured",
    "compute_nparams_to_prune",
    "custom_from_mask",
    "global_unstructured",
    "identity",
    "is_pruned",
    "l1_unstructured",
    "ln_structured",
    "random_structured",
    "random_unstructured",
    "remove",
    "validate_pruning_amount",
]
