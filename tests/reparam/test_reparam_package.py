"""prunekit.reparam as a package: its import paths, its pickles, its tiers and the names of the value."""

import copy
import importlib
import pickle
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import prunekit
from prunekit import methods, reparam
from prunekit.reparam import _internal

DATA = Path(__file__).parent / "data"

# every name other code imported from prunekit.reparam when it was one module (reparam.py)
PUBLIC_BEFORE = ["apply_mask", "base_class", "describe", "effective", "effective_for_reading", "find_hook", "get_mask",
                 "is_masked", "is_pruned", "iter_masked", "iter_pruned", "masked", "observe_pruned", "owner_of",
                 "pruned_names", "remove", "stored", "unmask"]
INTERNAL_BEFORE = ["Snapshot", "after_restore", "assign", "atomic", "check_prunable", "current_value", "drop_cache",
                   "install", "masked_product", "refresh_flat_weights", "sync", "with_context"]


def _model():
    """The model of tests/reparam/data/pruned_before_package.pkl, built and pruned the same way."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.LSTM(3, 2))
    prunekit.l1_unstructured(model[0], "weight", 0.5)
    prunekit.custom_from_mask(model[0], "bias", torch.tensor([1, 0, 1]))
    prunekit.l1_unstructured(model[0], "weight", 2)
    prunekit.l1_unstructured(model[1], "weight_ih_l0", 0.25)
    return model


def _hooks(m):
    return [(h._tensor_name, [type(x).__name__ for x in getattr(h, "_pruning_methods", (h,))])
            for h in m._forward_pre_hooks.values()]


def _same_pruned_model(a, b):
    for x, y in zip(a.modules(), b.modules()):
        assert type(x) is type(y) and reparam.pruned_names(x) == reparam.pruned_names(y)
        assert _hooks(x) == _hooks(y)
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb) and all(torch.equal(sa[k], sb[k]) for k in sa)
    x = torch.randn(2, 4)
    with torch.no_grad():
        assert torch.equal(a[1](a[0](x))[0], b[1](b[0](x))[0])


def test_a_pickle_written_before_the_package_loads():
    data = (DATA / "pruned_before_package.pkl").read_bytes()
    assert b"prunekit.reparam" in data and b"_rebuild" in data and b"prunekit.reparam.classes" not in data
    loaded = pickle.loads(data)
    assert reparam.pruned_names(loaded[0]) == {"weight", "bias"} and reparam.base_class(loaded[0]) is nn.Linear
    assert loaded[1]._flat_weights[0] is not loaded[1].weight_ih_l0_orig  # the RNN serves the effective value
    assert torch.equal(loaded[1]._flat_weights[0], reparam.effective(loaded[1], "weight_ih_l0"))
    _same_pruned_model(loaded, _model())


def test_pickles_and_copies_still_name_prunekit_reparam_rebuild():
    model = _model()
    data = pickle.dumps(model, protocol=4)
    assert b"prunekit.reparam.classes" not in data  # the path older prunekit can load too
    assert prunekit.reparam._rebuild is importlib.import_module("prunekit.reparam.classes")._rebuild
    _same_pruned_model(pickle.loads(data), model)
    _same_pruned_model(copy.deepcopy(model), model)


def test_every_name_imported_before_the_package_still_imports():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        for name in PUBLIC_BEFORE + INTERNAL_BEFORE:
            ns = {}
            exec(f"from prunekit.reparam import {name}", ns)
            assert callable(ns[name]), name
    assert set(PUBLIC_BEFORE) < set(reparam.__all__)
    assert set(_internal.__all__).isdisjoint(reparam.__all__)
    for name in _internal.__all__:  # the internal tier: the same objects, by either path
        assert getattr(reparam, name) is getattr(_internal, name)
    with pytest.raises(AttributeError, match="module 'prunekit.reparam' has no attribute 'register_mask_installer'"):
        reparam.register_mask_installer


def test_the_old_spellings_of_the_value_are_its_one_name():
    m = prunekit.custom_from_mask(nn.Linear(3, 2), "weight", torch.tensor([[1, 0, 1], [0, 1, 1]]))
    assert reparam.current_value is reparam.effective and reparam.masked_product is _internal.effective_with_grad
    assert torch.equal(reparam.current_value(m, "weight"), m.weight_orig.detach() * m.weight_mask)


def test_apply_mask_lives_in_the_methods_layer_and_the_old_name_warns():
    m = nn.Linear(3, 2)
    prunekit.l1_unstructured(m, "weight", 1)
    kept = m.weight_mask.clone()
    methods.apply_mask(m, "weight", torch.tensor([[0, 1, 1], [1, 1, 1]]))
    assert _hooks(m) == [("weight", ["L1Unstructured", "CustomFromMask"])]
    assert torch.equal(m.weight_mask, kept * torch.tensor([[0.0, 1, 1], [1, 1, 1]]))
    with pytest.warns(DeprecationWarning, match="call prunekit.methods.apply_mask"):
        old = reparam.apply_mask
    assert old is methods.apply_mask
    fresh = nn.Linear(2, 1, bias=False)
    with pytest.warns(DeprecationWarning):
        reparam.apply_mask(fresh, "weight", torch.tensor([[1, 0]]))
    assert _hooks(fresh) == [("weight", ["CustomFromMask"])] and fresh.weight_mask.tolist() == [[1.0, 0.0]]
