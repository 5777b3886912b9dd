"""Selection: choosing which units to prune and writing them as masks.

:mod:`.importance` scores a group's units; :mod:`.prune` picks the lowest (per group or
globally) and masks them in every tensor they span (:func:`~prunekit.compact.prune_groups`).
:mod:`prunekit.compact.reconstruct` chooses from calibration data instead.
"""
