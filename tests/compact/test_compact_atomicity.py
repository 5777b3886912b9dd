"""Failure atomicity of compaction's mutating functions.

``prune_groups`` and ``compact(inplace=True)`` get a failure injected at every step
that changes the model -- an ordinary exception and a ``KeyboardInterrupt`` -- and the
whole model state (classes, parameter objects and values, buffers, hooks, pruning
containers, attributes) must be exactly what it was before the call.
"""

from __future__ import annotations

import copy
import sys

import pytest
import torch
from torch import nn

import prunekit
from prunekit.compact import CompactionError, build_dependency_graph, compact, prune_groups
from prunekit import methods
from prunekit.compact.surgery import shrink as surgery
from helpers.compact_models import EncoderBlock, ResNetLike


def state(model):
    """Everything a failed call could have changed, comparable with ==."""
    out = []
    for name, m in model.named_modules():
        hooks = []
        for k, h in m._forward_pre_hooks.items():
            hooks.append((k, type(h).__name__, len(getattr(h, "_pruning_methods", ()))))
        attrs = {k: v for k, v in vars(m).items() if isinstance(v, (int, float, str, bool, tuple)) or v is None}
        out.append((
            name, type(m).__name__, id(m), sorted(attrs.items(), key=str), hooks,
            [(k, id(p), p.dtype, tuple(p.shape), p.detach().clone()) if p is not None else (k, None)
             for k, p in m._parameters.items()],
            [(k, b.detach().clone()) if b is not None else (k, None) for k, b in m._buffers.items()],
            sorted(m._non_persistent_buffers_set),
        ))
    return out


def same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x[:5] == y[:5], (x[:5], y[:5])
        for (p, q) in zip(x[5] + x[6], y[5] + y[6]):
            assert p[:-1] == q[:-1]
            assert (p[-1] is None and q[-1] is None) or torch.equal(p[-1], q[-1])
        assert x[7] == y[7]


pytestmark = pytest.mark.usefixtures("one_thread")


class Boom(Exception):
    pass


def _inject(monkeypatch, module, attr, at, exc):
    """Make the ``at``-th call of ``module.attr`` raise ``exc``; returns the call counter."""
    real = getattr(module, attr)
    calls = [0]

    def wrapped(*a, **k):
        calls[0] += 1
        if calls[0] == at:
            raise exc()
        return real(*a, **k)

    monkeypatch.setattr(module, attr, wrapped)
    return calls


def _cases():
    return [
        (lambda: ResNetLike(widths=(8, 8, 16, 16), blocks=(1, 1, 1, 1)).eval(), torch.randn(1, 3, 16, 16)),
        (lambda: EncoderBlock(d=16, ff=16).eval(), (torch.randint(0, 50, (2, 5)),)),
    ]


@pytest.mark.parametrize("exc", [Boom, KeyboardInterrupt])
@pytest.mark.parametrize("case", [0, 1])
def test_prune_groups_rolls_back_at_every_mask(monkeypatch, exc, case):
    make, x = _cases()[case]
    probe = make()
    calls = _inject(monkeypatch, methods, "apply_mask", 10**9, Boom)
    prune_groups(probe, x, 0.5)
    n = calls[0]
    monkeypatch.undo()
    assert n > 3
    for at in sorted({1, n // 2, n}):
        m = make()
        # some tensors already pruned: the new masks must compose and then roll back
        prunekit.l1_unstructured(next(mod for mod in m.modules() if isinstance(mod, (nn.Conv2d, nn.Linear))), "weight", 0.2)
        before = state(m)
        _inject(monkeypatch, methods, "apply_mask", at, exc)
        with pytest.raises(exc):
            prune_groups(m, x, 0.5)
        monkeypatch.undo()
        same(state(m), before)


@pytest.mark.parametrize("exc", [Boom, KeyboardInterrupt])
@pytest.mark.parametrize("where", ["shrink_module", "replace_tensor", "set_attr", "apply_mask"])
def test_compact_inplace_rolls_back_at_every_step(monkeypatch, exc, where):
    make, x = _cases()[0]
    m = make()
    prunekit.l1_unstructured(m.layers[1][0].conv1, "weight", 0.3)
    g = build_dependency_graph(m, x)
    prune_groups(m, x, 0.5, graph=g)
    compact_module = sys.modules["prunekit.compact.compact"]  # the package's name is the function
    target = {"shrink_module": (compact_module, "shrink_module"), "replace_tensor": (surgery, "replace_tensor"),
              "set_attr": (surgery, "set_attr"), "apply_mask": (methods, "apply_mask")}[where]
    calls = _inject(monkeypatch, *target, 10**9, Boom)  # count the calls of a clean run on a copy
    compact(copy.deepcopy(m), x, inplace=True)
    n = calls[0]
    monkeypatch.undo()
    assert n >= 1
    with torch.no_grad():
        ref = m(x)
    for at in sorted({1, n}):
        before = state(m)
        _inject(monkeypatch, *target, at, exc)
        with pytest.raises(exc):
            compact(m, x, inplace=True, graph=g)
        monkeypatch.undo()
        same(state(m), before)
        with torch.no_grad():
            assert torch.equal(m(x), ref)
    small = compact(m, x, inplace=True, graph=g)  # and it still compacts afterwards
    assert small is m and m.conv1.out_channels == 4
    with torch.no_grad():
        assert float((m(x) - ref).norm() / ref.norm()) < 1e-5


def test_compact_checks_the_output_and_changes_nothing_when_it_differs(monkeypatch):
    make, x = _cases()[0]
    m = make()
    prune_groups(m, x, 0.5)
    before = state(m)
    real = surgery.slice_tensor

    def wrong(t, keep):  # a handler bug: consumers read the kept channels in the wrong order
        return real(t, {a: i.flip(0) if a == 1 and t.dim() == 4 else i for a, i in keep.items()})

    monkeypatch.setattr(surgery, "slice_tensor", wrong)
    with pytest.raises(CompactionError, match=r"output 0 of the compacted model differs .* nothing was changed"):
        compact(m, x, inplace=True)
    same(state(m), before)
    with pytest.raises(CompactionError):
        compact(m, x)
    small = compact(m, x, check=False)
    assert small.conv1.out_channels == 4
