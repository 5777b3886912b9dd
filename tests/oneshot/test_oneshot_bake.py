"""prunekit.oneshot(..., masks="bake"): plain weights with zeros, any dtype, the rollback from scratch files."""

import copy
import os

import pytest
import torch
from torch import nn

import prunekit
from prunekit.oneshot import walk

transformers = pytest.importorskip("transformers", reason="transformers is not installed")
pytestmark = pytest.mark.hf


def _llama(dtype=torch.float32, layers=3):
    cfg = transformers.LlamaConfig(num_hidden_layers=layers, hidden_size=32, intermediate_size=64,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
                                   max_position_embeddings=32)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).to(dtype).eval()


def _batches(n=3, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(0, 64, (2, 12), generator=g)} for _ in range(n)]


def _effective(model):
    """Every linear weight as the model computes with it (masks applied)."""
    return {n: m.weight.detach().clone() for n, m in model.named_modules() if isinstance(m, nn.Linear)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("method", ["magnitude", "wanda", "sparsegpt", "prunekit"])
def test_bake_gives_the_weights_of_keep_as_plain_parameters(dtype, method):
    kept, baked = _llama(dtype), _llama(dtype)
    keys = list(baked.state_dict())
    rk = prunekit.oneshot(kept, _batches(), sparsity=0.5, method=method)
    rb = prunekit.oneshot(baked, _batches(), sparsity=0.5, method=method, masks="bake")
    assert [x.name for x in rb.layers] == [x.name for x in rk.layers] and len(rb.layers) == 21
    assert [x.error for x in rb.layers] == [x.error for x in rk.layers]
    assert list(baked.state_dict()) == keys  # no weight_orig, no weight_mask
    assert not prunekit.is_pruned(baked)
    assert all(type(m) is nn.Linear for n, m in baked.named_modules() if n.endswith("_proj"))
    ek, eb = _effective(kept), _effective(baked)
    for name in ek:
        assert eb[name].dtype == dtype and torch.equal(ek[name], eb[name]), name
    for r in rb.layers:
        w = baked.get_submodule(r.name).weight
        assert int((w == 0).sum()) >= w.numel() // 2
        assert not torch.signbit(w[w == 0]).any()  # pruned entries are +0.0


def _failing_at(monkeypatch, call, exc):
    calls = {"n": 0}
    real = walk.write

    def failing(*a, **k):
        calls["n"] += 1
        if calls["n"] == call:
            raise exc("injected")
        return real(*a, **k)

    monkeypatch.setattr(walk, "write", failing)


@pytest.mark.parametrize("exc", [KeyboardInterrupt, RuntimeError])
@pytest.mark.parametrize("call", [3, 7 + 2, 14 + 7])  # inside block 0; inside block 1; the last layer of block 2
@pytest.mark.parametrize("method", ["sparsegpt", "wanda"])
def test_a_failure_in_block_k_restores_every_block_bit_for_bit(monkeypatch, tmp_path, exc, call, method):
    model = _llama(torch.bfloat16)
    before = copy.deepcopy(model.state_dict())
    params = {n: p for n, p in model.named_parameters()}
    _failing_at(monkeypatch, call, exc)
    with pytest.raises(exc, match="injected"):
        prunekit.oneshot(model, _batches(), sparsity=0.5, method=method, masks="bake", scratch_dir=tmp_path)
    after = model.state_dict()
    assert list(after) == list(before)
    assert all(torch.equal(after[k].view(torch.int16), before[k].view(torch.int16)) for k in before)  # bit for bit
    assert {n: p for n, p in model.named_parameters()} == params  # the same Parameter objects
    assert not prunekit.is_pruned(model) and not model.training and model.config.use_cache
    assert os.listdir(tmp_path) == []  # the scratch files have no name and are gone


def test_the_originals_wait_in_scratch_files_that_have_no_name(monkeypatch, tmp_path):
    from prunekit.oneshot import undo

    seen = []
    real = undo.OriginalsSpool.keep

    def keep(self, tensors):
        step = real(self, tensors)
        seen.append((sorted(tensors), self.bytes, os.listdir(tmp_path)))
        return step

    monkeypatch.setattr(undo.OriginalsSpool, "keep", keep)
    model = _llama(torch.bfloat16)
    prunekit.oneshot(model, _batches(), method="wanda", masks="bake", scratch_dir=tmp_path)
    per_block = sum(m.weight.numel() * 2 for m in model.model.layers[0].modules() if isinstance(m, nn.Linear))
    assert [s[0][0].split(".")[2] for s in seen] == ["0", "1", "2"]  # one file per block, as the block starts
    assert all(len(s[0]) == 7 and s[2] == [] for s in seen)
    assert seen[-1][1] > 3 * per_block  # every block's layers (and each file's header)


def test_keep_with_a_weight_updating_method_restores_weight_orig_values(monkeypatch):
    model = _llama(torch.bfloat16)
    before = copy.deepcopy(model.state_dict())
    _failing_at(monkeypatch, 10, KeyboardInterrupt)
    with pytest.raises(KeyboardInterrupt):
        prunekit.oneshot(model, _batches(), method="sparsegpt")
    assert list(model.state_dict()) == list(before)
    assert all(torch.equal(model.state_dict()[k], before[k]) for k in before)


def test_bad_masks_and_scratch_dir_are_refused(tmp_path):
    model = _llama()
    with pytest.raises(ValueError, match="masks='baked': write 'keep'"):
        prunekit.oneshot(model, _batches(), masks="baked")
    with pytest.raises(ValueError, match="scratch_dir=.*is not a folder"):
        prunekit.oneshot(model, _batches(), method="sparsegpt", masks="bake", scratch_dir=tmp_path / "nope")
    assert not prunekit.is_pruned(model)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_bake_and_disk_to_disk_with_the_blocks_on_cuda(tmp_path):
    from prunekit.oneshot import oneshot_folder

    model = _llama(torch.bfloat16)
    model.save_pretrained(tmp_path / "src")
    r = prunekit.oneshot(model, _batches(), method="sparsegpt", masks="bake", device="cuda")
    assert r.sparsity == 0.5 and not prunekit.is_pruned(model)
    assert all(p.device.type == "cpu" for p in model.parameters())  # each block went there and back
    rd = oneshot_folder(tmp_path / "src", tmp_path / "out", _batches(), method="sparsegpt", device="cuda")
    assert [x.pruned for x in rd.layers] == [x.pruned for x in r.layers]
    loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.bfloat16)
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), model.state_dict().values()))


@pytest.mark.parametrize("fail", [False, True])
def test_the_scratch_files_are_closed_when_the_call_returns_or_fails(monkeypatch, tmp_path, fail):
    from prunekit.io import writer
    from prunekit.oneshot import undo

    files = []
    real = writer.unnamed_file

    def unnamed_file(directory):
        files.append(real(directory))
        return files[-1]

    real_keep = undo.OriginalsSpool.keep

    def keep(self, tensors):
        step = real_keep(self, tensors)
        if fail and len(files) == 2:
            raise RuntimeError("stop in the second block")
        return step

    monkeypatch.setattr(undo, "unnamed_file", unnamed_file)
    monkeypatch.setattr(undo.OriginalsSpool, "keep", keep)
    model = _llama(torch.bfloat16)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    try:
        prunekit.oneshot(model, _batches(), method="wanda", masks="bake", scratch_dir=tmp_path)
    except RuntimeError:
        assert fail
        assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert len(files) == (2 if fail else 3)
    assert all(f.closed for f in files)
