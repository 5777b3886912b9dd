"""The docstring examples of prunekit.training run and print what they say."""

import doctest
import importlib

import pytest

MODULES = ["allocation", "config", "criteria", "patterns", "pruners", "registry", "report", "schedules", "wiring"]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    mod = importlib.import_module(f"prunekit.training.{name}")
    result = doctest.testmod(mod, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0
    assert result.failed == 0
