"""Moved compaction modules: the documented old paths still import, warn, and give the same objects."""

import importlib
import sys

import pytest

import prunekit.compact.handlers.constants as handler_constants
from prunekit.compact.proofs import constants


@pytest.mark.parametrize("old, new", [("rebuild", "surgery.rebuild"), ("consistency", "surgery.consistency")])
def test_a_moved_module_path_warns_and_reexports_its_new_home(monkeypatch, old, new):
    monkeypatch.delitem(sys.modules, f"prunekit.compact.{old}", raising=False)  # imported afresh: it warns
    with pytest.warns(DeprecationWarning, match=rf"prunekit\.compact\.{old} moved to prunekit\.compact\.{new}"):
        shim = importlib.import_module(f"prunekit.compact.{old}")
    home = importlib.import_module(f"prunekit.compact.{new}")
    assert shim.__all__ == home.__all__ and len(home.__all__) >= 7
    for name in home.__all__:
        assert getattr(shim, name) is getattr(home, name), name


def test_proved_constants_have_one_home():
    assert handler_constants.__all__ == ["Fold", "affine_row_values", "any_masked", "scale_shift_values"]
    for name in handler_constants.__all__:
        assert getattr(handler_constants, name) is getattr(constants, name), name
        assert name in constants.__all__
    assert constants.affine_row_values.__module__ == "prunekit.compact.proofs.constants"
