"""Greedy structured OBS (``obs_removal_order``) against a plain implementation of the same greedy steps."""

from typing import List

import pytest
import torch

from prunekit.kernels.lstsq import obs_removal_order

pytestmark = pytest.mark.usefixtures("one_thread")


def plain_obs_order(a: torch.Tensor, h: torch.Tensor, units: torch.Tensor, damp: float = 0.01) -> List[int]:
    """The textbook loop: full-size matrices at every step, each unit's cost from scratch."""
    w = a.double().clone()
    n = h.shape[0]
    hinv = torch.linalg.inv(h.double() + (damp * float(h.double().diagonal().mean()) + 1e-12) * torch.eye(n).double())
    alive = sorted(set(units.tolist()) - {-1})
    order = []
    while len(alive) > 1:
        costs = []
        for u in alive:
            s = (units == u).nonzero().flatten()
            inv = torch.linalg.inv(hinv[s][:, s])
            costs.append(float(torch.trace(w[:, s] @ inv @ w[:, s].T)))
        u = alive[min(range(len(alive)), key=costs.__getitem__)]
        s = (units == u).nonzero().flatten()
        inv = torch.linalg.inv(hinv[s][:, s])
        w = w - w[:, s] @ inv @ hinv[s]
        hinv = hinv - hinv[:, s] @ inv @ hinv[s]
        w[:, s] = 0
        order.append(u)
        alive.remove(u)
    return order + alive


def problem(n_units: int, width: int, out: int, bias: bool, seed: int):
    g = torch.Generator().manual_seed(seed)
    n = n_units * width
    mix = torch.randn(n, n, generator=g, dtype=torch.float64) / n ** 0.5
    x = torch.randn(4 * n, n, generator=g, dtype=torch.float64) @ (torch.eye(n, dtype=torch.float64) + mix)
    x = x * torch.rand(n, generator=g, dtype=torch.float64).add(0.2)  # inputs of different scales
    units = torch.arange(n_units).repeat_interleave(width)
    if bias:
        x = torch.cat([x, torch.ones(len(x), 1, dtype=torch.float64)], 1)
        units = torch.cat([units, torch.tensor([-1])])
    a = torch.randn(out, x.shape[1], generator=g, dtype=torch.float64)
    return a, x.T @ x / len(x), units


@pytest.mark.parametrize("n_units, width, out, bias", [(96, 1, 24, True), (64, 1, 8, False), (12, 8, 32, True),
                                                        (40, 3, 16, False)])
def test_order_equals_the_plain_greedy_steps(n_units, width, out, bias):
    a, h, units = problem(n_units, width, out, bias, seed=n_units + width)
    got = obs_removal_order(a, h, units)
    assert got == plain_obs_order(a, h, units)
    assert sorted(got) == list(range(n_units))


def test_inputs_are_left_unchanged():
    a, h, units = problem(32, 2, 8, True, seed=1)
    before = (a.clone(), h.clone(), units.clone())
    obs_removal_order(a, h, units)
    assert torch.equal(a, before[0]) and torch.equal(h, before[1]) and torch.equal(units, before[2])
