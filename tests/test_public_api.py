"""The public surface: torch's names all exist, and every exported name is the working object it claims to be."""

import importlib
import inspect
import math
import subprocess
import sys

import pytest
import torch
import torch.nn.utils.prune as tprune
from torch import nn

import prunekit


def test_every_public_torch_name_exists_in_prunekit():
    torch_names = [n for n in dir(tprune) if not n.startswith("_") and callable(getattr(tprune, n))
                   and getattr(getattr(tprune, n), "__module__", "") == tprune.__name__]
    missing = [n for n in torch_names if not hasattr(prunekit, n)]
    assert missing == []
    assert prunekit._validate_pruning_amount_init is prunekit.validate_pruning_amount_init
    assert prunekit._validate_pruning_amount is prunekit.validate_pruning_amount
    assert prunekit._compute_nparams_toprune is prunekit.compute_nparams_to_prune


def test_every_name_in_all_is_its_home_modules_documented_object():
    for name in prunekit.__all__:
        obj = getattr(prunekit, name)
        if inspect.ismodule(obj):  # prunekit.oneshot: the package is the verb (callable as its function)
            assert name in prunekit._SUBMODULES and callable(obj), name
            assert obj.__call__.__doc__ == getattr(obj, name).__doc__, name
            obj = getattr(obj, name)
        assert inspect.isclass(obj) or inspect.isfunction(obj), name
        home = prunekit._LAZY.get(name)
        if home is not None:  # lazily exported: the very object of the submodule that defines it
            assert getattr(importlib.import_module(home, "prunekit"), name) is obj, name
        assert obj.__module__.startswith("prunekit."), (name, obj.__module__)
        assert (obj.__doc__ or "").strip(), f"{name} has no docstring"
    for sub in ("compact", "training", "sparse", "kernels", "reparam", "report", "importance", "io", "oneshot"):
        assert getattr(prunekit, sub) is importlib.import_module(f"prunekit.{sub}")
    with pytest.raises(AttributeError, match="no attribute 'l1_unstrutured'"):
        prunekit.l1_unstrutured


def linear():
    torch.manual_seed(0)
    return nn.Linear(8, 6)  # 48 weights, 6 output channels


def zeros(m, name="weight"):
    return int((getattr(m, name + "_mask") == 0).sum())


def channels(m):
    return int((m.weight_mask.sum(dim=1) == 0).sum())


PRUNING_CALLS = {
    "identity": (lambda m: prunekit.identity(m, "weight"), lambda m: zeros(m) == 0),
    "random_unstructured": (lambda m: prunekit.random_unstructured(m, "weight", 0.25), lambda m: zeros(m) == 12),
    "l1_unstructured": (lambda m: prunekit.l1_unstructured(m, "weight", 5), lambda m: zeros(m) == 5),
    "custom_from_mask": (lambda m: prunekit.custom_from_mask(m, "weight", torch.eye(6, 8)),
                         lambda m: zeros(m) == 42),
    "random_structured": (lambda m: prunekit.random_structured(m, "weight", 2, dim=0), lambda m: channels(m) == 2),
    "ln_structured": (lambda m: prunekit.ln_structured(m, "weight", 0.5, n=2, dim=0), lambda m: channels(m) == 3),
    "global_unstructured": (lambda m: prunekit.global_unstructured([(m, "weight"), (m, "bias")],
                                                                  prunekit.L1Unstructured, amount=10),
                            lambda m: zeros(m) + zeros(m, "bias") == 10),
}
METHOD_CLASSES = {
    "Identity": ({}, "unstructured", 0), "RandomUnstructured": ({"amount": 3}, "unstructured", 3),
    "L1Unstructured": ({"amount": 3}, "unstructured", 3),
    "CustomFromMask": ({"mask": torch.ones(6, 8).tril()}, "global", 48 - 21),  # 1+2+...+6 kept
    "RandomStructured": ({"amount": 1, "dim": 0}, "structured", 8),
    "LnStructured": ({"amount": 1, "n": 1, "dim": 0}, "structured", 8),
}


@pytest.mark.parametrize("name", sorted(PRUNING_CALLS))
def test_each_pruning_function_prunes_exactly_what_it_says(name):
    m = linear()
    before = m.weight.detach().clone()
    call, check = PRUNING_CALLS[name]
    returned = call(m)
    assert returned is (None if name == "global_unstructured" else m)  # torch's functions return the module
    assert prunekit.is_pruned(m) and check(m)
    assert torch.equal(m.weight, m.weight_orig * m.weight_mask) and torch.equal(m.weight_orig, before)
    prunekit.remove(m, "weight")
    assert torch.equal(m.weight, before * (m.weight != 0)) and isinstance(m.weight, nn.Parameter)
    assert not hasattr(m, "weight_mask")


@pytest.mark.parametrize("name", sorted(METHOD_CLASSES))
def test_each_method_class_computes_and_applies_its_mask(name):
    kwargs, kind, pruned = METHOD_CLASSES[name]
    cls = getattr(prunekit, name)
    assert issubclass(cls, prunekit.BasePruningMethod) and cls.PRUNING_TYPE == kind
    m = linear()
    hook = cls.apply(m, "weight", **kwargs)
    assert isinstance(hook, cls) and zeros(m) == pruned
    assert list(m._forward_pre_hooks.values()) == [hook]
    cls.apply(m, "weight", **kwargs)  # a second pruning composes into one container
    (container,) = m._forward_pre_hooks.values()
    assert isinstance(container, prunekit.PruningContainer) and len(container) == 2


def test_amount_helpers_state_and_state_dict_helpers():
    assert prunekit.compute_nparams_to_prune(0.25, 10) == 2  # round half to even, as torch
    assert prunekit.validate_pruning_amount(3, 3) is None
    with pytest.raises(ValueError):
        prunekit.validate_pruning_amount(4, 3)
    with pytest.raises(TypeError):
        prunekit.validate_pruning_amount_init("0.5")
    with pytest.raises(ValueError):
        prunekit.validate_pruning_amount_init(1.5)
    m = nn.Sequential(linear(), nn.ReLU(), nn.Linear(6, 2))
    prunekit.l1_unstructured(m[0], "weight", 24)
    assert list(prunekit.iter_pruned(m)) == [("0", m[0], "weight")]
    assert prunekit.base_class(m[0]) is nn.Linear and type(m[0]) is not nn.Linear
    dense = prunekit.dense_state_dict(m)
    assert set(dense) == {"0.weight", "0.bias", "2.weight", "2.bias"} and int((dense["0.weight"] == 0).sum()) == 24
    plain = nn.Sequential(nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 2))
    prunekit.load_state_dict(plain, m.state_dict())
    assert torch.equal(plain[0].weight, m[0].weight)
    with pytest.raises(prunekit.StateDictMismatchError):
        prunekit.load_state_dict(plain, {"nope": torch.ones(1)})


def test_error_classes_keep_their_promises():
    assert issubclass(prunekit.PruningError, ValueError) and issubclass(prunekit.PruningError, AssertionError)
    assert issubclass(prunekit.FrameworkMismatchError, TypeError)
    assert issubclass(prunekit.StateDictMismatchError, Exception)
    with pytest.raises(prunekit.PruningError):
        prunekit.l1_unstructured(linear(), "weight", 0.5, importance_scores=torch.ones(3))


def test_training_compaction_sparse_and_report_exports_work():
    m = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    pruning = prunekit.prepare_pruning(m, {"prune_type": "magnitude", "pattern": "1x1", "target_sparsity": 0.5,
                                           "start_step": 0, "end_step": 0})
    pruning.step()
    report = prunekit.model_report(m)
    assert isinstance(report, prunekit.ModelReport) and isinstance(report.layers[0], prunekit.LayerReport)
    assert report.numel_layers == 16 * 16 + 4 * 16
    assert math.isclose(report.sparsity_layers, 0.5, abs_tol=1 / report.numel_layers)
    assert isinstance(prunekit.get_pruner({"0": m[0]}, {"prune_type": "snip", "pattern": "1x1"}),
                      prunekit.SnipPruner)
    assert {"magnitude", "snip", "snip_momentum", "pattern_lock", "gradient"} <= set(
        prunekit.training.registry.PRUNERS)


def test_import_needs_torch_only():
    code = ("import sys, prunekit; heavy = {'safetensors', 'yaml', 'rich', 'matplotlib', 'tensorplay', 'transformers'}; "
            "print(sorted(heavy & set(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]"
