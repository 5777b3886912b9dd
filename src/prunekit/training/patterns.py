"""The sparsity patterns, kept importable from their old place.

The patterns are pure mask math and live in :mod:`prunekit.kernels.patterns`;
this module re-exports them so ``from prunekit.training.patterns import
get_pattern`` keeps working.

Examples:
    >>> from prunekit.training.patterns import get_pattern
    >>> from prunekit.kernels import patterns
    >>> get_pattern is patterns.get_pattern
    True
"""

from ..kernels import patterns as _patterns
from ..kernels.patterns import *  # noqa: F401,F403

__all__ = list(_patterns.__all__)
