"""Moved to :mod:`prunekit.compact.surgery.rebuild`; this path re-exports its names and warns."""

import warnings

from .surgery.rebuild import (
    INIT_CHECKS,
    INIT_FROM_TENSORS,
    RebuildPlan,
    apply_plan,
    check_state_dict,
    load_state,
    plan_rebuild,
)

__all__ = ["INIT_CHECKS", "INIT_FROM_TENSORS", "RebuildPlan", "apply_plan", "check_state_dict", "load_state", "plan_rebuild"]

warnings.warn(
    "prunekit.compact.rebuild moved to prunekit.compact.surgery.rebuild; import it from there",
    DeprecationWarning,
    stacklevel=2,
)
