"""The catalogue of bad inputs: a clear error naming module, tensor and value, and no change at all.

The catalogue runs on torch and TensorPlay modules (the ``framework`` fixture).
"""

import math

import pytest
import torch
from torch import nn

import prunekit as prune


def _copy(t):
    """A torch copy of a tensor of either framework."""
    if t is None:
        return None
    if isinstance(t, torch.Tensor):
        return t.detach().clone()
    return torch.from_dlpack(t.detach().contiguous()).clone()


def state(module: nn.Module):
    """Everything a failed call must leave alone."""
    out = {"class": type(module)}
    for m_name, m in module.named_modules():
        out[m_name, "params"] = [(k, id(v), _copy(v)) for k, v in m._parameters.items()]
        out[m_name, "buffers"] = [(k, id(v), _copy(v)) for k, v in m._buffers.items()]
        out[m_name, "hooks"] = [(k, id(h), len(getattr(h, "_pruning_methods", ()))) for k, h in m._forward_pre_hooks.items()]
        out[m_name, "class"] = type(m)
    return out


def same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], list):
            assert len(a[k]) == len(b[k]), k
            for x, y in zip(a[k], b[k]):
                assert x[:2] == y[:2], k
                if isinstance(x[-1], torch.Tensor):
                    assert torch.equal(x[-1], y[-1]) or (torch.isnan(x[-1]).any() and torch.equal(x[-1].nan_to_num(), y[-1].nan_to_num())), k
                else:
                    assert x[-1] == y[-1], k
        else:
            assert a[k] is b[k], k


def linear(fw):
    fw.manual_seed(0)
    return fw.nn.Linear(4, 3)


def pruned_linear(fw):
    m = linear(fw)
    prune.l1_unstructured(m, "weight", 0.25)
    return m


def with_nan(fw):
    m = linear(fw)
    w = torch.randn(3, 4)
    w[1, 2] = math.nan
    return fw.set_params(m, {"weight": w})


def complex_param(fw):
    m = fw.nn.Linear(4, 3)
    m.weight = fw.nn.Parameter(fw.tensor(torch.randn(3, 4, dtype=torch.complex64)))
    return m


def mlp(fw):
    fw.manual_seed(0)
    return fw.nn.Sequential(fw.nn.Linear(4, 8), fw.nn.ReLU(), fw.nn.Linear(8, 4))


def pruned_mlp(fw):
    m = mlp(fw)
    prune.l1_unstructured(m[0], "weight", 0.25)
    return m


def _prepare(config):
    from prunekit.training import prepare_pruning

    def call(m, fw):
        prepare_pruning(m, {"prune_type": "magnitude", "pattern": "1x1", "target_sparsity": 0.5, **config})

    return call


def _pruner(config):
    from prunekit.training import MagnitudePruner

    def call(m, fw):
        MagnitudePruner(m, {"prune_type": "magnitude", "pattern": "1x1", "target_sparsity": 0.5, **config})

    return call


def bool_param(fw):
    m = fw.nn.Linear(4, 3)
    m.weight = fw.nn.Parameter(fw.tensor(torch.arange(12).view(3, 4) % 3 == 0), requires_grad=False)
    return m


# (label, module factory, call, error type, words the message must contain)
CASES = [
    ("amount is a string", linear, lambda m, fw: prune.l1_unstructured(m, "weight", "0.3"), TypeError, ["Linear", "weight", "'0.3'"]),
    ("amount is None", linear, lambda m, fw: prune.random_unstructured(m, "weight", None), TypeError, ["Linear", "None"]),
    ("amount is complex", linear, lambda m, fw: prune.ln_structured(m, "weight", 1j, n=2, dim=0), TypeError, ["Linear", "1j"]),
    ("negative int amount", linear, lambda m, fw: prune.l1_unstructured(m, "weight", -1), ValueError, ["Linear", "weight", "amount=-1"]),
    ("negative float amount", linear, lambda m, fw: prune.random_structured(m, "weight", -0.1, dim=0), ValueError, ["Linear", "amount=-0.1"]),
    ("float above 1", linear, lambda m, fw: prune.l1_unstructured(m, "weight", 1.5), ValueError, ["Linear", "weight", "amount=1.5"]),
    ("NaN amount", linear, lambda m, fw: prune.l1_unstructured(m, "weight", math.nan), ValueError, ["Linear", "amount=nan"]),
    ("int above entries", linear, lambda m, fw: prune.l1_unstructured(m, "weight", 13), ValueError, ["Linear", "weight", "amount=13", "12"]),
    ("int above remaining entries", pruned_linear, lambda m, fw: prune.l1_unstructured(m, "weight", 10), ValueError, ["Linear", "weight", "amount=10", "9"]),
    ("int above channels", linear, lambda m, fw: prune.ln_structured(m, "weight", 4, n=1, dim=0), ValueError, ["Linear", "weight", "amount=4", "3"]),
    ("misspelled name", linear, lambda m, fw: prune.l1_unstructured(m, "wieght", 0.5), ValueError, ["Linear", "'wieght'", "did you mean 'weight'"]),
    ("name not a str", linear, lambda m, fw: prune.l1_unstructured(m, 0, 0.5), TypeError, ["Linear", "0"]),
    ("not a module", linear, lambda m, fw: prune.l1_unstructured(m.weight, "weight", 0.5), TypeError, ["Parameter", "nn.Module"]),
    ("a buffer", lambda fw: fw.nn.BatchNorm1d(3), lambda m, fw: prune.l1_unstructured(m, "running_mean", 0.5), TypeError, ["BatchNorm1d", "running_mean", "buffer"]),
    ("complex weights by magnitude", complex_param, lambda m, fw: prune.l1_unstructured(m, "weight", 0.5), TypeError, ["Linear", "weight", "complex64"]),
    ("bool importance scores", linear, lambda m, fw: prune.l1_unstructured(m, "weight", 0.5, importance_scores=fw.tensor(torch.ones(3, 4, dtype=torch.bool))), TypeError, ["Linear", "weight", "bool"]),
    ("dim too large", linear, lambda m, fw: prune.ln_structured(m, "weight", 1, n=2, dim=2), IndexError, ["Linear", "weight", "2", "[-2, 1]"]),
    ("dim too negative", linear, lambda m, fw: prune.random_structured(m, "weight", 1, dim=-3), IndexError, ["Linear", "weight", "-3"]),
    ("dim too large on a pruned tensor", pruned_linear, lambda m, fw: prune.ln_structured(m, "weight", 1, n=2, dim=5), IndexError, ["Linear", "weight", "5"]),
    ("dim not an int", linear, lambda m, fw: prune.ln_structured(m, "weight", 1, n=2, dim=0.5), TypeError, ["Linear", "0.5"]),
    ("bad norm order", linear, lambda m, fw: prune.ln_structured(m, "weight", 1, n="l2", dim=0), ValueError, ["Linear", "'l2'", "'fro'"]),
    ("scores of the wrong shape", linear, lambda m, fw: prune.l1_unstructured(m, "weight", 0.5, importance_scores=fw.tensor(torch.ones(4, 3))), prune.PruningError, ["Linear", "weight", "(4, 3)", "(3, 4)"]),
    ("scores of the wrong shape, pruned", pruned_linear, lambda m, fw: prune.ln_structured(m, "weight", 1, n=2, dim=0, importance_scores=fw.tensor(torch.ones(12))), prune.PruningError, ["Linear", "weight", "(12,)"]),
    ("scores not a tensor", linear, lambda m, fw: prune.l1_unstructured(m, "weight", 0.5, importance_scores=[1, 2]), TypeError, ["Linear", "weight", "list"]),
    ("structured on 1-D", linear, lambda m, fw: prune.ln_structured(m, "bias", 1, n=2, dim=0), ValueError, ["Linear", "bias", "(3,)", "l1_unstructured"]),
    ("random structured on 1-D", linear, lambda m, fw: prune.random_structured(m, "bias", 1, dim=0), ValueError, ["Linear", "bias", "(3,)"]),
    ("NaN among the weights", with_nan, lambda m, fw: prune.l1_unstructured(m, "weight", 0.5), ValueError, ["Linear", "weight", "NaN", "nan_to_num"]),
    ("NaN among the scores", linear, lambda m, fw: prune.l1_unstructured(m, "weight", 2, importance_scores=fw.tensor(torch.tensor([[0.0, math.nan, 1, 2]] * 3))), ValueError, ["Linear", "weight", "3 NaN"]),
    ("NaN channel norm", with_nan, lambda m, fw: prune.ln_structured(m, "weight", 1, n=2, dim=0), ValueError, ["Linear", "weight", "NaN"]),
    ("custom mask of the wrong shape", linear, lambda m, fw: prune.custom_from_mask(m, "weight", fw.tensor(torch.ones(4))), prune.PruningError, ["Linear", "weight", "(4,)"]),
    ("custom mask not a tensor", pruned_linear, lambda m, fw: prune.custom_from_mask(m, "weight", [[1, 0]]), TypeError, ["Linear", "weight", "list"]),
    ("mask_dtype not a dtype", linear, lambda m, fw: prune.l1_unstructured(m, "weight", 0.5, mask_dtype="bool"), TypeError, ["Linear", "weight", "'bool'"]),
    ("remove what is not pruned", linear, lambda m, fw: prune.remove(m, "weight"), ValueError, ["Linear", "weight", "has to be pruned"]),
    ("global: not an iterable", linear, lambda m, fw: prune.global_unstructured(5, prune.L1Unstructured, amount=0.5), TypeError, ["(module, name)", "int"]),
    ("global: a module instead of pairs", linear, lambda m, fw: prune.global_unstructured(m, prune.L1Unstructured, amount=0.5), TypeError, ["(module, name)", "Linear"]),
    ("global: entries not pairs", linear, lambda m, fw: prune.global_unstructured([m], prune.L1Unstructured, amount=0.5), TypeError, ["parameters[0]", "Linear"]),
    ("global: name not a str", linear, lambda m, fw: prune.global_unstructured([(m, 1)], prune.L1Unstructured, amount=0.5), TypeError, ["parameters[0]", "1"]),
    ("global: empty", linear, lambda m, fw: prune.global_unstructured([], prune.L1Unstructured, amount=0.5), ValueError, ["empty"]),
    ("global: duplicate", linear, lambda m, fw: prune.global_unstructured([(m, "weight"), (m, "weight")], prune.L1Unstructured, amount=0.5), ValueError, ["twice", "Linear", "weight"]),
    ("global: bad name, after a good one", linear, lambda m, fw: prune.global_unstructured([(m, "weight"), (m, "wieght")], prune.L1Unstructured, amount=0.5), ValueError, ["Linear", "'wieght'"]),
    ("global: structured method", linear, lambda m, fw: prune.global_unstructured([(m, "weight")], prune.LnStructured, amount=0.5, n=2, dim=0), TypeError, ["unstructured", "LnStructured"]),
    ("global: method not a class", linear, lambda m, fw: prune.global_unstructured([(m, "weight")], prune.l1_unstructured, amount=0.5), TypeError, ["BasePruningMethod", "l1_unstructured"]),
    ("global: amount above total", linear, lambda m, fw: prune.global_unstructured([(m, "weight"), (m, "bias")], prune.L1Unstructured, amount=16), ValueError, ["amount=16", "15"]),
    ("global: scores wrong shape", linear, lambda m, fw: prune.global_unstructured([(m, "weight")], prune.L1Unstructured, importance_scores={(m, "weight"): fw.tensor(torch.ones(2))}, amount=0.5), prune.PruningError, ["Linear", "weight", "(2,)"]),
    ("global: scores not a dict", linear, lambda m, fw: prune.global_unstructured([(m, "weight")], prune.L1Unstructured, importance_scores=[1], amount=0.5), TypeError, ["dict"]),
    ("training: names match no layer", mlp, _prepare({"names": ["nomatch"]}), ValueError, ["names=['nomatch']", "match none", "['0', '2']"]),
    ("training: names match no layer, pruned model", pruned_mlp, _prepare({"names": ["^fc"]}), ValueError, ["names=['^fc']", "['0', '2']"]),
    ("training: misspelled layer type", mlp, _prepare({"prune_layer_type": ["Linaer"]}), ValueError, ["prune_layer_type=['Linaer']", "['Linear']", "Did you mean 'Linear'"]),
    ("training: layer type of no layer", mlp, _prepare({"prune_layer_type": ["Conv2d"]}), ValueError, ["prune_layer_type=['Conv2d']", "Sequential", "['Linear']"]),
    ("training: everything excluded", mlp, _prepare({"excluded_names": ["^0$"], "extra_excluded_names": ["2"]}), ValueError, ["excluded_names=['^0$']", "extra_excluded_names=['2']", "exclude all 2 layers", "['0', '2']"]),
    ("training: second entry matches nothing", mlp, _prepare({"pruners": [{"names": ["^0$"]}, {"names": ["^3$"]}]}), ValueError, ["pruners[1]", "names=['^3$']", "['0', '2']"]),
    ("training: Pruner on a model, nothing selected", mlp, _pruner({"names": ["nomatch"]}), ValueError, ["names=['nomatch']", "['0', '2']"]),
    ("training: unreachable target after masking", pruned_mlp, _prepare({"target_sparsity": 0.99, "max_sparsity_ratio_per_layer": 0.5}), ValueError, ["target_sparsity=0.99", "max_sparsity_ratio_per_layer=0.5"]),
    ("the stored tensor of a pruned one", pruned_linear, lambda m, fw: prune.l1_unstructured(m, "weight_orig", 0.5), ValueError, ["Linear", "weight_orig", "stored tensor", "prune 'weight' itself"]),
    ("the mask of a pruned tensor", pruned_linear, lambda m, fw: prune.random_unstructured(m, "weight_mask", 1), ValueError, ["Linear", "weight_mask", "the mask", "'weight'"]),
    ("global: the stored tensor of a pruned one", pruned_linear, lambda m, fw: prune.global_unstructured([(m, "bias"), (m, "weight_orig")], prune.L1Unstructured, amount=0.5), ValueError, ["Linear", "weight_orig", "stored tensor"]),
    ("bool weights by magnitude", bool_param, lambda m, fw: prune.l1_unstructured(m, "weight", 2), TypeError, ["Linear", "weight", "bool", "importance_scores"]),
    ("global: NaN in one tensor", with_nan, lambda m, fw: prune.global_unstructured([(m, "bias"), (m, "weight")], prune.L1Unstructured, amount=0.5), ValueError, ["Linear", "weight", "NaN"]),
]


@pytest.mark.parametrize("label,factory,call,exc,words", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_refused_clearly_and_changes_nothing(framework, label, factory, call, exc, words):
    module = factory(framework)
    before = state(module)
    with pytest.raises(exc) as info:
        call(module, framework)
    assert isinstance(info.value, (ValueError, TypeError, IndexError)), "user errors are ValueError/TypeError/IndexError"
    message = str(info.value)
    for word in words:
        assert word in message, f"{word!r} not in {message!r}"
    same(before, state(module))


def test_torch_assertion_errors_are_still_assertion_errors(framework):
    m = linear(framework)
    with pytest.raises(AssertionError):
        prune.l1_unstructured(m, "weight", 0.5, importance_scores=framework.tensor(torch.ones(2)))


def test_inf_is_ranked_as_the_largest_magnitude(framework):
    w = torch.randn(3, 4)
    w[0, 0], w[0, 1] = math.inf, -math.inf
    m = framework.set_params(linear(framework), {"weight": w})
    prune.l1_unstructured(m, "weight", 10)
    assert int((m.weight_mask == 0).sum()) == 10
    assert m.weight_mask[0, 0] == 1 and m.weight_mask[0, 1] == 1


def test_failure_inside_the_install_step_rolls_back(framework, monkeypatch):
    from prunekit import base

    m = pruned_linear(framework)
    before = state(m)

    def broken(*args, **kwargs):
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(base, "install", broken)
    with pytest.raises(RuntimeError, match="disk on fire"):
        prune.l1_unstructured(m, "weight", 0.25)
    same(before, state(m))
    with pytest.raises(RuntimeError, match="disk on fire"):
        prune.l1_unstructured(linear(framework), "weight", 0.25)


def test_global_failure_on_a_later_tensor_rolls_back_the_earlier_ones(framework, monkeypatch):
    from prunekit import methods

    model = framework.nn.Sequential(framework.nn.Linear(4, 4), framework.nn.Linear(4, 4))
    prune.l1_unstructured(model[0], "weight", 0.25)
    before = state(model)
    real = methods.CustomFromMask.apply.__func__
    calls = []

    def flaky(cls, module, name, mask, *, mask_dtype=None):
        calls.append(module)
        if len(calls) == 2:
            raise RuntimeError("second tensor fails")
        return real(cls, module, name, mask, mask_dtype=mask_dtype)

    monkeypatch.setattr(methods.CustomFromMask, "apply", classmethod(flaky))
    with pytest.raises(RuntimeError, match="second tensor fails"):
        prune.global_unstructured([(model[0], "weight"), (model[1], "weight")], prune.L1Unstructured, amount=0.5)
    same(before, state(model))


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint8, torch.bool])
@pytest.mark.parametrize("method", ["random_unstructured", "random_structured", "ln_structured", "custom_from_mask",
                                    "identity", "l1_unstructured"])
def test_integer_and_bool_weights_keep_their_dtype(dtype, method):
    """As torch: the mask and the pruned tensor have the weight's dtype (torch fails on some: we work or refuse)."""
    m = nn.Linear(4, 3)
    w = torch.arange(12).view(3, 4) % 3 == 0 if dtype == torch.bool else (torch.arange(12).view(3, 4) + 1).to(dtype)
    m.weight = nn.Parameter(w, requires_grad=False)
    call = {
        "random_unstructured": lambda: prune.random_unstructured(m, "weight", 3),
        "random_structured": lambda: prune.random_structured(m, "weight", 1, dim=0),
        "ln_structured": lambda: prune.ln_structured(m, "weight", 1, n=1, dim=0),
        "custom_from_mask": lambda: prune.custom_from_mask(m, "weight", torch.tensor([[1, 0, 1, 0]] * 3)),
        "identity": lambda: prune.identity(m, "weight"),
        "l1_unstructured": lambda: prune.l1_unstructured(m, "weight", 3),
    }[method]
    if dtype == torch.bool and method == "l1_unstructured":
        with pytest.raises(TypeError, match="magnitude ranking needs real numbers"):
            call()
        assert not prune.is_pruned(m)
        return
    call()
    assert m.weight_mask.dtype == dtype and m.weight.dtype == dtype
    kept = m.weight_mask != 0
    assert torch.equal(m.weight, torch.where(kept, w, torch.zeros((), dtype=dtype)))
    prune.remove(m, "weight")
    assert m.weight.dtype == dtype
