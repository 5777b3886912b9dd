"""Amount rules, identical to ``torch.nn.utils.prune``.

An ``int`` amount is a count of units; a ``float`` amount is a fraction in
``[0, 1]`` of the units, rounded with Python's ``round`` (half to even).
"""

from __future__ import annotations

import numbers
from typing import Union

Amount = Union[int, float]

__all__ = [
    "Amount",
    "compute_nparams_to_prune",
    "validate_pruning_amount",
    "validate_pruning_amount_init",
]


def validate_pruning_amount_init(amount: Amount) -> None:
    """Check an amount on its own, before the tensor is known.

    Raises:
        TypeError: ``amount`` is not a real number (``bool`` counts as int, as in torch).
        ValueError: a negative int, or a float outside ``[0, 1]`` (NaN included).

    Examples:
        >>> from prunekit import validate_pruning_amount_init
        >>> validate_pruning_amount_init(0.3)
        >>> validate_pruning_amount_init(1.5)
        Traceback (most recent call last):
        ...
        ValueError: amount=1.5 should either be a float in the range [0, 1] or a non-negative integer
    """
    if not isinstance(amount, numbers.Real):
        raise TypeError(
            f"Invalid type for amount: {amount!r} ({type(amount).__name__}). Must be int or float: "
            "an int counts units to prune, a float in [0, 1] is a fraction (e.g. amount=0.3)."
        )
    if isinstance(amount, numbers.Integral):
        if amount < 0:
            raise ValueError(
                f"amount={amount} should either be a float in the range [0, 1] or a non-negative integer"
            )
    elif not 0.0 <= float(amount) <= 1.0:  # also rejects NaN
        raise ValueError(
            f"amount={amount} should either be a float in the range [0, 1] or a non-negative integer"
        )


def validate_pruning_amount(amount: Amount, tensor_size: int) -> None:
    """Check that an int ``amount`` does not exceed the ``tensor_size`` units available.

    Examples:
        >>> from prunekit import validate_pruning_amount
        >>> validate_pruning_amount(3, tensor_size=10)
        >>> validate_pruning_amount(11, tensor_size=10)
        Traceback (most recent call last):
        ...
        ValueError: amount=11 should be smaller than the number of parameters to prune=10
    """
    if isinstance(amount, numbers.Integral) and amount > tensor_size:
        raise ValueError(
            f"amount={amount} should be smaller than the number of parameters to prune={tensor_size}"
        )


def compute_nparams_to_prune(amount: Amount, tensor_size: int) -> int:
    """Number of units to prune: ``amount`` itself if int, else ``round(amount * tensor_size)``.

    Examples:
        >>> from prunekit import compute_nparams_to_prune
        >>> compute_nparams_to_prune(0.25, 10)   # round(2.5) == 2, half to even
        2
        >>> compute_nparams_to_prune(7, 10)
        7
    """
    if isinstance(amount, numbers.Integral):
        return int(amount)
    return round(amount * tensor_size)
