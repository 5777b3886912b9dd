"""Every docstring example in the package runs and prints what it says."""

import doctest
import importlib
import pkgutil

import pytest

import prunekit

# modules whose examples run elsewhere, and why
ELSEWHERE = {
    "prunekit.demo": "tests/test_report.py, in a subprocess (scikit-learn's SciPy must stay out of this process)",
    "prunekit.demo.digits": "the same", "prunekit.demo.pretrained": "the same", "prunekit.demo.settings": "the same",
    "prunekit.demo.stages": "the same", "prunekit.demo.text": "the same",
    "prunekit.__main__": "importing it runs the command line",
}


def modules_with_examples():
    names = sorted(m.name for m in pkgutil.walk_packages(prunekit.__path__, "prunekit."))
    found = []
    for name in names:
        if name in ELSEWHERE:
            continue
        tests = doctest.DocTestFinder().find(importlib.import_module(name))
        if any(t.examples for t in tests):
            found.append(name)
    return found


MODULES = modules_with_examples()


def test_the_core_and_every_subpackage_have_examples():
    for name in ("prunekit.methods", "prunekit.reparam", "prunekit.global_", "prunekit.kernels.select",
                 "prunekit.training.pruners", "prunekit.compact.compact", "prunekit.sparse.checkpoint",
                 "prunekit.report", "prunekit.cli"):
        assert name in MODULES


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0
    assert result.failed == 0
