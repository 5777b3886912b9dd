"""The sparsity patterns, kept importable from their old place.

The patterns are pure mask math and live in :mod:`prunekit.kernels.patterns`;
this module re-exports them so ``from prunekit.training.patterns import
get_pattern`` keeps working.

Example:
    >>> from prunekit.training.patterns import get_pattern
    >>> from prunekit.kernels import patterns
    >>> get_pattern is patterns.get_pattern
    True
"""

from ..kernels.patterns import (  # noqa: F401
    ChannelPattern,
    NInMPattern,
    NxMPattern,
    Pattern,
    from_2d,
    get_pattern,
    select_lowest,
    to_2d,
)

__all__ = [
    "Pattern",
    "NxMPattern",
    "ChannelPattern",
    "NInMPattern",
    "get_pattern",
    "to_2d",
    "from_2d",
    "select_lowest",
]
