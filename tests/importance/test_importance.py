"""The one importance registry: built-in scorers, registration, and the callers that share it."""

import pytest
import torch
from torch import nn

import prunekit
from prunekit.importance import (
    ActivationStats,
    Scorer,
    get_scorer,
    list_scorers,
    register_scorer,
    unregister_scorer,
)


def test_builtin_scorers_and_what_they_need():
    needs = {n: sorted(get_scorer(n).needs) for n in ("magnitude", "l2", "snip", "gradient", "wanda", "obs")}
    assert needs == {
        "magnitude": ["weight"], "l2": ["weight"], "snip": ["gradient", "weight"], "gradient": ["gradient"],
        "wanda": ["activations", "weight"], "obs": ["hessian", "weight"],
    }
    assert get_scorer("taylor").name == "snip" and get_scorer("l1").name == "magnitude"
    assert get_scorer("sparsegpt").name == "obs"
    assert get_scorer("wanda").needs_calibration and not get_scorer("snip").needs_calibration


def test_scores_match_their_definitions():
    w = torch.randn(5, 7)
    g = torch.randn(5, 7)
    assert torch.equal(get_scorer("magnitude").score(w), w.abs())
    assert torch.equal(get_scorer("snip").score(w, grad=g), (w * g).abs())
    assert torch.equal(get_scorer("gradient").score(w, grad=g), g.abs())
    x = torch.randn(3, 11, 7)
    stats = ActivationStats(7, hessian=True)
    stats.add(x[:2])
    stats.add(x[2:])
    flat = x.reshape(-1, 7)
    assert stats.count == 33
    assert torch.allclose(stats.norm, flat.norm(dim=0))
    assert torch.allclose(stats.xtx, flat.t() @ flat, atol=1e-5)
    assert torch.allclose(get_scorer("wanda").score(w, stats=stats), w.abs() * flat.norm(dim=0))
    # OBS: w^2 / diag(inv(H + 0.01 mean(diag) I))^2, written out directly
    h = (flat.t() @ flat).double()
    h += 0.01 * h.diagonal().mean() * torch.eye(7, dtype=torch.float64)
    ref = w.double() ** 2 / torch.linalg.inv(h).diagonal()
    assert torch.allclose(get_scorer("obs").score(w, stats=stats).double(), ref, rtol=1e-4)


def test_activation_stats_token_mask_and_dead_inputs():
    s = ActivationStats(2, hessian=True)
    s.add(torch.tensor([[[1.0, 0.0], [9.0, 0.0]]]), token_mask=torch.tensor([[True, False]]))
    assert s.count == 1 and s.sq_norm.tolist() == [1.0, 0.0]
    # an input that was always zero: its weights score 0 under OBS and the Hessian stays invertible
    sc = get_scorer("obs").score(torch.tensor([[1.0, 5.0]]), stats=s)
    assert sc[0, 1] == 0 and sc[0, 0] > 0
    with pytest.raises(ValueError, match="inputs have 3 features, these statistics 2"):
        s.add(torch.ones(1, 3))


def test_unit_scores_single_tensor_and_group():
    w = torch.tensor([[3.0, -4.0], [1.0, 0.0]])
    assert get_scorer("magnitude").unit_scores(w, 0).tolist() == [7.0, 1.0]
    assert get_scorer("l2").unit_scores(w, 0).tolist() == [5.0, 1.0]
    # the ln scorer's single-tensor norms are the kernel's (torch.norm's) for every order
    for n in (1, 2, 3, float("inf"), float("-inf"), "fro", "nuc"):
        assert torch.equal(get_scorer("ln", n=n).unit_scores(w, 0), prunekit.kernels.channel_norms(w, n, 0))
    # a group adds partials over tensors, then finalizes once: sqrt(9 + 16 + 1) for l2
    l2 = get_scorer("l2")
    total = l2.unit_partial(w, 0) + l2.unit_partial(torch.tensor([[1.0], [2.0]]), 0)
    assert torch.allclose(l2.unit_finalize(total), torch.tensor([26.0, 5.0]).sqrt())
    with pytest.raises(ValueError, match="cannot add up over a group"):
        get_scorer("ln", n="nuc").unit_partial(w, 0)


def test_missing_inputs_say_what_to_do():
    w = torch.ones(2, 3)
    with pytest.raises(ValueError, match="scorer 'snip' needs gradients: 'fc.weight' has none"):
        get_scorer("snip").check_inputs(w, where="fc.weight")
    with pytest.raises(ValueError, match=r"needs a calibration pass \(activations\).*prunekit.oneshot"):
        get_scorer("wanda").score(w)
    with pytest.raises(ValueError, match="hessian=True"):
        get_scorer("obs").score(w, stats=ActivationStats(3))
    with pytest.raises(ValueError, match="has 3 input features but the activation statistics have 4"):
        get_scorer("wanda").score(w, stats=ActivationStats(4))
    with pytest.raises(ValueError, match="2-D weights"):
        get_scorer("wanda").score(torch.ones(2, 3, 1), stats=ActivationStats(3))


def test_registry_errors():
    with pytest.raises(ValueError, match="importance 'magnitud' is unknown.*did you mean 'magnitude'"):
        get_scorer("magnitud")
    with pytest.raises(ValueError, match="already registered; pass overwrite=True"):
        register_scorer("magnitude")(lambda weight: weight)
    with pytest.raises(ValueError, match=r"needs=\['optimizer'\] is unknown"):
        register_scorer("x", needs=("weight", "optimizer"))(lambda weight: weight)
    with pytest.raises(TypeError, match="takes no parameters"):
        register_scorer("tmp_fn")(lambda weight: weight)
        try:
            get_scorer("tmp_fn", p=2)
        finally:
            unregister_scorer("tmp_fn")
    with pytest.raises(ValueError, match="no scorer named 'nope'"):
        unregister_scorer("nope")
    assert "tmp_fn" not in list_scorers() and "x" not in list_scorers()


@pytest.fixture
def cube():
    @register_scorer("cube")
    def cube(weight):
        return weight.abs() ** 3

    yield cube
    unregister_scorer("cube")


def test_a_registered_function_scores_and_checks_its_shape(cube):
    s = get_scorer("cube")
    assert s.score(torch.tensor([-2.0, 1.0])).tolist() == [8.0, 1.0]

    @register_scorer("bad_shape")
    def bad(weight):
        return weight.sum()

    try:
        with pytest.raises(ValueError, match="returned a tensor of shape \\(\\) for a weight of shape \\(2,\\)"):
            get_scorer("bad_shape").score(torch.ones(2))
    finally:
        unregister_scorer("bad_shape")


def test_a_registered_class_takes_parameters():
    @register_scorer("power")
    class Power(Scorer):
        def __init__(self, p=2.0):
            self.p = p

        def score(self, weight, *, grad=None, stats=None):
            return weight.abs().float() ** self.p

    try:
        assert get_scorer("power", p=3.0).score(torch.tensor([2.0])).tolist() == [8.0]
        assert get_scorer("power").name == "power"
    finally:
        unregister_scorer("power")


def test_one_user_scorer_is_used_by_training_and_compaction(cube):
    from prunekit.compact import prune_groups
    from prunekit.training import get_criterion

    # training: a pruner whose criterion is the user's scorer keeps the largest |w|^3 (= largest |w|)
    crit = get_criterion("cube")
    w = torch.tensor([[1.0, -3.0], [2.0, 0.5]])
    assert torch.equal(crit.score("fc", w), w.abs() ** 3)
    assert not crit.needs_grad
    # compaction: the same name ranks whole channels
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2))
    d = prune_groups(m, torch.randn(1, 4), 0.5, importance="cube")
    ref = d_ref = None
    with torch.no_grad():
        per = (m[0].weight_orig.abs() ** 3).sum(1) + (m[0].bias_orig.abs() ** 3) + (m[2].weight_orig.abs() ** 3).sum(0)
        ref = sorted(torch.argsort(per, stable=True)[:3].tolist())
        d_ref = d[0].removed
    assert d_ref == ref
