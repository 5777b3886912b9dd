"""prunekit.training.selection: which modules a pruner config selects, and why a selection is empty."""

import pytest
from torch import nn

import prunekit
from prunekit.training import selection


def model():
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.Flatten(), nn.Linear(8, 4), nn.Linear(4, 2))


def test_selection_by_type_name_and_exclusion():
    m = model()
    cfg = {"prune_type": "magnitude"}
    assert list(selection.select_modules(m, cfg)) == ["0", "2", "3"]
    assert list(selection.select_modules(m, dict(cfg, prune_layer_type=["Linear"]))) == ["2", "3"]
    assert list(selection.select_modules(m, dict(cfg, names=["^2$", "^0$"]))) == ["0", "2"]
    assert list(selection.select_modules(m, dict(cfg, excluded_names=["^3$"], extra_excluded_names=["^0$"]))) == ["2"]
    prunekit.l1_unstructured(m[2], "weight", amount=2)  # a masked weight is still selected
    assert list(selection.select_modules(m, dict(cfg, prune_layer_type=["Linear"]))) == ["2", "3"]


@pytest.mark.parametrize("keys, message", [
    ({"prune_layer_type": ["Embedding"]}, "prune_layer_type=['Embedding'] matches no layer of Sequential; its layers "
                                          "with a 'weight' are of types ['Conv2d', 'Linear']"),
    ({"names": ["fc"]}, "names=['fc'] match none of the 3 layers of Sequential that prune_layer_type selects: "
                        "['0', '2', '3']"),
    ({"excluded_names": ["."]}, "exclude all 3 layers of Sequential that prune_layer_type and names select"),
])
def test_an_empty_selection_is_refused_with_the_reason(keys, message):
    cfg = dict({"prune_type": "magnitude"}, **keys)
    m = model()
    assert selection.select_modules(m, cfg) == {}
    assert message in selection.explain_empty_selection(m, cfg)
    with pytest.raises(ValueError) as info:
        selection.require_modules(m, cfg)
    assert str(info.value) == selection.explain_empty_selection(m, cfg)


def test_a_model_without_the_tensor_says_so():
    assert selection.explain_empty_selection(nn.Sequential(nn.ReLU()), {"prune_type": "magnitude"}) == (
        "pruner config: Sequential has no module with a tensor 'weight' to prune")


def test_the_old_import_path_and_the_package_give_the_same_functions():
    from prunekit.training import pruners

    for name in ("select_modules", "require_modules", "explain_empty_selection"):
        assert getattr(pruners, name) is getattr(selection, name)
    assert prunekit.training.select_modules is selection.select_modules
