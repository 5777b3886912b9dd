"""The dense model's stream as the refit's target: joins, their additivity check, the moments, the fit."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

import prunekit
import prunekit.shrink.refit as refit
import prunekit.shrink.targets as targets
from prunekit.kernels.lstsq import fit_columns
from prunekit.shrink.targets import find_joins, teacher_moments
from prunekit.shrink.width import Width
from prunekit.transaction import Transaction

transformers = pytest.importorskip("transformers")
from helpers import shrink_models  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread", "quiet_transformers")
DENSE = contextlib.nullcontext


def _ids(vocab=64, n=3, t=10, seed=0):
    return {"input_ids": torch.randint(0, vocab, (n, t), generator=torch.Generator().manual_seed(seed))}


def test_each_writer_of_the_stream_joins_it_at_the_next_norm():
    model = shrink_models.build("llama")
    layers = model.model.layers
    readers = [m for layer in layers for m in (layer.self_attn.o_proj, layer.mlp.down_proj)]
    joins = find_joins(model, _ids(), readers, DENSE)
    want = []
    for i, layer in enumerate(layers):
        after = layers[i + 1].input_layernorm if i + 1 < len(layers) else model.model.norm
        want += [layer.post_attention_layernorm, after]
    assert [joins[id(r)] for r in readers] == want


def test_gpt2_conv1d_writers_join_too():
    model = shrink_models.build("gpt2")
    blocks = model.transformer.h
    readers = [b.mlp.c_proj for b in blocks]
    joins = find_joins(model, _ids(), readers, DENSE)
    assert [joins[id(r)] for r in readers] == [blocks[1].ln_1, blocks[2].ln_1, blocks[3].ln_1, model.transformer.ln_f]


class _Scaled(nn.Module):
    """A block whose writer's output is scaled before it joins the stream: not additive."""

    def __init__(self, scale=0.5, shared=False):
        super().__init__()
        self.a, self.b, self.norm = nn.Linear(8, 8), nn.Linear(8, 8), nn.LayerNorm(8)
        self.scale, self.shared = scale, shared

    def forward(self, x):
        h = x + self.scale * self.a(x)
        if self.shared:  # two writers add into the same norm's input
            h = h + self.b(x)
        return self.norm(h)


def test_a_join_that_is_not_additive_or_is_shared_is_left_out():
    torch.manual_seed(0)
    x = torch.randn(4, 8)
    scaled = _Scaled(0.5)
    assert find_joins(scaled, x, [scaled.a], DENSE) == {}
    plain = _Scaled(1.0)
    assert find_joins(plain, x, [plain.a], DENSE) == {id(plain.a): plain.norm}
    shared = _Scaled(1.0, shared=True)
    assert find_joins(shared, x, [shared.a, shared.b], DENSE) == {}


def test_on_the_dense_model_the_target_is_the_layers_own_output():
    model = shrink_models.build("bert")
    mask = torch.ones(12, 10, dtype=torch.long)
    mask[1, 6:] = mask[2, 8:] = 0
    batch = dict(_ids(n=12), attention_mask=mask)
    down = model.encoder.layer[1].output.dense
    joins = find_joins(model, batch, [down], DENSE)
    g, c, tt, rows = teacher_moments(model, [batch], [down], joins, {}, DENSE)[id(down)]
    assert rows == 120 - 6  # padding left out; more rows than the layer's 49 inputs
    a = torch.cat([down.weight.detach().double(), down.bias.detach().double()[:, None]], 1)
    torch.testing.assert_close(c, a @ g, rtol=1e-5, atol=1e-6)  # t = o = A x on every row (float32 o)
    every = torch.arange(a.shape[1])
    torch.testing.assert_close(fit_columns(g, c, every, damp=0.0), a, rtol=1e-4, atol=1e-4)


def _width(family):
    model = shrink_models.build(family)
    batches = shrink_models.batches(family)
    width = Width(model, batches[0])
    width.score(batches)
    return model, batches, width


def _output_error(model, dense, batches):
    got = torch.cat([shrink_models.output(model, b).flatten() for b in batches])
    want = torch.cat([shrink_models.output(dense, b).flatten() for b in batches])
    return float((got - want).norm() / want.norm())


@pytest.mark.parametrize("family", ["llama", "bert"])
def test_fitting_to_the_dense_stream_brings_the_output_closer_than_fitting_each_layer_alone(family):
    dense_model = shrink_models.build(family)
    errors = {}
    for how in ("own", "dense"):
        model, batches, width = _width(family)
        keep = {"ffn": width.axes["ffn"].units // 4}
        with width.emulated(keep):
            fits = refit.refit_readers(width, keep, batches, Transaction(),
                                       dense=(lambda w=width: _paused(w)) if how == "dense" else None)
            assert len(fits) == len(width.blocks) and all(f.error_after < f.error_before for f in fits)
            errors[how] = _output_error(model, dense_model, batches)
    assert errors["dense"] < errors["own"]


@contextlib.contextmanager
def _paused(width):
    """The model dense inside an emulation: its hooks off, then on again (what shrink's plan does)."""
    hooks = [(m, dict(m._forward_pre_hooks), dict(m._forward_hooks)) for m in width.model.modules()]
    for m, _, _ in hooks:
        m._forward_pre_hooks.clear()
        m._forward_hooks.clear()
    try:
        yield
    finally:
        for m, pre, post in hooks:
            m._forward_pre_hooks.update(pre)
            m._forward_hooks.update(post)


def test_without_an_additive_join_the_refit_is_to_the_layers_own_output(monkeypatch):
    monkeypatch.setattr(targets, "ADDITIVE_TOLERANCE", -1.0)  # no join passes the check
    calls = []
    real = refit._refit_one
    monkeypatch.setattr(refit, "_refit_one", lambda *a, **k: calls.append(a[0]) or real(*a, **k))
    model = shrink_models.build("llama")
    report = prunekit.shrink(model, shrink_models.batches("llama"), 0.5, sizes={"ffn": 16})
    readers = [f"model.layers.{i}.mlp.down_proj" for i in range(4)]
    assert [f.module for f in report.fits] == readers and calls == readers * 2  # scoring the candidate, then for real


def test_an_interrupt_in_the_plain_refit_leaves_the_model_as_it_was(monkeypatch):
    monkeypatch.setattr(targets, "ADDITIVE_TOLERANCE", -1.0)
    model = shrink_models.build("llama")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    calls = []
    real = refit._refit_one

    def second_fails(*args, **kwargs):
        out = real(*args, **kwargs)
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt("injected")
        return out

    monkeypatch.setattr(refit, "_refit_one", second_fails)
    with pytest.raises(KeyboardInterrupt, match="injected"):
        prunekit.shrink(model, shrink_models.batches("llama"), 0.5, sizes={"ffn": 16, "layers": 3})
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], v) for k, v in before.items())
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
