"""Every example in the core's docstrings runs and prints what it says."""

import doctest
import importlib

import pytest

MODULES = [
    "prunekit.base",
    "prunekit.container",
    "prunekit.errors",
    "prunekit.global_",
    "prunekit.kernels.amount",
    "prunekit.kernels.norms",
    "prunekit.kernels.select",
    "prunekit.methods",
    "prunekit.reparam",
    "prunekit.state_dict",
]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0, f"{name} has no examples"
    assert result.failed == 0
