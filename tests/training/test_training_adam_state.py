"""Adam's second moment at pruned entries holds a tiny positive number instead of zero (PyTorch's CPU sqrt is
slow on exact zeros): the weights are bit for bit those of plain zeros, and the optimizer state is too once
the pruner lets go of the optimizer."""

import math

import pytest
import torch
from torch import nn

from prunekit.training import _optim, prepare_pruning


pytestmark = pytest.mark.usefixtures("one_thread")

CONFIG = {"prune_type": "snip_momentum", "pattern": "1x1", "target_sparsity": 0.8, "start_step": 10,
          "end_step": 150, "update_frequency_on_step": 10, "sparsity_decay_type": "cube"}

OPTIMIZERS = {
    "Adam": lambda p: torch.optim.Adam(p, lr=1e-2),
    "Adam-foreach": lambda p: torch.optim.Adam(p, lr=1e-2, foreach=True),
    "Adam-amsgrad-wd": lambda p: torch.optim.Adam(p, lr=1e-2, amsgrad=True, weight_decay=1e-2),
    "AdamW": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
    "NAdam": lambda p: torch.optim.NAdam(p, lr=1e-2),
    "RAdam": lambda p: torch.optim.RAdam(p, lr=1e-2),
    "Adam-fused": lambda p: torch.optim.Adam(p, lr=1e-2, fused=True),
}


def bits(t):
    return t.detach().contiguous().reshape(-1).view(torch.int32).clone()


def run(make_opt, steps, fill, monkeypatch, betas=None, end_step=150):
    monkeypatch.setattr(_optim, "FILL_SECOND_MOMENTS", fill)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = make_opt(model.parameters())
    if betas is not None:
        for g in opt.param_groups:
            g["betas"] = betas
    cb = prepare_pruning(model, dict(CONFIG, excluded_names=["^4$"], end_step=end_step), opt)
    g = torch.Generator().manual_seed(1)
    smallest = math.inf
    for step in range(steps):
        x = torch.randn(8, 16, generator=g)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), torch.randint(0, 4, (8,), generator=g)).backward()
        opt.step()
        if fill and step > CONFIG["start_step"] and "exp_avg_sq" in opt.state[model[0].weight_orig]:
            for i in (0, 2):
                pruned = model[i].weight_mask == 0
                v = opt.state[model[i].weight_orig]["exp_avg_sq"][pruned]
                if v.numel():
                    smallest = min(smallest, float(v.min()))
    return model, opt, cb, smallest


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_weights_are_bit_identical_to_plain_zeros(name, monkeypatch):
    # 300 steps with Adam (the figure); a shorter schedule and 80 steps with the other variants
    make_opt = OPTIMIZERS[name]
    steps, end = (300, 150) if name == "Adam" else (80, 60)
    ref_model, ref_opt, ref_cb, _ = run(make_opt, steps, False, monkeypatch, end_step=end)
    model, opt, cb, smallest = run(make_opt, steps, True, monkeypatch, end_step=end)
    # the trick was in place: a normal positive float at every pruned entry, all along
    assert 2.0 ** -126 < smallest <= _optim.TINY
    pruned = model[2].weight_mask == 0
    assert int(pruned.sum()) > 0
    assert torch.all(ref_opt.state[ref_model[2].weight_orig]["exp_avg_sq"][pruned] == 0)
    # weights, masks and first moments: bit for bit
    for (k, a), (k2, b) in zip(ref_model.state_dict().items(), model.state_dict().items()):
        assert k == k2 and torch.equal(bits(a), bits(b)), k
    # once the pruner lets go of the optimizer, its whole state is bit for bit the plain one too
    cb.unwire()
    ref_cb.unwire()
    for p_ref, p in zip(ref_model.parameters(), model.parameters()):
        for key, value in ref_opt.state[p_ref].items():
            assert torch.equal(bits(value.float()), bits(opt.state[p][key].float())), key


def test_the_tiny_second_moment_is_refilled_before_it_decays_out_of_the_normal_range(monkeypatch):
    # beta2 = 0.8: TINY * 0.8**k leaves the normal float32 range after 81 steps; the refill period is 62
    assert _optim.refill_period(torch.optim.Adam([nn.Parameter(torch.zeros(1))], betas=(0.9, 0.8)),
                                nn.Parameter(torch.zeros(1))) is None  # not a parameter of it
    ref_model, _, _, _ = run(OPTIMIZERS["Adam"], 200, False, monkeypatch, betas=(0.9, 0.8), end_step=40)
    model, opt, cb, smallest = run(OPTIMIZERS["Adam"], 200, True, monkeypatch, betas=(0.9, 0.8), end_step=40)
    p = model[0].weight_orig
    assert _optim.refill_period(opt, p) == 62
    assert smallest >= 2.0 ** -126  # never denormal, never zero
    for a, b in zip(ref_model.state_dict().values(), model.state_dict().values()):
        assert torch.equal(bits(a), bits(b))


def test_sgd_state_is_plain_zeros(monkeypatch):
    model, opt, cb, _ = run(lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9), 40, True, monkeypatch)
    pruned = model[0].weight_mask == 0
    assert int(pruned.sum()) > 0
    assert torch.all(opt.state[model[0].weight_orig]["momentum_buffer"][pruned] == 0)
