"""The MoE expert axis: importance against a per-token reference, emulation equal to removal, removal and
expert-FFN shrinking that save and load with plain transformers, checks before any change, and rollback."""

from __future__ import annotations

import copy
import os
import sys

import pytest
import torch
import torch.nn.functional as F

from prunekit.shrink import (FAMILIES, dropped_experts, expert_ffn_importance, expert_importance, keep_top,
                             moe_layers, remove_experts, shrink_expert_ffn)
from prunekit.shrink.experts import narrowed_expert_ffn
from prunekit.shrink import experts as experts_module

pytestmark = [pytest.mark.hf, pytest.mark.usefixtures("one_thread")]
transformers = pytest.importorskip("transformers")
from helpers import shrink_models  # noqa: E402

MOE = shrink_models.MOE


def padded_batches(family):
    """Calibration with padding: the second batch's last three tokens of its first row are not real."""
    batches = shrink_models.batches(family, n=2)
    batches[1]["attention_mask"][0, -3:] = 0
    return batches


def outputs(model, batches):
    return [shrink_models.output(model, b) for b in batches]


# ------------------------------------------------------------------ reference: token by token, float64
def routed(model, batches):
    """Per MoE layer, per real token: (its input to the MoE block, the router's indices and weights)."""
    seen = {i: [] for i in moe_layers(model)}
    handles = []
    for i, mlp in moe_layers(model).items():
        def hook(module, args, out, i=i):
            seen[i].append((args[0].reshape(-1, args[0].shape[-1]), out[2], out[1]))
        handles.append(mlp.gate.register_forward_hook(hook))
    try:
        for b in batches:
            mask = b["attention_mask"].flatten().bool()
            n = {i: len(v) for i, v in seen.items()}
            shrink_models.output(model, b)
            for i in seen:
                assert len(seen[i]) == n[i] + 1
                x, idx, w = seen[i][-1]
                seen[i][-1] = (x[mask], idx[mask], w[mask])
    finally:
        for h in handles:
            h.remove()
    return {i: [torch.cat([r[j] for r in v]) for j in range(3)] for i, v in seen.items()}


def reference(model, batches):
    """score, load, tokens, FFN norms of every MoE layer computed one token and one slot at a time."""
    assert model.config.hidden_act == "silu"
    result = {}
    for i, (x, idx, w) in routed(model, batches).items():
        ex = moe_layers(model)[i].experts
        gate_up, down = ex.gate_up_proj.detach().double(), ex.down_proj.detach().double()
        e_count, _, inter = down.shape
        score, count = torch.zeros(e_count, dtype=torch.float64), torch.zeros(e_count, dtype=torch.float64)
        ffn = torch.zeros(e_count, inter, dtype=torch.float64)
        for t in range(x.shape[0]):
            for k in range(idx.shape[1]):
                e = int(idx[t, k])
                h = F.silu(gate_up[e, :inter] @ x[t].double()) * (gate_up[e, inter:] @ x[t].double())
                score[e] += float(w[t, k]) * float((down[e] @ h).norm())
                count[e] += 1
                ffn[e] += h * h
        result[i] = (score, count / count.sum(), x.shape[0], ffn.sqrt())
    return result


@pytest.mark.parametrize("family", MOE)
def test_importance_equals_the_token_by_token_reference_with_padding_left_out(family):
    model = shrink_models.build(family)
    batches = padded_batches(family)
    imp, ffn = expert_importance(model, batches), expert_ffn_importance(model, batches)
    ref = reference(model, batches)
    real = sum(int(b["attention_mask"].sum()) for b in batches)
    assert sorted(imp) == sorted(ffn) == sorted(ref) == [0, 1, 2, 3]
    for i, (score, load, tokens, norms) in ref.items():
        assert imp[i].tokens == tokens == real == 33
        assert imp[i].score.dtype == imp[i].load.dtype == ffn[i].dtype == torch.float64
        torch.testing.assert_close(imp[i].score, score, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(imp[i].load, load, rtol=0, atol=1e-12)
        torch.testing.assert_close(ffn[i], norms, rtol=1e-5, atol=1e-7)
    assert not any(h for mlp in moe_layers(model).values() for h in mlp.experts._forward_pre_hooks.values())


@pytest.mark.parametrize("family", MOE)
def test_an_expert_whose_output_is_zero_ranks_last(family):
    model = shrink_models.build(family)
    with torch.no_grad():
        for mlp in moe_layers(model).values():
            mlp.experts.down_proj[2].zero_()
    imp = expert_importance(model, shrink_models.batches(family))
    for i, layer in imp.items():
        assert layer.score[2] == 0 and bool((layer.score[[0, 1, 3]] > 0).all()), i
        assert layer.load[2] > 0  # the router still chooses it: load alone would not rank it last
    assert all(k.tolist() == [0, 1, 3] for k in keep_top(imp, 3).values())


@pytest.mark.parametrize("family", MOE)
def test_neurons_without_activation_score_zero_and_their_removal_changes_nothing(family):
    model = shrink_models.build(family)
    batches = shrink_models.batches(family)
    inter = moe_layers(model)[0].experts.down_proj.shape[-1]
    dead = {e: [e, e + 5, e + 10, e + 15] for e in range(4)}  # different neurons per expert
    with torch.no_grad():
        for mlp in moe_layers(model).values():
            for e, js in dead.items():
                mlp.experts.gate_up_proj[e, js] = 0.0  # gate rows: act(0) * up = 0
    before = outputs(model, batches)
    ffn = expert_ffn_importance(model, batches)
    for i, norms in ffn.items():
        for e, js in dead.items():
            assert norms[e, js].tolist() == [0.0] * 4 and int((norms[e] > 0).sum()) == inter - 4, (i, e)
    keep = keep_top(ffn, inter - 4)
    assert all(k[e].tolist() == [j for j in range(inter) if j not in dead[e]] for k in keep.values() for e in dead)
    shrink_expert_ffn(model, keep)
    for a, b in zip(before, outputs(model, batches)):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)  # shorter sums: rounding only


def test_an_expert_ffn_width_grouped_mm_cannot_run_is_refused_unless_the_experts_run_eagerly():
    model = shrink_models.build("mixtral")
    keep = {i: [list(range(46))] * 4 for i in range(4)}
    snap = snapshot(model)
    with pytest.raises(ValueError, match=r"an expert FFN width of 46 torch.float32 values \(184 bytes a row\) cannot "
                                         r"run in transformers' grouped_mm experts.*keep 48 neurons or 44 per expert"):
        shrink_expert_ffn(model, keep)
    assert unchanged(model, snap)
    model.set_experts_implementation("eager")
    batch = shrink_models.batches("mixtral", n=1)[0]
    with torch.no_grad():
        for mlp in moe_layers(model).values():
            mlp.experts.down_proj[:, :, 46:] = 0.0
    before = shrink_models.output(model, batch)
    shrink_expert_ffn(model, keep)
    assert model.config.intermediate_size == 46
    torch.testing.assert_close(shrink_models.output(model, batch), before, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------ the round trip
@pytest.mark.parametrize("family", MOE)
def test_drop_an_expert_halve_the_ffn_save_and_load_with_plain_transformers(family, tmp_path):
    model = shrink_models.build(family)
    batches = padded_batches(family)
    fam = FAMILIES[family]
    keep = keep_top(expert_importance(model, batches), 3)
    with dropped_experts(model, keep):
        emulated = outputs(model, batches)
    assert not any(mlp.gate._forward_hooks for mlp in moe_layers(model).values())
    remove_experts(model, keep)
    removed = outputs(model, batches)
    for a, b in zip(emulated, removed):
        assert torch.equal(a, b)
    ffn = expert_ffn_importance(model, batches)
    assert all(v.shape == (3, 24 if family != "mixtral" else 48) for v in ffn.values())
    width = next(iter(ffn.values())).shape[1] // 2
    shrink_expert_ffn(model, keep_top(ffn, width))
    config = model.config
    assert getattr(config, fam.experts_key) == 3 and getattr(config, fam.expert_ffn_key) == width
    assert config.num_experts_per_tok == 2 and config.hidden_size == 32
    if family != "mixtral":  # Qwen-MoE: the dense MLPs' width is another key, not changed here
        assert config.intermediate_size == 48
    if family == "qwen2_moe":
        assert config.shared_expert_intermediate_size == 40
    for mlp in moe_layers(model).values():
        assert mlp.gate.weight.shape == (3, 32) and mlp.gate.num_experts == mlp.experts.num_experts == 3
        assert mlp.experts.gate_up_proj.shape == (3, 2 * width, 32) and mlp.experts.down_proj.shape == (3, 32, width)
        assert mlp.experts.intermediate_dim == width
        if family == "qwen2_moe":
            assert mlp.shared_expert.down_proj.weight.shape == (32, 40)
    assert model.num_experts == 3
    shrunk = outputs(model, batches)
    model.save_pretrained(tmp_path)
    loaded = type(model).from_pretrained(tmp_path).eval()
    assert getattr(loaded.config, fam.experts_key) == 3 and getattr(loaded.config, fam.expert_ffn_key) == width
    state, read = model.state_dict(), loaded.state_dict()
    assert state.keys() == read.keys() and all(torch.equal(state[k], read[k]) for k in state)
    for a, b in zip(shrunk, outputs(loaded, batches)):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7)
    # safetensors maps the weights 8-byte but not 64-byte aligned, and a matmul's SIMD path (so its last bit)
    # may follow the alignment: in freshly allocated memory the loaded model computes bit for bit the same
    with torch.no_grad():
        for p in loaded.parameters():
            p.data = p.data.clone()
    for a, b in zip(shrunk, outputs(loaded, batches)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("family, overrides, implementation, sparse", [
    ("qwen2_moe", dict(norm_topk_prob=True, mlp_only_layers=[1]), "grouped_mm", [0, 2, 3]),
    ("qwen3_moe", dict(decoder_sparse_step=2), "batched_mm", [1, 3]),
    ("qwen3_moe", dict(norm_topk_prob=True), "eager", [0, 1, 2, 3]),
    ("mixtral", dict(num_experts_per_tok=3), "eager", [0, 1, 2, 3]),
])
def test_emulation_equals_removal_bit_for_bit(family, overrides, implementation, sparse):
    model = shrink_models.build(family, **overrides)
    model.set_experts_implementation(implementation)
    batches = padded_batches(family)
    layers = sorted(moe_layers(model))
    assert layers == sparse
    keep = {i: [e for e in range(4) if e != (i + 1) % 4] for i in layers}  # a different expert per layer
    dense = outputs(model, batches)
    with dropped_experts(model, {i: range(4) for i in layers}):
        assert all(torch.equal(a, b) for a, b in zip(dense, outputs(model, batches)))
    with dropped_experts(model, keep):
        emulated = outputs(model, batches)
    assert all(torch.equal(a, b) for a, b in zip(dense, outputs(model, batches)))  # hooks gone
    assert not all(torch.equal(a, b) for a, b in zip(dense, emulated))
    remove_experts(model, keep)
    assert all(torch.equal(a, b) for a, b in zip(emulated, outputs(model, batches)))


@pytest.mark.parametrize("family", MOE)
def test_narrowed_expert_ffn_computes_what_shrinking_it_leaves(family):
    model = shrink_models.build(family)
    batches = padded_batches(family)
    keep = keep_top(expert_ffn_importance(model, batches), 16)
    dense = outputs(model, batches)
    with narrowed_expert_ffn(model, keep):
        emulated = outputs(model, batches)
    assert not any(mlp.experts._forward_hooks for mlp in moe_layers(model).values())
    assert all(torch.equal(a, b) for a, b in zip(dense, outputs(model, batches)))  # hooks gone
    assert all((a - b).abs().max() > 1e-4 for a, b in zip(dense, emulated))
    shrink_expert_ffn(model, keep)
    # the emulation multiplies the dropped neurons by zero columns, the shrunk experts leave them out of the
    # sum: the same terms, added in another order
    for a, b in zip(emulated, outputs(model, batches)):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


def test_emulation_may_drop_experts_in_some_layers_only_and_hooks_go_on_error():
    model = shrink_models.build("mixtral")
    batch = shrink_models.batches("mixtral", n=1)[0]
    dense = shrink_models.output(model, batch)
    seen = []
    model.model.layers[3].mlp.gate.register_forward_hook(lambda m, a, out: seen.append(out[2]))
    with pytest.raises(RuntimeError, match="stop"):
        with dropped_experts(model, {3: [0, 2]}):
            shrink_models.output(model, batch)
            raise RuntimeError("stop")
    assert set(seen[0].unique().tolist()) == {0, 2}  # the routing of the experts kept, in the full index space
    assert len(model.model.layers[3].mlp.gate._forward_hooks) == 1  # only the test's own hook is left
    assert torch.equal(dense, shrink_models.output(model, batch))


# ------------------------------------------------------------------ checks before any change
def snapshot(model):
    return ({n: (p, p.detach().clone()) for n, p in model.named_parameters()}, model.config.to_dict(),
            {n: (getattr(m, "num_experts", None), getattr(m, "intermediate_dim", None), len(m._forward_hooks),
                 len(m._forward_pre_hooks)) for n, m in model.named_modules()})


def unchanged(model, snap):
    params, config, attrs = snap
    now = dict(model.named_parameters())
    assert now.keys() == params.keys()
    for n, (p, value) in params.items():
        assert now[n] is p and torch.equal(p, value), n
    assert model.config.to_dict() == config
    assert {n: (getattr(m, "num_experts", None), getattr(m, "intermediate_dim", None), len(m._forward_hooks),
                len(m._forward_pre_hooks)) for n, m in model.named_modules()} == attrs
    return True


ALL4 = {i: [0, 1, 2] for i in range(4)}
EXPERT_ERRORS = [
    ({**ALL4, 1: [0, 1]}, ValueError, r"different expert counts per layer \(\{0: 3, 1: 2, 2: 3, 3: 3\}\); the "
                                            "config holds one number of experts"),
    ({0: [0, 1, 2]}, ValueError, r"keep gives nothing for MoE layers \[1, 2, 3\]"),
    ({**ALL4, 7: [0, 1]}, ValueError, r"keep names layer 7, which has no routed experts; the MoE layers are \[0, "),
    ({**ALL4, 2: [0, 4]}, IndexError, r"keep\[2\] names expert 4, out of range for 4 experts \(valid: 0..3\)"),
    ({**ALL4, 2: [1, 1, 2]}, ValueError, r"keep\[2\] names some experts twice \(\[1, 1, 2\]\)"),
    ({**ALL4, 0: []}, ValueError, r"keep\[0\] keeps no experts; keep at least one"),
    ({i: [3] for i in range(4)}, ValueError, r"layer 0 would keep 1 experts, but its router picks "
                                             r"num_experts_per_tok=2 per token; keep at least 2"),
    ([[0, 1, 2]] * 4, TypeError, "keep must map MoE layer index -> kept indices"),
    ({**ALL4, 0: torch.tensor([0.0, 1.0])}, TypeError, r"keep\[0\] is a 1-D torch.float32 tensor"),
    ({**ALL4, 0: [0, True]}, TypeError, r"keep\[0\] is \[0, True\]; give the kept experts as whole numbers"),
]


@pytest.mark.parametrize("keep, error, message", EXPERT_ERRORS)
def test_a_bad_expert_keep_is_a_clear_error_and_changes_nothing(keep, error, message):
    model = shrink_models.build("mixtral")
    snap = snapshot(model)
    with pytest.raises(error, match=message):
        remove_experts(model, keep)
    assert unchanged(model, snap)


EMULATION_ERRORS = [e for e in EXPERT_ERRORS if not e[2].startswith(("different", "keep gives"))]  # allowed there


@pytest.mark.parametrize("keep, error, message", EMULATION_ERRORS)
def test_the_emulation_checks_keep_as_removal_does(keep, error, message):
    model = shrink_models.build("mixtral")
    snap = snapshot(model)
    with pytest.raises(error, match=message):
        with dropped_experts(model, keep):
            raise AssertionError("the block must not run")
    assert unchanged(model, snap)


def test_a_model_without_experts_or_without_moe_layers_is_named():
    with pytest.raises(ValueError, match=r"the family 'llama' \(LlamaForCausalLM\) has no routed experts; the expert "
                                         r"axis applies to mixtures of experts \(mixtral, qwen2_moe, qwen3_moe\)"):
        expert_importance(shrink_models.build("llama"), shrink_models.batches("llama"))
    dense = shrink_models.build("qwen3_moe", mlp_only_layers=[0, 1, 2, 3])
    with pytest.raises(ValueError, match=r"Qwen3MoeForCausalLM has no sparse MoE layer .*mlp_only_layers"):
        remove_experts(dense, {})
    with pytest.raises(ValueError, match="calibration is empty"):
        expert_importance(shrink_models.build("mixtral"), [])
    with pytest.raises(ValueError, match=r"keep_top: count=5 for layer 0, which has 4 scores"):
        keep_top({0: torch.zeros(4)}, 5)


FFN_ERRORS = [
    ({i: [[0, 1]] * 3 for i in range(4)}, ValueError, r"keep\[0\] has 3 rows, but layer 0 has 4 experts"),
    ({**{i: [[0, 1]] * 4 for i in range(4)}, 2: [[0, 1], [0, 1], [0, 1, 2], [0, 1]]}, ValueError,
     r"the experts of layer 2 keep different numbers of neurons \(\[2, 2, 3, 2\]\)"),
    ({**{i: [[0, 1]] * 4 for i in range(4)}, 3: [[0]] * 4}, ValueError,
     r"different expert FFN widths per layer \(\{0: 2, 1: 2, 2: 2, 3: 1\}\)"),
    ({i: [[0, 48]] * 4 for i in range(4)}, IndexError, r"keep\[0\]\[0\] names neuron 48, out of range for 48 neurons"),
    ({i: 5 for i in range(4)}, TypeError, r"keep\[0\] is 5; give one list of kept neurons per expert"),
    ({0: [[0, 1]] * 4}, ValueError, r"keep gives nothing for MoE layers \[1, 2, 3\]"),
]


@pytest.mark.parametrize("keep, error, message", FFN_ERRORS)
def test_a_bad_neuron_keep_is_a_clear_error_and_changes_nothing(keep, error, message):
    model = shrink_models.build("mixtral")
    snap = snapshot(model)
    with pytest.raises(error, match=message):
        shrink_expert_ffn(model, keep)
    assert unchanged(model, snap)


# ------------------------------------------------------------------ an interrupt or error at any line
SOURCE = os.path.abspath(experts_module.__file__)


def run_stopped(fn, at, error):
    """Run ``fn()`` raising ``error`` before the ``at``-th line executed in experts.py (None: count them)."""
    seen = [0]

    def local(frame, event, arg):
        if event == "line":
            seen[0] += 1
            if seen[0] == at:
                raise error(f"line {frame.f_lineno}")
        return local

    sys.settrace(lambda frame, event, arg: local if frame.f_code.co_filename == SOURCE else None)
    try:
        fn()
    finally:
        sys.settrace(None)
    return seen[0]


@pytest.mark.parametrize("error", [KeyboardInterrupt, RuntimeError])
@pytest.mark.parametrize("call", ["remove_experts", "shrink_expert_ffn"])
def test_a_failure_anywhere_leaves_the_model_as_it_was(call, error):
    keep = {i: [0, 2, 3] for i in range(4)} if call == "remove_experts" else {i: [[1, 3, 5, 7]] * 4 for i in range(4)}
    fn = remove_experts if call == "remove_experts" else shrink_expert_ffn
    batches = shrink_models.batches("qwen2_moe", n=1)
    dense = shrink_models.build("qwen2_moe")
    before = outputs(dense, batches)
    done = fn(copy.deepcopy(dense), keep)
    after = (outputs(done, batches), done.config.to_dict())
    total = run_stopped(lambda: fn(copy.deepcopy(dense), keep), None, error)
    points = sorted({1 + round(k * (total - 1) / 59) for k in range(60)})  # the first line, the last, 58 between
    assert total > 60 and len(points) == 60
    rolled_back = 0
    for at in points:
        model = copy.deepcopy(dense)
        snap = snapshot(model)
        with pytest.raises(error, match=r"^line \d+$"):
            run_stopped(lambda: fn(model, keep), at, error)
        if model.config.to_dict() == after[1]:  # stopped after the change was complete: all of it is there
            assert all(torch.equal(a, b) for a, b in zip(after[0], outputs(model, batches)))
            continue
        assert unchanged(model, snap)
        assert all(torch.equal(a, b) for a, b in zip(before, outputs(model, batches)))
        rolled_back += 1
    assert rolled_back >= 55


def test_an_interrupt_anywhere_in_the_emulation_leaves_no_hook():
    model = shrink_models.build("mixtral")
    batch = shrink_models.batches("mixtral", n=1)[0]
    dense = shrink_models.output(model, batch)

    def emulate():
        with dropped_experts(model, {i: [0, 1, 3] for i in range(4)}):
            shrink_models.output(model, batch)

    total = run_stopped(emulate, None, KeyboardInterrupt)
    for at in range(1, total + 1, max(1, total // 60)):
        with pytest.raises(KeyboardInterrupt):
            run_stopped(emulate, at, KeyboardInterrupt)
        assert not any(m._forward_hooks for m in model.modules()), at
        assert torch.equal(dense, shrink_models.output(model, batch))
