"""Moved to :mod:`prunekit.compact.surgery.consistency`; this path re-exports its names and warns."""

import warnings

from .surgery.consistency import (
    Inconsistent,
    check_layer,
    check_size_value,
    current_shape,
    expected_attrs,
    plain,
    resolve,
    slot_sizes,
    tensor_of,
)

__all__ = ["Inconsistent", "check_layer", "check_size_value", "current_shape", "expected_attrs", "plain", "resolve", "slot_sizes", "tensor_of"]

warnings.warn(
    "prunekit.compact.consistency moved to prunekit.compact.surgery.consistency; import it from there",
    DeprecationWarning,
    stacklevel=2,
)
