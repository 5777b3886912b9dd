"""Tracing: which channels of which layers are coupled, from one run of the model.

:mod:`.graph` is the entry point (:func:`~prunekit.compact.build_dependency_graph`). The
run itself is :mod:`.tracer` (a ``TorchFunctionMode`` between the handled layers), which
moves channel labels (:mod:`.shadows`) through each torch operation by the rules of
:mod:`.rules` (looked up in the op tables of :mod:`.ops`) and records couplings in a
:mod:`.unionfind`; :mod:`.grouping` turns the solved components into units and groups,
which :mod:`.results` defines. :mod:`.inputs` says how example inputs and outputs are
unpacked.
"""
