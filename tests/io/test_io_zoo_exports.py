"""Exports of 2:4-pruned transformers families with tied embeddings (and GPT-2's Conv1D), loaded back.

Each family of ``shrink_models.ZOO`` below ties ``lm_head`` to its input embedding; Gemma's and OPT's
embeddings carry a zero padding row, so the tied head has zeros without being 2:4. One-shot prunes
every Linear (or Conv1D) of the blocks 2:4; every exporter must keep those 2:4, store the tied tensor
once, and load back to the same outputs.
"""

from __future__ import annotations

import json
import os
import struct

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")
from compressed_tensors.compressors import ModelCompressor  # noqa: E402

import prunekit  # noqa: E402
from helpers import shrink_models as S  # noqa: E402
from prunekit.io import load_compressed, read_checkpoint  # noqa: E402
from prunekit.io.checkpoint import read_plain_safetensors, read_torch, write_torch  # noqa: E402
from prunekit.io.compressed_tensors import read_compressed_tensors  # noqa: E402
from prunekit.io.layers import fits_n_m, linear_layers  # noqa: E402
from prunekit.io.plain import TIED_KEY, write_safetensors  # noqa: E402

pytestmark = pytest.mark.hf

FAMILIES = ["gemma", "gemma2", "gemma3_text", "opt", "starcoder2", "cohere", "gpt2"]


def _header(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        return json.loads(f.read(n))


def _tie(model):
    """(the name kept, the tied name) of the model's one tie: the input embedding and ``lm_head``."""
    (tied, kept), = model.all_tied_weights_keys.items()
    assert model.get_parameter(tied) is model.get_parameter(kept)
    return kept, tied


@pytest.fixture(scope="module", params=FAMILIES)
def pruned(request):
    family = request.param
    model = S.build_zoo(family)
    batch = S.zoo_batch(family)
    report = prunekit.oneshot(model, [batch], pattern="2:4", method="magnitude")
    layers = linear_layers(model)
    names = [r.name for r in report.layers]
    assert names and all(n in layers for n in names)
    for n in names:  # the setup: each pruned weight is 2:4 along its inputs (a Conv1D's axis 0)
        w = model.get_submodule(n).weight
        assert fits_n_m(w, layers[n]) and int((w == 0).sum()) >= w.numel() // 2, n
    if family == "gpt2":
        assert all(layers[n] == 0 for n in names)
    return family, model, batch, names, S.output(model, batch)


def _fresh(family, seed):
    return S.build_zoo(family, seed=seed)


def test_compressed_tensors_keeps_2_4_per_tensor_and_the_tie_once(pruned, tmp_path):
    family, model, batch, names, expected = pruned
    kept, tied = _tie(model)
    layers = linear_layers(model)
    folder = str(tmp_path / "ct")
    sc = prunekit.save_compressed(model, folder, format="compressed-tensors")
    conv1d = family == "gpt2"  # compressed-tensors' 2:4 layout groups a stored row: a Conv1D's outputs
    assert sc["format"] == ("sparse-bitmask" if conv1d else "sparse-24-bitmask")
    assert sc["targets"] == (["Conv1D"] if conv1d else ["Linear"])
    assert sc["ignore"] == [n for n in layers if n not in names]
    assert tied.rsplit(".", 1)[0] in sc["ignore"]
    stored = set(_header(os.path.join(folder, "model.safetensors"))) - {"__metadata__"}
    parts = {"shape", "compressed", "bitmask"} | ({"row_offsets"} if conv1d else set())
    for n in layers:
        if n in names:
            assert {f"{n}.{p}" for p in parts} <= stored and f"{n}.weight" not in stored, n
            assert (f"{n}.row_offsets" in stored) == conv1d
        elif n + ".weight" != tied:
            assert f"{n}.weight" in stored and f"{n}.bitmask" not in stored, n
    assert kept in stored and tied not in stored  # the tied tensor once, under the name transformers keeps

    # prunekit's reader: the stored tensors; loaded into a model, the tie gives lm_head back
    sd = read_compressed_tensors(folder)
    for n in names:
        assert fits_n_m(sd[n + ".weight"], layers[n]) and torch.equal(sd[n + ".weight"], model.get_submodule(n).weight)
    loaded = _fresh(family, 1)
    result = prunekit.load_state_dict(loaded, sd, strict=False)
    assert list(result.missing_keys) == [tied] and not result.unexpected_keys
    assert torch.equal(S.output(loaded, batch), expected)

    # compressed-tensors' own decompressor (it replaces each parameter it loads: tie again after it)
    other = _fresh(family, 2)
    ModelCompressor.from_pretrained(folder).decompress(folder, other)
    other.tie_weights()
    assert torch.equal(S.output(other, batch), expected)


def test_prunekit_format_stores_the_tie_once_and_loads_it_tied(pruned, tmp_path):
    family, model, batch, names, expected = pruned
    kept, tied = _tie(model)
    path = str(tmp_path / "m.safetensors")
    prunekit.save_compressed(model, path, drop_masked_values=True)
    header = _header(path)
    index = json.loads(header["__metadata__"]["prunekit.index"])["tensors"]
    aliases = [e for e in index if e["encoding"] == "alias"]
    assert aliases == [{"name": tied, "encoding": "alias", "of": kept}]
    assert kept in header and not any(k.startswith(tied) for k in header)
    encodings = {e["name"]: e["encoding"] for e in index}
    for n in names:  # per tensor: the mask as a bitmask alone, the kept weights as bitmask + values
        assert encodings[n + ".weight_mask"] == "binary" and encodings[n + ".weight_orig"] == "sparse", n
    sd = load_compressed(path)
    assert list(sd) == list(model.state_dict()) and sd[tied] is sd[kept]
    loaded = _fresh(family, 1)
    prunekit.load_state_dict(loaded, sd)  # strict: every key, the tied one included
    assert prunekit.is_pruned(loaded) and _tie(loaded)
    layers = linear_layers(loaded)
    assert all(fits_n_m(loaded.get_submodule(n).weight, layers[n]) for n in names)
    assert torch.equal(S.output(loaded, batch), expected)
    read, kind = read_checkpoint(path)
    assert kind == "prunekit-compressed" and read[tied] is read[kept]


def test_plain_safetensors_loads_in_plain_transformers(pruned, tmp_path):
    family, model, batch, names, expected = pruned
    kept, tied = _tie(model)
    folder = tmp_path / "plain"
    folder.mkdir()
    model.config.save_pretrained(str(folder))
    dense = prunekit.dense_state_dict(model)
    write_safetensors(dense, str(folder / "model.safetensors"), metadata={"format": "pt"})
    header = _header(str(folder / "model.safetensors"))
    assert kept in header and tied not in header
    assert json.loads(header["__metadata__"][TIED_KEY]) == {tied: kept}
    sd = read_plain_safetensors(str(folder / "model.safetensors"))
    assert sorted(sd) == sorted(dense) and sd[tied] is sd[kept]  # safetensors sorts its names
    loaded = type(model).from_pretrained(str(folder)).eval()
    _tie(loaded)
    layers = linear_layers(loaded)
    assert all(fits_n_m(loaded.get_submodule(n).weight, layers[n]) for n in names)
    assert torch.equal(S.output(loaded, batch), expected)
    # a torch.save checkpoint keeps the tie as torch does: one storage
    write_torch(dense, str(tmp_path / "m.pt"))
    sd = read_torch(str(tmp_path / "m.pt"))
    assert sd[tied].data_ptr() == sd[kept].data_ptr()


def test_gpt2_conv1d_refuses_a_2_4_folder_it_cannot_express(tmp_path):
    model = S.build_zoo("gpt2")
    prunekit.oneshot(model, [S.zoo_batch("gpt2")], pattern="2:4", method="magnitude")
    with pytest.raises(ValueError, match=r"'transformer\.h\.0\.attn\.c_attn' \(a Conv1D: compressed-tensors' 2:4 "
                                         r"layout groups its outputs\) does not have the 2:4 pattern"):
        prunekit.save_compressed(model, str(tmp_path / "ct"), format="compressed-tensors", sparsity_structure="2:4")
    assert not os.listdir(tmp_path)


def test_a_head_pruned_apart_from_its_embedding_is_exported_untied(tmp_path):
    model = S.build_zoo("gemma")
    batch = S.zoo_batch("gemma")
    prunekit.oneshot(model, [batch], pattern="2:4", method="magnitude")
    w = model.lm_head.weight.detach()
    keep = w.abs().reshape(-1, 4).topk(2, dim=1).indices
    prunekit.custom_from_mask(model.lm_head, "weight",
                              torch.zeros(w.numel() // 4, 4).scatter_(1, keep, 1.0).reshape(w.shape))
    expected = S.output(model, batch)
    folder = str(tmp_path / "ct")
    sc = prunekit.save_compressed(model, folder, format="compressed-tensors")
    assert sc["format"] == "sparse-24-bitmask" and "lm_head" not in sc["ignore"]
    assert json.load(open(os.path.join(folder, "config.json")))["tie_word_embeddings"] is False
    assert model.config.tie_word_embeddings is True  # the model's own config is left alone
    loaded = type(model)(transformers.AutoConfig.from_pretrained(folder)).eval()
    assert loaded.lm_head.weight is not loaded.model.embed_tokens.weight
    ModelCompressor.from_pretrained(folder).decompress(folder, loaded)
    assert torch.equal(S.output(loaded, batch), expected)


@pytest.mark.zoo
@pytest.mark.parametrize("family", sorted(S.ZOO))
def test_every_family_exports_its_2_4_layers_as_2_4_and_loads_back(family, tmp_path, record_property):
    model = S.build_zoo(family)
    batch = S.zoo_batch(family)
    report = prunekit.oneshot(model, [batch], pattern="2:4", method="magnitude")
    expected, dense = S.output(model, batch), prunekit.dense_state_dict(model)
    layers = linear_layers(model)
    pruned = [r.name for r in report.layers if r.name in layers]
    experts = sorted({r.name.rsplit(".", 1)[0] for r in report.layers if r.name not in layers})
    assert pruned and all(fits_n_m(model.get_submodule(n).weight, layers[n]) for n in pruned)

    folder = str(tmp_path / "ct")
    sc = prunekit.save_compressed(model, folder, format="compressed-tensors")
    conv1d = family == "gpt2"
    assert sc["format"] == ("sparse-bitmask" if conv1d else "sparse-24-bitmask")
    stored = set(_header(os.path.join(folder, "model.safetensors"))) - {"__metadata__"}
    assert all(f"{n}.bitmask" in stored and f"{n}.weight" not in stored for n in pruned)
    assert all(e in stored for e in experts)  # 3-D expert tensors: compressed-tensors compresses modules' weights
    other = _fresh(family, 2)
    ModelCompressor.from_pretrained(folder).decompress(folder, other)
    other.tie_weights()
    got = other.state_dict()
    assert all(torch.equal(got[k], v) for k, v in dense.items() if k in got)
    # the same tensors; grouped experts may sum in another order once the loaded tensors' strides differ
    torch.testing.assert_close(S.output(other, batch), expected, rtol=0, atol=1e-6)

    path = str(tmp_path / "m.safetensors")
    prunekit.save_compressed(model, path, drop_masked_values=True)
    loaded = _fresh(family, 1)
    prunekit.load_state_dict(loaded, load_compressed(path))
    assert torch.equal(S.output(loaded, batch), expected)
    record_property("outcome", sc["format"])
    record_property("reason", f"{len(pruned)} layers 2:4" + (f"; {len(experts)} 3-D expert tensors 2:4, stored dense "
                                                              "in compressed-tensors (it compresses Linear modules)"
                                                              if experts else "")
                    + ("; Conv1D stores its inputs along rows, so the 2:4 groups are not rows: a bitmask"
                       if conv1d else ""))
