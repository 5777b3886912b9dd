"""``PruningContainer`` (defined in :mod:`prunekit.base`, beside ``apply``, which composes into it).

Kept as a module so that ``from prunekit.container import PruningContainer``
keeps working.
"""

from __future__ import annotations

from .base import PruningContainer, combine_masks

__all__ = ["PruningContainer", "combine_masks"]
