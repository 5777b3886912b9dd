"""Example inputs and model outputs: the shapes prunekit accepts and how it unpacks them."""

from __future__ import annotations

from typing import Any, Tuple

__all__ = ["flatten_output", "split_inputs"]


def split_inputs(example_inputs: Any) -> Tuple[tuple, dict]:
    """``(args, kwargs)`` for ``model(*args, **kwargs)``: a dict is keyword inputs, a tuple or
    list positional inputs, anything else the one positional input.

    Examples:
        >>> split_inputs({"input_ids": 1}), split_inputs((1, 2)), split_inputs(3)
        (((), {'input_ids': 1}), ((1, 2), {}), ((3,), {}))
    """
    if isinstance(example_inputs, dict):
        return (), dict(example_inputs)
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs), {}
    return (example_inputs,), {}


def flatten_output(output: Any) -> Any:
    """A model output as nested lists/tuples of tensors (dicts and Hugging Face outputs by value).

    Examples:
        >>> flatten_output({"a": 1, "b": 2})
        [1, 2]
    """
    if isinstance(output, dict):
        return list(output.values())
    if hasattr(output, "to_tuple"):
        return output.to_tuple()
    return output
