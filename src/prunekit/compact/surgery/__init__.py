"""Module surgery: changing a model's modules, undoably.

:mod:`.shrink` slices a module's tensors and updates its size attributes (or swaps in a
replacement from :mod:`prunekit.compact.modules`); :mod:`.rebuild` reshapes a fresh model
from a compaction description after :mod:`.consistency` checked every entry; :mod:`.journal`
records what each step changes so a failure puts the model back.
"""
