"""Training-aware pruners on real data (scikit-learn's bundled digits), small and fast."""

import copy

import pytest
import torch
from torch import nn

import prunekit
from prunekit.training import (
    MagnitudePruner,
    Pruner,
    PruningConfig,
    SnipMomentumPruner,
    get_pruner,
    prepare_pruning,
    register_pruners,
)
from prunekit.training.patterns import get_pattern, to_2d
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


def mlp(state=None):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
    if state is not None:
        model.load_state_dict(state)
    return model


@pytest.fixture(scope="module")
def dense(digits):
    """A dense MLP trained on digits (state dict, test accuracy)."""
    x, y, xt, yt = digits
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    train(model, opt, x, y, 80)
    return copy.deepcopy(model.state_dict()), accuracy(model, xt, yt)


class CNN(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv1 = nn.Conv2d(1, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 16, 3)
        self.fc = nn.Linear(16 * 6 * 6, 10)

    def forward(self, x):
        x = x.view(-1, 1, 8, 8)
        x = torch.relu(self.conv2(torch.relu(self.conv1(x))))
        return self.fc(x.flatten(1))


def batches(x, y, n_steps, bs=100):
    for i in range(n_steps):
        j = (i * bs) % (len(y) - bs)
        yield x[j:j + bs], y[j:j + bs]


def train(model, opt, x, y, n_steps, pruning=None, manual=False):
    loss_fn = nn.CrossEntropyLoss()
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


def accuracy(model, x, y):
    with torch.no_grad():
        return (model(x).argmax(1) == y).float().mean().item()


def assert_pruned_entries_frozen(pruning, opt):
    """weight_orig and every per-entry optimizer state are exactly zero where masks are zero."""
    for p in pruning.pruners:
        for name, m in p.modules.items():
            mask = m.weight_mask
            pruned = mask == 0
            assert torch.all(m.weight_orig[pruned] == 0), name
            assert torch.all(m.weight[pruned] == 0), name
            for v in opt.state.get(m.weight_orig, {}).values():
                if torch.is_tensor(v) and v.shape == mask.shape:
                    assert torch.all(v[pruned] == 0), name


def mask_zeros(pruning):
    return sum(int((m.weight_mask == 0).sum()) for p in pruning.pruners for m in p.modules.values())


def mask_numel(pruning):
    return sum(m.weight_mask.numel() for p in pruning.pruners for m in p.modules.values())


@pytest.mark.parametrize("prune_type", ["magnitude", "snip", "snip_momentum", "gradient"])
@pytest.mark.parametrize("pattern,target", [("1x1", 0.8), ("4x1", 0.75), ("2:4", 0.5)])
def test_each_pruner_reaches_target_exactly_on_digits(digits, dense, prune_type, pattern, target):
    x, y, xt, yt = digits
    state, dense_acc = dense
    model = mlp(state)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
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
    assert_pruned_entries_frozen(pruning, opt)
    rep = pruning.report()
    assert rep.elementwise_over_layers == pytest.approx(mask_zeros(pruning) / total, abs=1e-3)
    for layer in rep.layers:  # every block all-zero or untouched; N:M groups valid
        m = dict(model.named_modules())[layer.name]
        units = get_pattern(pattern).to_units(m.weight_mask)
        assert torch.all((units.sum(1) == 0) | (units.sum(1) == units.shape[1]))
        if pattern == "2:4":
            assert torch.all(to_2d(m.weight_mask).reshape(-1, 4).sum(1) == 2)
    assert prunekit.is_pruned(model)
    acc = accuracy(model, xt, yt)
    print(f"{prune_type} {pattern} dense {dense_acc:.3f} pruned {acc:.3f}")
    assert acc > dense_acc - 0.08  # pruned during fine-tuning, the model still works


def test_manual_callbacks_equal_optimizer_hooks(digits):
    x, y, _, _ = digits
    cfg = {"prune_type": "snip_momentum", "pattern": "1x1", "target_sparsity": 0.7, "end_step": 9,
           "update_frequency_on_step": 2}
    a = mlp()
    oa = torch.optim.SGD(a.parameters(), lr=0.1, momentum=0.9)
    pa = prepare_pruning(a, cfg, oa)
    train(a, oa, x, y, 12)
    b = mlp()
    ob = torch.optim.SGD(b.parameters(), lr=0.1, momentum=0.9)
    pb = prepare_pruning(b, cfg)
    pb.attach_optimizer(ob)
    train(b, ob, x, y, 12, pruning=pb, manual=True)
    for (n, ma), mb in zip(a.named_modules(), b.modules()):
        if hasattr(ma, "weight_mask"):
            assert torch.equal(ma.weight_mask, mb.weight_mask), n
    assert pa.global_step == pb.global_step == 12


@pytest.mark.parametrize("opt_name", ["sgd_momentum", "adam", "adamw"])
def test_pruned_entries_stay_exactly_zero_and_state_cleared(digits, opt_name):
    x, y, _, _ = digits
    model = mlp()
    params = model.parameters()
    opt = {"sgd_momentum": lambda: torch.optim.SGD(params, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3),
           "adam": lambda: torch.optim.Adam(params, lr=1e-2, weight_decay=1e-3),
           "adamw": lambda: torch.optim.AdamW(params, lr=1e-2, weight_decay=1e-2)}[opt_name]()
    pruning = prepare_pruning(model, {"prune_type": "magnitude", "pattern": "1x1", "target_sparsity": 0.6,
                                      "start_step": 5, "end_step": 15, "update_frequency_on_step": 5}, opt)
    train(model, opt, x, y, 5)  # dense steps build optimizer state
    train(model, opt, x, y, 1)  # step 5 prunes and clears state at pruned entries
    assert_pruned_entries_frozen(pruning, opt)
    snapshot = {n: m.weight_mask.clone() for n, m in model.named_modules() if hasattr(m, "weight_mask")}
    for _ in range(4):
        train(model, opt, x, y, 1)
        assert_pruned_entries_frozen(pruning, opt)
    train(model, opt, x, y, 20)
    assert_pruned_entries_frozen(pruning, opt)
    for n, mask in snapshot.items():  # masks only lose ones
        assert torch.all(dict(model.named_modules())[n].weight_mask[mask == 0] == 0)


def test_cnn_skips_layers_that_do_not_fit_and_reports_why(digits, caplog):
    x, y, _, _ = digits
    model = CNN()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    with caplog.at_level("WARNING"):
        pruning = prepare_pruning(model, {"prune_type": "magnitude", "pattern": "1x4", "target_sparsity": 0.5,
                                          "end_step": 4}, opt)
    assert pruning.skipped == {"conv1": "1 input channels are not a multiple of the block width 4"}
    assert "conv1" in caplog.text and "does not fit" in caplog.text
    assert not hasattr(model.conv1, "weight_mask")
    before = model.conv1.weight.detach().clone()
    train(model, opt, x, y, 6)
    assert int((model.conv1.weight == 0).sum()) == 0 and not torch.equal(before, model.conv1.weight)
    # conv2 pruned in blocks of 4 consecutive input channels at one kernel position
    units = get_pattern("1x4").to_units(model.conv2.weight_mask)
    assert torch.all((units.sum(1) == 0) | (units.sum(1) == 4))
    total = model.conv2.weight.numel() + model.fc.weight.numel()
    assert mask_zeros(pruning) == round(0.5 * total / 4) * 4


def test_local_scope_prunes_every_layer_alike_global_does_not(digits):
    x, y, _, _ = digits
    reports = {}
    for scope in ("local", "global"):
        model = mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with torch.no_grad():
            model[4].weight.mul_(0.01)  # the last layer has tiny weights
        pruning = prepare_pruning(model, {"prune_type": "magnitude", "pattern": "1x1", "target_sparsity": 0.6,
                                          "prune_domain": scope, "end_step": 0}, opt)
        train(model, opt, x, y, 1)
        reports[scope] = {l.name: l.sparsity for l in pruning.report().layers}
        assert mask_zeros(pruning) == round(0.6 * mask_numel(pruning))
    assert all(abs(s - 0.6) < 1e-2 for s in reports["local"].values())
    assert reports["global"]["4"] > 0.9  # global ranking takes the tiny layer first


def test_caps_are_honoured_and_redistributed(digits):
    x, y, _, _ = digits
    for scope in ("global", "local"):
        model = mlp()
        with torch.no_grad():
            model[4].weight.mul_(0.001)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        pruning = prepare_pruning(model, {"prune_type": "magnitude", "pattern": "1x1", "target_sparsity": 0.7,
                                          "prune_domain": scope, "max_sparsity_ratio_per_layer": 0.72,
                                          "min_sparsity_ratio_per_layer": 0.65, "start_step": 0, "end_step": 6,
                                          "update_frequency_on_step": 2}, opt)
        train(model, opt, x, y, 8)
        zeros = {n: int((m.weight_mask == 0).sum()) for n, m in model.named_modules() if hasattr(m, "weight_mask")}
        numel = {n: m.weight_mask.numel() for n, m in model.named_modules() if hasattr(m, "weight_mask")}
        for n in zeros:  # no layer outside [min, max]
            assert int(0.65 * numel[n]) <= zeros[n] <= int(0.72 * numel[n]), (scope, n)
        assert sum(zeros.values()) == round(0.7 * sum(numel.values())), scope  # still the exact target
        if scope == "global":  # the tiny layer would go first: it stops at its cap, the others take the rest
            assert zeros["4"] == int(0.72 * numel["4"])


def test_infeasible_caps_error_and_model_untouched():
    model = mlp()
    ref = copy.deepcopy(model.state_dict())
    cfg = {"prune_type": "magnitude", "pattern": "1x1", "pruners": [
        {"names": ["^0$"], "target_sparsity": 0.5},
        {"names": ["^2$", "^4$"], "target_sparsity": 0.5, "max_sparsity_ratio_per_layer": 0.5, "pattern": "4x1"},
    ]}
    # second pruner: 4x1 blocks, cap 0.5 -> fine; make it impossible instead with a 1xchannel cap below target
    cfg["pruners"][1] = {"names": ["^2$", "^4$"], "target_sparsity": 0.5, "pattern": "1xchannel",
                         "max_sparsity_ratio_per_layer": 0.5, "min_sparsity_ratio_per_layer": 0.5}
    cfg["pruners"].append({"names": ["^0$"], "pattern": "1x1"})
    with pytest.raises(ValueError, match=r"pruners\[0\] and pruners\[2\] both select module '0'"):
        prepare_pruning(model, cfg)
    assert not prunekit.is_pruned(model)
    cfg["pruners"].pop()
    cfg["pruners"][1] = {"names": ["^2$"], "pattern": "1x1", "target_sparsity": 0.5,
                         "max_sparsity_ratio_per_layer": 0.5, "min_sparsity_ratio_per_layer": 0.0}
    with torch.no_grad():
        model[2].weight[:, :40] = 0
    ref = copy.deepcopy(model.state_dict())
    pl = {"prune_type": "magnitude", "pattern": "1x1", "target_sparsity": 0.4, "max_sparsity_ratio_per_layer": 0.5}
    prunekit.custom_from_mask(model[2], "weight", (model[2].weight != 0).float())
    ref = copy.deepcopy(model.state_dict())
    # layer 2 is already 62.5 % sparse and masks only lose ones: the 0.5 cap cannot be met
    pruning = None
    with pytest.raises(ValueError, match="per-layer minima already prune"):
        pruning = prepare_pruning(model, {"pruners": [{"names": ["^0$"], **pl}, {"names": ["^2$"], **pl}]})
    assert pruning is None
    assert not hasattr(model[0], "weight_mask")  # the first pruner's masks were undone
    sd = model.state_dict()
    assert sd.keys() == ref.keys() and all(torch.equal(sd[k], ref[k]) for k in sd)


def test_excluded_layers_untouched(digits):
    x, y, _, _ = digits
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    pruning = prepare_pruning(model, {"prune_type": "magnitude", "pattern": "1x1", "target_sparsity": 0.5,
                                      "excluded_op_names": ["^4$"], "extra_excluded_names": ["^2"]}, opt)
    train(model, opt, x, y, 2)
    assert list(pruning.pruners[0].modules) == ["0"]
    assert not hasattr(model[2], "weight_mask") and not hasattr(model[4], "weight_mask")
    assert int((model[4].weight == 0).sum()) == 0


def test_pattern_lock_keeps_existing_zeros(digits):
    x, y, _, _ = digits
    model = mlp()
    with torch.no_grad():
        for m in (model[0], model[4]):
            m.weight[torch.rand_like(m.weight) < 0.5] = 0
    zeros = {i: (model[i].weight == 0).clone() for i in (0, 4)}
    before = {i: model[i].weight.detach().clone() for i in (0, 4)}
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    pruning = prepare_pruning(model, {"prune_type": "pattern_lock", "excluded_names": ["^2$"], "pattern": "4x4"}, opt)
    assert pruning.skipped == {}  # pattern lock keeps zeros of any shape: no layer is skipped
    train(model, opt, x, y, 15)
    for i in (0, 4):
        assert torch.equal(model[i].weight == 0, zeros[i])
        assert not torch.equal(model[i].weight.detach(), before[i])  # the rest trained
    assert_pruned_entries_frozen(pruning, opt)
    assert pruning.pruners[0].target_sparsity_ratio == pytest.approx(
        (int(zeros[0].sum()) + int(zeros[4].sum())) / (64 * 64 + 32 * 10))


def test_snip_momentum_scores_accumulate_before_the_step():
    fc = nn.Linear(4, 2)
    with torch.no_grad():
        fc.weight.copy_(torch.tensor([[1.0, -2.0, 3.0, -4.0], [0.5, 0.5, -0.5, 1.0]]))
    opt = torch.optim.SGD(fc.parameters(), lr=1.0)
    p = SnipMomentumPruner({"fc": fc}, {"prune_type": "snip_momentum", "pattern": "1x1",
                                         "target_sparsity": 0.5, "start_step": 5, "end_step": 5})
    g1 = torch.tensor([[1.0, 1.0, 1.0, 1.0], [2.0, -2.0, 2.0, 2.0]])
    g2 = torch.tensor([[0.5, 0.0, -1.0, 1.0], [1.0, 1.0, 1.0, 1.0]])
    w0 = fc.weight_orig.detach().clone()
    fc.weight_orig.grad = g1.clone()
    p.on_step_begin(0)
    p.on_before_optimizer_step()
    opt.step()
    p.on_after_optimizer_step()
    p.on_step_end()
    w1 = fc.weight_orig.detach().clone()
    fc.weight_orig.grad = g2.clone()
    p.on_step_begin(1)
    p.on_before_optimizer_step()
    expected = 0.9 * (w0 * g1).abs() + (w1 * g2).abs()
    assert torch.allclose(p.scores["fc"], expected)


def test_user_registered_pruner_selected_by_name(digits):
    x, y, _, _ = digits

    @register_pruners("largest_first_test")
    class LargestFirst(Pruner):
        """A pruner of the user's own: prunes the *largest* weights (to prove it is the one used)."""

        def layer_scores(self, name, module):
            return -module.weight.detach().abs()

    try:
        assert PRUNERS["largest_first_test"] is LargestFirst
        model = mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.0)  # weights do not move: scores are the initial |w|
        pruning = prepare_pruning(model, {"pruning_type": "largest_first_test", "pattern": "1x1",
                                          "target_sparsity": 0.25, "op_names": ["^0$"]}, opt)
        assert type(pruning.pruners[0]) is LargestFirst
        w = model[0].weight.detach().abs().clone()
        train(model, opt, x, y, 1)
        pruned = model[0].weight_mask == 0
        assert int(pruned.sum()) == 1024
        assert w[pruned].min() >= w[~pruned].max()
        direct = get_pruner({"fc": nn.Linear(8, 8)}, {"prune_type": "largest_first_test", "pattern": "1x1"})
        assert isinstance(direct, LargestFirst)
    finally:
        PRUNERS.pop("largest_first_test", None)


def test_checkpoint_resume_gives_the_masks_of_an_uninterrupted_run(digits, tmp_path):
    x, y, _, _ = digits
    cfg = PruningConfig.from_dict({"prune_type": "snip_momentum", "pattern": "4x1", "target_sparsity": 0.8,
                                   "start_step": 2, "end_step": 16, "update_frequency_on_step": 2,
                                   "sparsity_decay_type": "cos"})
    xs, ys = x[:1000], y[:1000]
    steps = list(batches(xs, ys, 24))

    def run(model, opt, pruning, chunk):
        loss_fn = nn.CrossEntropyLoss()
        for xb, yb in chunk:
            opt.zero_grad()
            loss_fn(model(xb), yb).backward()
            opt.step()

    a = mlp()
    oa = torch.optim.Adam(a.parameters(), lr=1e-2)
    pa = prepare_pruning(a, cfg, oa)
    run(a, oa, pa, steps)

    b = mlp()
    ob = torch.optim.Adam(b.parameters(), lr=1e-2)
    pb = prepare_pruning(b, cfg, ob)
    run(b, ob, pb, steps[:9])
    torch.save({"model": b.state_dict(), "opt": ob.state_dict(), "pruning": pb.state_dict()}, tmp_path / "ck.pt")

    c = mlp()
    oc = torch.optim.Adam(c.parameters(), lr=1e-2)
    pc = prepare_pruning(c, cfg, oc)
    ck = torch.load(tmp_path / "ck.pt")
    c.load_state_dict(ck["model"])
    oc.load_state_dict(ck["opt"])
    pc.load_state_dict(ck["pruning"])
    assert pc.global_step == 9
    run(c, oc, pc, steps[9:])
    for (n, ma), mc in zip(a.named_modules(), c.modules()):
        if hasattr(ma, "weight_mask"):
            assert torch.equal(ma.weight_mask, mc.weight_mask), n
            assert torch.equal(ma.weight_orig, mc.weight_orig), n


def test_masks_are_prunekit_reparameterization(digits):
    x, y, _, _ = digits
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
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


def test_unwire_stops_counting_steps(digits):
    x, y, _, _ = digits
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    pruning = prepare_pruning(model, {"prune_type": "magnitude", "pattern": "1x1", "target_sparsity": 0.5,
                                      "start_step": 3, "end_step": 3}, opt)
    train(model, opt, x, y, 2)
    assert pruning.global_step == 2 and mask_zeros(pruning) == 0
    pruning.unwire()
    train(model, opt, x, y, 5)
    assert pruning.global_step == 2 and mask_zeros(pruning) == 0
    with pytest.raises(ValueError, match="already wired"):
        pruning.wire(opt).wire(opt)


def test_pruner_attributes_surface():
    fc = nn.Linear(8, 8)
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
