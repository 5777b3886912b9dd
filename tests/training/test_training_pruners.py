"""Training-aware pruners on real data (scikit-learn's bundled digits), small and fast.

Every test runs on PyTorch and on TensorPlay through the ``framework`` fixture
(``fw``): the models are ``fw.nn`` modules with the weights of the seeded torch
model (DLPack), trained with ``fw.ns.optim`` optimizers on ``fw`` tensors;
results are brought back to torch for the assertions.
"""

import copy

import pytest
import torch
from torch import nn

import prunekit
from prunekit._backend import FrameworkMismatchError, is_tensor
from prunekit.training import (
    MagnitudePruner,
    Pruner,
    PruningConfig,
    SnipMomentumPruner,
    SnipPruner,
    get_pruner,
    prepare_pruning,
    register_pruners,
)
from prunekit.kernels.patterns import get_pattern, to_2d
from prunekit.training.registry import PRUNERS


@pytest.fixture(scope="module")
def digits():
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.data, dtype=torch.float32) / 16.0
    y = torch.tensor(d.target, dtype=torch.long)
    g = torch.Generator().manual_seed(0)
    perm = torch.randperm(len(y), generator=g)
    return x[perm[:1400]], y[perm[:1400]], x[perm[1400:]], y[perm[1400:]]


@pytest.fixture(scope="module")
def fdigits(framework, digits):
    """The digits split as tensors of the framework under test."""
    return tuple(framework.tensor(t) for t in digits)


def _mlp_layers(nn_):
    return nn_.Sequential(nn_.Linear(64, 64), nn_.ReLU(), nn_.Linear(64, 32), nn_.ReLU(), nn_.Linear(32, 10))


def mlp(fw=None, state=None):
    """The seeded MLP (torch), as an ``fw.nn`` twin with the same weights when ``fw`` is TensorPlay."""
    torch.manual_seed(0)
    model = _mlp_layers(nn)
    if state is not None:
        model.load_state_dict(state)
    if fw is None or fw.is_torch:
        return model
    return fw.twin(model, _mlp_layers)


@pytest.fixture(scope="module")
def dense(digits):
    """A dense MLP trained on digits in torch (state dict, test accuracy)."""
    x, y, xt, yt = digits
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    train(model, opt, x, y, 80)
    return copy.deepcopy(model.state_dict()), accuracy(model, xt, yt)


def make_cnn(ns):
    """A small CNN class of framework ``ns`` (``torch`` or ``tensorplay``)."""

    class CNN(ns.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1 = ns.nn.Conv2d(1, 8, 3, padding=1)
            self.conv2 = ns.nn.Conv2d(8, 16, 3)
            self.fc = ns.nn.Linear(16 * 6 * 6, 10)

        def forward(self, x):
            x = x.view(-1, 1, 8, 8)
            x = ns.relu(self.conv2(ns.relu(self.conv1(x))))
            return self.fc(x.flatten(1))

    return CNN()


def cnn(fw):
    torch.manual_seed(0)
    model = make_cnn(torch)
    return model if fw.is_torch else fw.twin(model, lambda nn_: make_cnn(fw.ns))


def optim(fw):
    return torch.optim if fw is None or fw.is_torch else fw.ns.optim


def batches(x, y, n_steps, bs=100):
    for i in range(n_steps):
        j = (i * bs) % (len(y) - bs)
        yield x[j:j + bs], y[j:j + bs]


def _loss(model):
    return (torch.nn if isinstance(model, torch.nn.Module) else __import__("tensorplay").nn).CrossEntropyLoss()


def train(model, opt, x, y, n_steps, pruning=None, manual=False):
    loss_fn = _loss(model)
    for i, (xb, yb) in enumerate(batches(x, y, n_steps)):
        if manual:
            pruning.on_step_begin(i)
        opt.zero_grad()
        loss_fn(model(xb), yb).backward()
        if manual:
            pruning.on_before_optimizer_step()
        opt.step()
        if manual:
            pruning.on_after_optimizer_step()
            pruning.on_step_end()


def T(t):
    """Any framework's tensor as a torch tensor (a copy), for assertions."""
    if isinstance(t, torch.Tensor):
        return t.detach().clone()
    return torch.from_dlpack(t.detach().contiguous()).clone()


def accuracy(model, x, y):
    ns = torch if isinstance(model, torch.nn.Module) else __import__("tensorplay")
    with ns.no_grad():
        return T((model(x).argmax(1) == y).float()).mean().item()


def assert_pruned_entries_frozen(pruning, opt):
    """weight_orig and every per-entry optimizer state are exactly zero where masks are zero -- except
    torch Adam-style second moments, which hold at most _optim.TINY there while the pruner drives the
    optimizer (the first moment is exactly zero, so the update is zero: see prunekit.training._optim)."""
    from prunekit.training import _optim

    touched = 0
    tiny_ok = pruning.wired and _optim.refill_period(opt, next(iter(pruning.pruners[0].modules.values())).weight_orig)
    for p in pruning.pruners:
        for name, m in p.modules.items():
            mask = T(m.weight_mask)
            pruned = mask == 0
            assert torch.all(T(m.weight_orig)[pruned] == 0), name
            assert torch.all(T(m.weight)[pruned] == 0), name
            for k, v in opt.state.get(m.weight_orig, {}).items():
                if is_tensor(v) and tuple(v.shape) == tuple(mask.shape):
                    if tiny_ok and k in _optim.SECOND_MOMENTS:
                        assert torch.all((T(v)[pruned] >= 0) & (T(v)[pruned] <= _optim.TINY)), name
                    else:
                        assert torch.all(T(v)[pruned] == 0), name
                    touched += 1
    return touched


def mask_zeros(pruning):
    return sum(int((m.weight_mask == 0).sum()) for p in pruning.pruners for m in p.modules.values())


def mask_numel(pruning):
    return sum(m.weight_mask.numel() for p in pruning.pruners for m in p.modules.values())


@pytest.mark.parametrize("prune_type", ["magnitude", "snip", "snip_momentum", "gradient"])
@pytest.mark.parametrize("pattern,target", [("1x1", 0.8), ("4x1", 0.75), ("2:4", 0.5)])
def test_each_pruner_reaches_target_exactly_on_digits(framework, fdigits, dense, prune_type, pattern, target):
    fw = framework
    x, y, xt, yt = fdigits
    state, dense_acc = dense
    model = mlp(fw, state)
    opt = optim(fw).SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    cfg = {"prune_type": prune_type, "pattern": pattern, "target_sparsity": target, "start_step": 2,
           "end_step": 20, "update_frequency_on_step": 3, "sparsity_decay_type": "cube"}
    pruning = prepare_pruning(model, cfg, opt)
    train(model, opt, x, y, 20)
    assert pruning.global_step == 20
    assert mask_zeros(pruning) < target * mask_numel(pruning)  # step 20 is still to come
    train(model, opt, x, y, 10)  # steps 20..29: end_step reached at step 20, then fine-tuning
    total = mask_numel(pruning)
    unit = get_pattern(pattern).unit_numel((64, 64))
    assert mask_zeros(pruning) == round(target * total / unit) * unit
    layers = sum(len(p.modules) for p in pruning.pruners)
    assert layers == (2 if pattern == "4x1" else 3)  # 4x1: the (10, 32) layer does not fit
    assert assert_pruned_entries_frozen(pruning, opt) == layers  # one momentum buffer per layer, checked
    rep = pruning.report()
    assert rep.elementwise_over_layers == pytest.approx(mask_zeros(pruning) / total, abs=1e-3)
    for layer in rep.layers:  # every block all-zero or untouched; N:M groups valid
        mask = T(dict(model.named_modules())[layer.name].weight_mask)
        units = get_pattern(pattern).to_units(mask)
        assert torch.all((units.sum(1) == 0) | (units.sum(1) == units.shape[1]))
        if pattern == "2:4":
            assert torch.all(to_2d(mask).reshape(-1, 4).sum(1) == 2)
    assert prunekit.is_pruned(model)
    acc = accuracy(model, xt, yt)
    print(f"{fw} {prune_type} {pattern} dense {dense_acc:.3f} pruned {acc:.3f}")
    assert acc > dense_acc - 0.08  # pruned during fine-tuning, the model still works


def test_manual_callbacks_equal_optimizer_hooks(framework, fdigits):
    fw = framework
    x, y, _, _ = fdigits
    cfg = {"prune_type": "snip_momentum", "pattern": "1x1", "target_sparsity": 0.7, "end_step": 9,
           "update_frequency_on_step": 2}
    a = mlp(fw)
    oa = optim(fw).SGD(a.parameters(), lr=0.1, momentum=0.9)
    pa = prepare_pruning(a, cfg, oa)
    train(a, oa, x, y, 12)
    b = mlp(fw)
    ob = optim(fw).SGD(b.parameters(), lr=0.1, momentum=0.9)
    pb = prepare_pruning(b, cfg)
    pb.attach_optimizer(ob)
    train(b, ob, x, y, 12, pruning=pb, manual=True)
    for (n, ma), mb in zip(a.named_modules(), b.modules()):
        if hasattr(ma, "weight_mask"):
            assert torch.equal(T(ma.weight_mask), T(mb.weight_mask)), n
    assert pa.global_step == pb.global_step == 12
    assert mask_zeros(pa) == round(0.7 * mask_numel(pa))


@pytest.mark.parametrize("opt_name", ["sgd_momentum", "adam", "adamw"])
def test_pruned_entries_stay_exactly_zero_and_state_cleared(framework, fdigits, opt_name):
    fw = framework
    x, y, _, _ = fdigits
    model = mlp(fw)
    params = model.parameters()
    o = optim(fw)
    opt = {"sgd_momentum": lambda: o.SGD(params, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3),
           "adam": lambda: o.Adam(params, lr=1e-2, weight_decay=1e-3),
           "adamw": lambda: o.AdamW(params, lr=1e-2, weight_decay=1e-2)}[opt_name]()
    pruning = prepare_pruning(model, {"prune_type": "magnitude", "pattern": "1x1", "target_sparsity": 0.6,
                                      "start_step": 5, "end_step": 15, "update_frequency_on_step": 5}, opt)
    train(model, opt, x, y, 10)  # steps 0..9 are dense (step 5 schedules sparsity 0): optimizer state builds up
    assert mask_zeros(pruning) == 0
    state = opt.state[model[0].weight_orig]
    per_entry = [k for k, v in state.items() if is_tensor(v) and tuple(v.shape) == (64, 64)]
    assert per_entry == (["momentum_buffer"] if opt_name == "sgd_momentum" else ["exp_avg", "exp_avg_sq"])
    assert all(int((T(state[k]) == 0).sum()) < 64 * 64 // 2 for k in per_entry)  # dense state is non-zero
    train(model, opt, x, y, 1)  # step 10 prunes and clears state at pruned entries
    assert mask_zeros(pruning) == round(0.3675444679663241 * mask_numel(pruning))
    assert assert_pruned_entries_frozen(pruning, opt) == 3 * len(per_entry)
    snapshot = {n: T(m.weight_mask) for n, m in model.named_modules() if hasattr(m, "weight_mask")}
    for _ in range(4):
        train(model, opt, x, y, 1)
        assert_pruned_entries_frozen(pruning, opt)
    train(model, opt, x, y, 20)
    assert_pruned_entries_frozen(pruning, opt)
    assert mask_zeros(pruning) == round(0.6 * mask_numel(pruning))
    pruning.unwire()  # the optimizer state is then plain zeros at pruned entries, Adam's second moments too
    assert not pruning.wired and assert_pruned_entries_frozen(pruning, opt) == 3 * len(per_entry)
    for n, mask in snapshot.items():  # masks only lose ones
        assert torch.all(T(dict(model.named_modules())[n].weight_mask)[mask == 0] == 0)


def test_cnn_skips_layers_that_do_not_fit_and_reports_why(framework, fdigits, caplog):
    fw = framework
    x, y, _, _ = fdigits
    model = cnn(fw)
    opt = optim(fw).SGD(model.parameters(), lr=0.05, momentum=0.9)
    with caplog.at_level("WARNING"):
        pruning = prepare_pruning(model, {"prune_type": "magnitude", "pattern": "1x4", "target_sparsity": 0.5,
                                          "end_step": 4}, opt)
    assert pruning.skipped == {"conv1": "1 input channels are not a multiple of the block width 4"}
    assert "conv1" in caplog.text and "does not fit" in caplog.text
    assert not hasattr(model.conv1, "weight_mask")
    before = T(model.conv1.weight)
    train(model, opt, x, y, 6)
    after = T(model.conv1.weight)
    assert int((after == 0).sum()) == 0 and not torch.equal(before, after)
    # conv2 pruned in blocks of 4 consecutive input channels at one kernel position
    units = get_pattern("1x4").to_units(T(model.conv2.weight_mask))
    assert torch.all((units.sum(1) == 0) | (units.sum(1) == 4))
    total = model.conv2.weight.numel() + model.fc.weight.numel()
    assert mask_zeros(pruning) == round(0.5 * total / 4) * 4


def test_local_scope_prunes_every_layer_alike_global_does_not(framework, fdigits):
    fw = framework
    x, y, _, _ = fdigits
    reports = {}
    for scope in ("local", "global"):
        model = mlp(fw)
        opt = optim(fw).SGD(model.parameters(), lr=0.1)
        with fw.no_grad():
            model[4].weight.mul_(0.01)  # the last layer has tiny weights
        pruning = prepare_pruning(model, {"prune_type": "magnitude", "pattern": "1x1", "target_sparsity": 0.6,
                                          "prune_domain": scope, "end_step": 0}, opt)
        train(model, opt, x, y, 1)
        reports[scope] = {l.name: l.sparsity for l in pruning.report().layers}
        assert mask_zeros(pruning) == round(0.6 * mask_numel(pruning))
    assert all(abs(s - 0.6) < 1e-2 for s in reports["local"].values())
    assert reports["global"]["4"] > 0.9  # global ranking takes the tiny layer first


def test_caps_are_honoured_and_redistributed(framework, fdigits):
    fw = framework
    x, y, _, _ = fdigits
    for scope in ("global", "local"):
        model = mlp(fw)
        with fw.no_grad():
            model[4].weight.mul_(0.001)
        opt = optim(fw).SGD(model.parameters(), lr=0.1)
        _pruning = prepare_pruning(model, {"prune_type": "magnitude", "pattern": "1x1", "target_sparsity": 0.7,
                                           "prune_domain": scope, "max_sparsity_ratio_per_layer": 0.72,
                                           "min_sparsity_ratio_per_layer": 0.65, "start_step": 0, "end_step": 6,
                                           "update_frequency_on_step": 2}, opt)  # kept alive while training
        train(model, opt, x, y, 8)
        zeros = {n: int((m.weight_mask == 0).sum()) for n, m in model.named_modules() if hasattr(m, "weight_mask")}
        numel = {n: m.weight_mask.numel() for n, m in model.named_modules() if hasattr(m, "weight_mask")}
        for n in zeros:  # no layer outside [min, max]
            assert int(0.65 * numel[n]) <= zeros[n] <= int(0.72 * numel[n]), (scope, n)
        assert sum(zeros.values()) == round(0.7 * sum(numel.values())), scope  # still the exact target
        if scope == "global":  # the tiny layer would go first: it stops at its cap, the others take the rest
            assert zeros["4"] == int(0.72 * numel["4"])


def _state(model):
    return {k: T(v) for k, v in model.state_dict().items()}


def test_infeasible_caps_error_and_model_untouched(framework):
    fw = framework
    model = mlp(fw)
    cfg = {"prune_type": "magnitude", "pattern": "1x1", "pruners": [
        {"names": ["^0$"], "target_sparsity": 0.5},
        {"names": ["^2$", "^4$"], "target_sparsity": 0.5, "pattern": "1xchannel",
         "max_sparsity_ratio_per_layer": 0.5, "min_sparsity_ratio_per_layer": 0.5},
        {"names": ["^0$"], "pattern": "1x1"},
    ]}
    with pytest.raises(ValueError, match=r"pruners\[0\] and pruners\[2\] both select module '0'"):
        prepare_pruning(model, cfg)
    assert not prunekit.is_pruned(model)
    with fw.no_grad():
        model[2].weight[:, :40] = 0
    prunekit.custom_from_mask(model[2], "weight", model[2].weight != 0)
    ref = _state(model)
    pl = {"prune_type": "magnitude", "pattern": "1x1", "target_sparsity": 0.4, "max_sparsity_ratio_per_layer": 0.5}
    # layer 2 is already 62.5 % sparse and masks only lose ones: the 0.5 cap cannot be met
    pruning = None
    with pytest.raises(ValueError, match="per-layer minima already prune"):
        pruning = prepare_pruning(model, {"pruners": [{"names": ["^0$"], **pl}, {"names": ["^2$"], **pl}]})
    assert pruning is None
    assert not hasattr(model[0], "weight_mask")  # the first pruner's masks were undone
    sd = _state(model)
    assert sd.keys() == ref.keys() and all(torch.equal(sd[k], ref[k]) for k in sd)


def test_excluded_layers_untouched(framework, fdigits):
    fw = framework
    x, y, _, _ = fdigits
    model = mlp(fw)
    opt = optim(fw).SGD(model.parameters(), lr=0.1)
    pruning = prepare_pruning(model, {"prune_type": "magnitude", "pattern": "1x1", "target_sparsity": 0.5,
                                      "excluded_op_names": ["^4$"], "extra_excluded_names": ["^2"]}, opt)
    train(model, opt, x, y, 2)
    assert list(pruning.pruners[0].modules) == ["0"]
    assert not hasattr(model[2], "weight_mask") and not hasattr(model[4], "weight_mask")
    assert int((model[4].weight == 0).sum()) == 0
    assert int((model[0].weight_mask == 0).sum()) == 64 * 64 // 2


def test_pattern_lock_keeps_existing_zeros(framework, fdigits):
    fw = framework
    x, y, _, _ = fdigits
    model = mlp(fw)
    drop = {0: torch.rand(64, 64) < 0.5, 4: torch.rand(10, 32) < 0.5}
    with fw.no_grad():
        for i in (0, 4):
            w = T(model[i].weight)
            w[drop[i]] = 0
            model[i].weight.copy_(fw.tensor(w))
    zeros = {i: T(model[i].weight) == 0 for i in (0, 4)}
    before = {i: T(model[i].weight) for i in (0, 4)}
    opt = optim(fw).Adam(model.parameters(), lr=1e-2)
    pruning = prepare_pruning(model, {"prune_type": "pattern_lock", "excluded_names": ["^2$"], "pattern": "4x4"}, opt)
    assert pruning.skipped == {}  # pattern lock keeps zeros of any shape: no layer is skipped
    train(model, opt, x, y, 15)
    for i in (0, 4):
        assert torch.equal(T(model[i].weight) == 0, zeros[i])
        assert not torch.equal(T(model[i].weight), before[i])  # the rest trained
    assert assert_pruned_entries_frozen(pruning, opt) == 4
    assert pruning.pruners[0].target_sparsity_ratio == pytest.approx(
        (int(zeros[0].sum()) + int(zeros[4].sum())) / (64 * 64 + 32 * 10))


def test_snip_momentum_scores_accumulate_before_the_step(framework):
    fw = framework
    fc = fw.nn.Linear(4, 2)
    fw.set_params(fc, {"weight": torch.tensor([[1.0, -2.0, 3.0, -4.0], [0.5, 0.5, -0.5, 1.0]])})
    opt = optim(fw).SGD(fc.parameters(), lr=1.0)
    p = SnipMomentumPruner({"fc": fc}, {"prune_type": "snip_momentum", "pattern": "1x1",
                                         "target_sparsity": 0.5, "start_step": 5, "end_step": 5})
    g1 = torch.tensor([[1.0, 1.0, 1.0, 1.0], [2.0, -2.0, 2.0, 2.0]])
    g2 = torch.tensor([[0.5, 0.0, -1.0, 1.0], [1.0, 1.0, 1.0, 1.0]])
    w0 = T(fc.weight_orig)
    fc.weight_orig.grad = fw.tensor(g1)
    p.on_step_begin(0)
    p.on_before_optimizer_step()
    opt.step()
    p.on_after_optimizer_step()
    p.on_step_end()
    w1 = T(fc.weight_orig)
    assert torch.equal(w1, w0 - g1)  # the optimizer used the gradient that was scored
    fc.weight_orig.grad = fw.tensor(g2)
    p.on_step_begin(1)
    p.on_before_optimizer_step()
    expected = 0.9 * (w0 * g1).abs() + (w1 * g2).abs()
    assert torch.allclose(T(p.scores["fc"]), expected)


def test_user_registered_pruner_selected_by_name(framework, fdigits):
    fw = framework
    x, y, _, _ = fdigits

    @register_pruners("largest_first_test")
    class LargestFirst(Pruner):
        """A pruner of the user's own: prunes the *largest* weights (to prove it is the one used)."""

        def layer_scores(self, name, module):
            return -module.weight.detach().abs()

    try:
        assert PRUNERS["largest_first_test"] is LargestFirst
        model = mlp(fw)
        opt = optim(fw).SGD(model.parameters(), lr=0.0)  # weights do not move: scores are the initial |w|
        pruning = prepare_pruning(model, {"pruning_type": "largest_first_test", "pattern": "1x1",
                                          "target_sparsity": 0.25, "op_names": ["^0$"]}, opt)
        assert type(pruning.pruners[0]) is LargestFirst
        w = T(model[0].weight).abs()
        train(model, opt, x, y, 1)
        pruned = T(model[0].weight_mask) == 0
        assert int(pruned.sum()) == 1024
        assert w[pruned].min() >= w[~pruned].max()
        direct = get_pruner({"fc": fw.nn.Linear(8, 8)}, {"prune_type": "largest_first_test", "pattern": "1x1"})
        assert isinstance(direct, LargestFirst)
    finally:
        PRUNERS.pop("largest_first_test", None)


def test_checkpoint_resume_gives_the_masks_of_an_uninterrupted_run(framework, fdigits, tmp_path):
    fw = framework
    x, y, _, _ = fdigits
    cfg = PruningConfig.from_dict({"prune_type": "snip_momentum", "pattern": "4x1", "target_sparsity": 0.8,
                                   "start_step": 2, "end_step": 16, "update_frequency_on_step": 2,
                                   "sparsity_decay_type": "cos"})
    xs, ys = x[:1000], y[:1000]
    steps = list(batches(xs, ys, 24))

    def run(model, opt, chunk):
        loss_fn = _loss(model)
        for xb, yb in chunk:
            opt.zero_grad()
            loss_fn(model(xb), yb).backward()
            opt.step()

    a = mlp(fw)
    oa = optim(fw).Adam(a.parameters(), lr=1e-2)
    pa = prepare_pruning(a, cfg, oa)
    run(a, oa, steps)

    b = mlp(fw)
    ob = optim(fw).Adam(b.parameters(), lr=1e-2)
    pb = prepare_pruning(b, cfg, ob)
    run(b, ob, steps[:9])
    fw.ns.save({"model": b.state_dict(), "opt": ob.state_dict(), "pruning": pb.state_dict()}, str(tmp_path / "ck.pt"))

    c = mlp(fw)
    oc = optim(fw).Adam(c.parameters(), lr=1e-2)
    pc = prepare_pruning(c, cfg, oc)
    ck = fw.ns.load(str(tmp_path / "ck.pt"))
    c.load_state_dict(ck["model"])
    oc.load_state_dict(ck["opt"])
    pc.load_state_dict(ck["pruning"])
    assert pc.global_step == 9
    run(c, oc, steps[9:])
    assert mask_zeros(pa) == round(0.8 * mask_numel(pa) / 4) * 4
    for (n, ma), mc in zip(a.named_modules(), c.modules()):
        if hasattr(ma, "weight_mask"):
            assert torch.equal(T(ma.weight_mask), T(mc.weight_mask)), n
            assert torch.equal(T(ma.weight_orig), T(mc.weight_orig)), n


def test_masks_are_prunekit_reparameterization(framework, fdigits):
    fw = framework
    x, y, _, _ = fdigits
    model = mlp(fw)
    opt = optim(fw).SGD(model.parameters(), lr=0.1)
    param = model[0].weight
    pruning = prepare_pruning(model, {"prune_type": "magnitude", "pattern": "1x1", "target_sparsity": 0.5,
                                      "names": ["^0$"]}, opt)
    assert model[0].weight_orig is param  # same Parameter: the optimizer keeps working
    train(model, opt, x, y, 1)
    sd = model.state_dict()
    assert "0.weight_mask" in sd and "0.weight_orig" in sd
    assert prunekit.is_pruned(model)
    pruning.unwire()
    prunekit.remove(model[0], "weight")
    assert model[0].weight is param and int((param == 0).sum()) == 2048


def test_unwire_stops_counting_steps(framework, fdigits):
    fw = framework
    x, y, _, _ = fdigits
    model = mlp(fw)
    opt = optim(fw).SGD(model.parameters(), lr=0.1)
    pruning = prepare_pruning(model, {"prune_type": "magnitude", "pattern": "1x1", "target_sparsity": 0.5,
                                      "start_step": 3, "end_step": 3}, opt)
    train(model, opt, x, y, 2)
    assert pruning.global_step == 2 and mask_zeros(pruning) == 0
    pruning.unwire()
    train(model, opt, x, y, 5)
    assert pruning.global_step == 2 and mask_zeros(pruning) == 0
    with pytest.raises(ValueError, match="already wired"):
        pruning.wire(opt).wire(opt)


def test_pruner_attributes_surface(framework):
    fc = framework.nn.Linear(8, 8)
    p = MagnitudePruner({"fc": fc}, {"prune_type": "magnitude", "pattern": "1x1", "target_sparsity": 0.5,
                                     "start_step": 1, "end_step": 9, "update_frequency_on_step": 4})
    for attr in ("modules", "config", "masks", "scores", "pattern", "scheduler", "current_sparsity_ratio",
                 "global_step", "start_step", "end_step", "update_frequency_on_step", "target_sparsity_ratio",
                 "max_sparsity_ratio_per_layer"):
        assert hasattr(p, attr), attr
    assert p.masks["fc"] is fc.weight_mask
    assert [s for s in range(12) if p.check_is_pruned_step(s)] == [1, 5, 9]
    for cb in ("on_train_begin", "on_epoch_begin", "on_step_begin", "on_before_optimizer_step",
               "on_after_optimizer_step", "on_step_end", "on_epoch_end", "on_train_end", "on_before_eval",
               "on_after_eval", "mask_weights", "check_is_pruned_step", "update_scores"):
        assert callable(getattr(p, cb)), cb


# ------------------------------------------------------------ torch vs TensorPlay
def _two_layers(nn_):
    return nn_.Sequential(nn_.Linear(32, 16), nn_.ReLU(), nn_.Linear(16, 8))


@pytest.mark.parametrize("prune_type", ["magnitude", "snip", "snip_momentum", "gradient"])
@pytest.mark.parametrize("pattern,target", [("1x1", 0.7), ("4x1", 0.5), ("2:4", 0.5)])
@pytest.mark.parametrize("scope", ["global", "local"])
def test_same_weights_and_gradients_give_identical_masks_in_torch_and_tensorplay(prune_type, pattern, target, scope):
    tp = pytest.importorskip("tensorplay")
    torch.manual_seed(3)
    ref = _two_layers(nn)
    grads = [{n: torch.randn_like(p) for n, p in ref.named_parameters()} for _ in range(3)]
    cfg = {"prune_type": prune_type, "pattern": pattern, "target_sparsity": target, "prune_domain": scope,
           "start_step": 0, "end_step": 2, "update_frequency_on_step": 1, "sparsity_decay_type": "linear"}
    results = {}
    for name, ns in (("torch", torch), ("tensorplay", tp)):
        model = copy.deepcopy(ref) if name == "torch" else _two_layers(tp.nn)
        if name == "tensorplay":
            params = dict(model.named_parameters())
            with tp.no_grad():
                for n, p in ref.named_parameters():
                    params[n].copy_(tp.from_dlpack(p.detach().clone()))
        pruning = prepare_pruning(model, cfg)
        masks = []
        for step, g in enumerate(grads):  # three update steps, each with its own gradients; no optimizer
            for i in (0, 2):
                for pn, attr in (("weight", "weight_orig"), ("bias", "bias")):
                    t = g[f"{i}.{pn}"].clone()
                    getattr(model[i], attr).grad = t if name == "torch" else tp.from_dlpack(t)
            pruning.on_step_begin(step)
            pruning.step()
            masks.append([T(model[i].weight_mask) for i in (0, 2)])
        results[name] = masks, [T(model[i].weight) for i in (0, 2)], T(pruning.pruners[0].scores.get("0", ns.zeros(1)))
    (mt, wt, st), (mp, wp, sp) = results["torch"], results["tensorplay"]
    for step, (a, b) in enumerate(zip(mt, mp)):
        for i, (x, y) in enumerate(zip(a, b)):
            assert x.dtype == y.dtype and torch.equal(x, y), (step, i)
    assert all(torch.equal(x, y) for x, y in zip(wt, wp))
    assert torch.equal(st, sp)  # the criterion's scores agree bit for bit
    zeros = sum(int((m == 0).sum()) for m in mt[-1])
    unit = get_pattern(pattern).unit_numel((16, 32))
    assert zeros == round(target * (32 * 16 + 16 * 8) / unit) * unit
    assert 0 < sum(int((m == 0).sum()) for m in mt[1]) < zeros  # the schedule really moved in steps


def test_framework_mixing_is_refused_and_leaves_the_model_untouched():
    tp = pytest.importorskip("tensorplay")
    model = _two_layers(tp.nn)
    before = _state(model)
    cfg = {"prune_type": "magnitude", "pattern": "1x1", "target_sparsity": 0.5}
    with pytest.raises(FrameworkMismatchError, match=r"optimizer SGD is a torch optimizer but the model is a "
                                                     r"tensorplay Sequential; pass a tensorplay.optim optimizer"):
        prepare_pruning(model, cfg, torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1))
    with pytest.raises(TypeError, match=r"is not a tensorplay.optim.Optimizer"):
        prepare_pruning(model, cfg, object())
    assert not prunekit.is_pruned(model)
    after = _state(model)
    assert all(torch.equal(before[k], after[k]) for k in before)
    with pytest.raises(FrameworkMismatchError, match=r"modules 'a' \(tensorplay\) and 'b' \(torch\) are of "
                                                     r"different frameworks"):
        MagnitudePruner({"a": model[0], "b": nn.Linear(32, 16)}, cfg)
    assert not hasattr(model[0], "weight_mask")
    pruning = prepare_pruning(model, cfg)
    with pytest.raises(FrameworkMismatchError, match="torch optimizer but the model is a tensorplay"):
        pruning.attach_optimizer(torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1))


def test_gradient_scores_equal_those_of_the_masked_weight():
    # update_scores hands the criterion weight_orig, not weight_orig * weight_mask: the
    # scores must still be those of the masked weight (zero wherever the mask is zero).
    torch.manual_seed(0)
    fc = nn.Linear(8, 4)
    p = SnipPruner({"fc": fc}, {"prune_type": "snip", "pattern": "1x1", "target_sparsity": 0.5, "end_step": 0})
    fc(torch.randn(5, 8)).pow(2).sum().backward()
    p.on_step_begin(0)
    p.on_before_optimizer_step()
    p.on_step_end()  # one-shot: half the weights pruned
    assert int((fc.weight_mask == 0).sum()) == 16
    fc.weight_orig.grad = None
    fc(torch.randn(5, 8)).pow(2).sum().backward()
    p.update_scores()
    assert torch.equal(p.scores["fc"], (fc.weight.detach() * fc.weight_orig.grad).abs())
    assert int((p.scores["fc"][fc.weight_mask == 0] != 0).sum()) == 0


def test_failed_set_up_after_the_masks_leaves_the_modules_as_they_were(monkeypatch):
    import prunekit.training.pruners as pruners_mod

    torch.manual_seed(0)
    fc, already = nn.Linear(8, 4), nn.Linear(8, 4)
    prunekit.l1_unstructured(already, "weight", amount=0.25)
    w, mask = fc.weight.detach().clone(), already.weight_mask.clone()
    param = fc.weight

    def broken(*args, **kwargs):
        raise RuntimeError("scheduler failed")

    monkeypatch.setattr(pruners_mod, "get_scheduler", broken)
    with pytest.raises(RuntimeError, match="scheduler failed"):
        MagnitudePruner({"fc": fc, "already": already},
                        {"prune_type": "magnitude", "pattern": "1x1", "target_sparsity": 0.5})
    assert not prunekit.is_pruned(fc) and fc.weight is param and torch.equal(fc.weight, w)
    assert torch.equal(already.weight_mask, mask)  # a mask the module had before stays
