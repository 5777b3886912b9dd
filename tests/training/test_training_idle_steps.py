"""Optimizer hooks skip the pruner callbacks on steps where they have nothing to do but count the step.

The fast path must be invisible: the same weights, masks, optimizer state and pruner state, bit for bit,
as running every callback; never taken for a pruner whose class overrides a per-step callback; and all or
nothing when interrupted.
"""

import pytest
import torch
from torch import nn

from prunekit.training import MagnitudePruner, PruningCallbacks, prepare_pruning, register_pruners
from prunekit.training.registry import PRUNERS

pytestmark = pytest.mark.usefixtures("one_thread")

CFG = {"prune_type": "snip_momentum", "pattern": "1x1", "target_sparsity": 0.7, "start_step": 4, "end_step": 40,
       "update_frequency_on_step": 6, "sparsity_decay_type": "cube"}


def _bits(t):
    t = t.detach().contiguous().reshape(-1)
    return t.view(torch.int32).clone() if t.dtype == torch.float32 else t.clone()


def _train(cfg, steps, force_callbacks, monkeypatch):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 24), nn.ReLU(), nn.Linear(24, 5))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    cb = prepare_pruning(model, dict(cfg, excluded_names=["^2$"]), opt)
    seen = []
    if force_callbacks:
        monkeypatch.setattr(cb, "_idle", lambda: False)
    else:
        real = cb._idle

        def spy():
            seen.append(real())
            return seen[-1]

        monkeypatch.setattr(cb, "_idle", spy)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        opt.zero_grad()
        nn.functional.cross_entropy(model(torch.randn(6, 12, generator=g)), torch.randint(0, 5, (6,), generator=g)).backward()
        opt.step()
    return model, opt, cb, seen


@pytest.mark.parametrize("prune_type", ["snip_momentum", "magnitude", "pattern_lock"])
def test_skipping_idle_callbacks_changes_nothing(prune_type, monkeypatch):
    cfg = dict(CFG, prune_type=prune_type)
    ref_model, ref_opt, ref_cb, _ = _train(cfg, 60, True, monkeypatch)
    model, opt, cb, seen = _train(cfg, 60, False, monkeypatch)
    assert seen.count(True) > 20 and seen.count(False) > 0  # the fast path ran, and so did the callbacks
    for (k, a), (k2, b) in zip(ref_model.state_dict().items(), model.state_dict().items()):
        assert k == k2 and torch.equal(_bits(a), _bits(b)), k
    for p_ref, p in zip(ref_model.parameters(), model.parameters()):
        for key, value in ref_opt.state[p_ref].items():
            assert torch.equal(_bits(value.float()), _bits(opt.state[p][key].float())), key
    a, b = ref_cb.state_dict(), cb.state_dict()
    assert a["local_step"] == b["local_step"] == 60
    for pa, pb in zip(a["pruners"], b["pruners"]):
        assert pa.keys() == pb.keys()
        for key in pa:
            va, vb = pa[key], pb[key]
            if isinstance(va, dict):
                assert va.keys() == vb.keys() and all(torch.equal(va[n], vb[n]) for n in va), key
            else:
                assert va == vb, key
    assert [p.global_step for p in cb.pruners] == [60]


def test_idle_steps_of_the_schedule():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8))
    p = prepare_pruning(model, {"prune_type": "magnitude", "pattern": "1x1", "target_sparsity": 0.5,
                                "start_step": 2, "end_step": 8, "update_frequency_on_step": 3}).pruners[0]
    assert [s for s in range(12) if not p.idle_at(s)] == [2, 5, 8]
    # snip_momentum scores every step up to the last update
    p = prepare_pruning(nn.Sequential(nn.Linear(8, 8)), dict(CFG, end_step=8, start_step=2)).pruners[0]
    assert [s for s in range(12) if not p.idle_at(s)] == list(range(9))


def test_a_pruner_overriding_a_step_callback_is_never_idle(monkeypatch):
    calls = []

    @register_pruners("counting_test")
    class Counting(MagnitudePruner):
        def on_step_end(self):
            calls.append(self.global_step)
            super().on_step_end()

    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 8))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        cb = prepare_pruning(model, {"prune_type": "counting_test", "pattern": "1x1", "target_sparsity": 0.5,
                                     "start_step": 0, "end_step": 2}, opt)
        assert not cb.pruners[0].idle_at(5)
        for _ in range(6):
            opt.zero_grad()
            model(torch.randn(2, 8)).sum().backward()
            opt.step()
        assert calls == list(range(6))
    finally:
        PRUNERS.pop("counting_test", None)


def test_counting_an_idle_step_is_all_or_nothing(monkeypatch):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cfg = {"prune_type": "magnitude", "pattern": "1x1", "target_sparsity": 0.5, "start_step": 0, "end_step": 0}
    cb = prepare_pruning(model, {"pruners": [dict(cfg, names=["^0$"]), dict(cfg, names=["^1$"])]}, opt)
    cb.call_event("on_step_begin")
    cb.call_event("on_step_end")
    before = ([(p.local_step, p.global_step) for p in cb.pruners], cb._local_step)
    second = cb.pruners[1]
    real = type(second).__dict__.get("global_step")
    assert real is None  # a plain attribute: make writing it fail on the second pruner

    class Refuses(type(second)):
        def __setattr__(self, key, value):
            if key == "global_step":
                raise KeyboardInterrupt
            super().__setattr__(key, value)

    monkeypatch.setattr(second, "__class__", Refuses)
    with pytest.raises(KeyboardInterrupt):
        PruningCallbacks._count_step(cb, advance=True)
    monkeypatch.setattr(second, "__class__", Refuses.__mro__[1])
    assert ([(p.local_step, p.global_step) for p in cb.pruners], cb._local_step) == before
