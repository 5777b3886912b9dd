"""What a handler can prove about its outputs' values: names of :mod:`prunekit.compact.proofs.constants`.

Proved constants have one home, :mod:`prunekit.compact.proofs.constants` (the handlers
import from there); this module keeps the names handlers written against
``prunekit.compact.handlers.constants`` use.
"""

from ..proofs.constants import Fold, affine_row_values, any_masked, scale_shift_values

__all__ = ["Fold", "affine_row_values", "any_masked", "scale_shift_values"]
