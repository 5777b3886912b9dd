"""prunekit.oneshot on mixture-of-experts models: every expert's slice of the 3-D experts parameters pruned
from the tokens routed to it, exact per slice; routers dense unless asked for; the rollback."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import prunekit
from prunekit.oneshot import sparsegpt_prune
from prunekit.oneshot.solvers import magnitude_prune, prune_count

transformers = pytest.importorskip("transformers", reason="transformers is not installed")

from helpers import shrink_models as S  # noqa: E402

pytestmark = [pytest.mark.hf, pytest.mark.usefixtures("one_thread")]

MOE = ["mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3"]


def _batches(family, n=2):
    return [dict(S.zoo_batch(family, seed=i), attention_mask=torch.ones(2, 9, dtype=torch.long)) for i in range(n)]


def _moe_layers(model):
    return [(n, m) for n, m in model.named_modules() if n.endswith("mlp") and hasattr(m, "experts")
            and hasattr(m.experts, "down_proj_orig")]


@pytest.mark.parametrize("family", MOE)
def test_every_expert_slice_pruned_exactly(family):
    model = S.build_zoo(family)
    gates = {n: m.gate.weight.detach().clone() for n, m in model.named_modules() if n.endswith("mlp")
             and hasattr(m, "experts")}
    report = prunekit.oneshot(model, _batches(family), method="sparsegpt", sparsity=0.5)
    layers = _moe_layers(model)
    assert layers and len(layers) == len(gates)
    for name, mlp in layers:
        ex = mlp.experts
        for tensor in ("gate_up_proj", "down_proj"):
            mask = getattr(ex, f"{tensor}_mask")
            for e in range(ex.num_experts):
                row = report.layer(f"{name}.experts.{tensor}.{e}")
                assert int((mask[e] == 0).sum()) == row.pruned == prune_count(mask[e].numel(), 0.5)
                assert row.numel == mask[e].numel()
                assert bool((getattr(ex, tensor)[e][mask[e] == 0] == 0).all())  # the model computes with the zeros
        # the router: dense, its weight untouched, and the report says so
        assert not hasattr(mlp.gate, "weight_mask") and torch.equal(mlp.gate.weight, gates[name])
        assert "router" in report.dense[f"{name}.gate"]
    zeros = sum(r.pruned for r in report.layers)
    assert report.sparsity == zeros / sum(r.numel for r in report.layers)
    assert f"{layers[0][0]}.gate" in str(report)


def _expert_calls(model, mlp_name, batches):
    """(hidden rows, top_k_index) the experts of ``mlp_name`` receive on each batch of the dense model."""
    experts = model.get_submodule(f"{mlp_name}.experts")
    got = []
    handle = experts.register_forward_pre_hook(lambda m, args: got.append((args[0].clone(), args[1].clone())))
    try:
        with torch.no_grad():
            for b in batches:
                model(**b)
    finally:
        handle.remove()
    return got


def test_expert_statistics_come_from_its_routed_real_tokens():
    model = S.build_zoo("mixtral")
    batches = _batches("mixtral")
    batches[1]["attention_mask"][0, 5:] = 0  # padding: left out of every expert's statistics
    calls = _expert_calls(model, "model.layers.0.mlp", batches)
    ex = model.model.layers[0].mlp.experts
    dense_up, dense_down = ex.gate_up_proj.detach().clone(), ex.down_proj.detach().clone()
    prunekit.oneshot(model, batches, method="sparsegpt", sparsity=0.5)
    for e in range(ex.num_experts):
        xs, hs = [], []
        for (hidden, index), b in zip(calls, batches):
            tokens = torch.where(index == e)[0]
            tokens = tokens[b["attention_mask"].reshape(-1)[tokens] != 0]
            x = hidden[tokens]
            gate, up = F.linear(x, dense_up[e]).chunk(2, dim=-1)
            xs.append(x)
            hs.append(F.silu(gate) * up)
        for tensor, dense, rows in (("gate_up_proj", dense_up, xs), ("down_proj", dense_down, hs)):
            x = torch.cat(rows)
            assert x.shape[0] > 0
            new, keep = sparsegpt_prune(dense[e], x.t() @ x, 0.5, damp=0.01, block_size=128)
            assert torch.equal(getattr(ex, f"{tensor}_mask")[e].bool(), keep), (tensor, e)
            assert torch.allclose(getattr(ex, f"{tensor}_orig")[e], new, atol=1e-5), (tensor, e)


def test_expert_no_token_reaches_is_pruned_by_magnitude():
    model = S.build_zoo("mixtral")
    batches = [{"input_ids": torch.tensor([[5]])}]  # one token: 2 of the 4 experts of each layer see nothing
    (_, index), = _expert_calls(model, "model.layers.0.mlp", batches)
    unseen = sorted(set(range(4)) - set(index.reshape(-1).tolist()))
    assert len(unseen) == 2
    ex = model.model.layers[0].mlp.experts
    dense = ex.gate_up_proj.detach().clone()
    report = prunekit.oneshot(model, batches, method="sparsegpt", sparsity=0.5)
    for e in unseen:
        assert torch.equal(ex.gate_up_proj_mask[e].bool(), magnitude_prune(dense[e], 0.5))
        assert torch.equal(ex.gate_up_proj_orig[e], dense[e])  # no statistics to update the weights with
        assert report.layer(f"model.layers.0.mlp.experts.gate_up_proj.{e}").error is None
    seen = index[0, 0].item()
    assert not torch.equal(ex.gate_up_proj_orig[seen], dense[seen])  # SparseGPT's update where tokens went


def test_routers_true_prunes_routers_and_shared_expert_gates():
    model = S.build_zoo("qwen2_moe")
    report = prunekit.oneshot(model, _batches("qwen2_moe"), method="wanda", sparsity=0.5, routers=True)
    mlp = model.model.layers[0].mlp
    for name in ("gate", "shared_expert_gate"):
        mod = getattr(mlp, name)
        assert int((mod.weight_mask == 0).sum()) == report.layer(f"model.layers.0.mlp.{name}").pruned
        assert report.layer(f"model.layers.0.mlp.{name}").sparsity == 0.5
    assert report.dense == {}


def test_bake_writes_zeros_into_the_plain_expert_parameters():
    model = S.build_zoo("qwen3_moe")
    report = prunekit.oneshot(model, _batches("qwen3_moe"), method="prunekit-fast", sparsity=0.5, masks="bake")
    assert not prunekit.is_pruned(model)
    ex = model.model.layers[1].mlp.experts
    for e in range(ex.num_experts):
        zeros = int((ex.down_proj[e] == 0).sum())
        assert zeros == report.layer(f"model.layers.1.mlp.experts.down_proj.{e}").pruned == ex.down_proj[e].numel() // 2


@pytest.mark.parametrize("masks", ["keep", "bake"])
def test_failure_leaves_the_moe_model_as_it_was(masks):
    model = S.build_zoo("mixtral")
    before = {k: v.clone() for k, v in model.state_dict().items()}

    def fail(done, total, name):
        if done == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        prunekit.oneshot(model, _batches("mixtral"), method="prunekit", sparsity=0.5, masks=masks, progress=fail)
    assert not prunekit.is_pruned(model)
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    assert model.config.use_cache is True
    assert "forward" not in model.model.layers[0].mlp.experts.__dict__  # the eager tap is gone


def test_ignore_leaves_experts_out():
    model = S.build_zoo("mixtral")
    report = prunekit.oneshot(model, _batches("mixtral"), method="magnitude", sparsity=0.5, ignore=r"experts")
    assert report.layers and not any("experts" in r.name for r in report.layers)
    assert not hasattr(model.model.layers[0].mlp.experts, "down_proj_mask")
