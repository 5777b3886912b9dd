"""Saving pruned Hugging Face models: plain folders that plain transformers loads pruned, masks beside them."""

import json
import os

import pytest
import torch
from torch import nn

import prunekit

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")

MASKS = "prunekit_masks.safetensors"


def _bert(seed=0):
    cfg = transformers.BertConfig(vocab_size=40, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=32, max_position_embeddings=16, num_labels=2)
    torch.manual_seed(seed)
    return transformers.BertForSequenceClassification(cfg).eval()


def _prune(model):
    """Three kinds of masks: unstructured (values kept under the mask), structured, and on a bias."""
    layer = model.bert.encoder.layer
    prunekit.l1_unstructured(layer[0].attention.self.query, "weight", 0.5)
    prunekit.ln_structured(layer[1].intermediate.dense, "weight", 0.25, n=2, dim=0)
    nn.init.uniform_(model.classifier.bias, 0.1, 1.0)  # BERT initialises biases to zero
    prunekit.random_unstructured(model.classifier, "bias", 1)
    return ["bert.encoder.layer.0.attention.self.query.weight", "bert.encoder.layer.1.intermediate.dense.weight",
            "classifier.bias"]


def _ids():
    return torch.randint(0, 40, (2, 8), generator=torch.Generator().manual_seed(1))


def _out(model):
    with torch.no_grad():
        return model(input_ids=_ids()).logits


def test_save_pretrained_writes_the_pruned_values_that_plain_from_pretrained_loads(tmp_path):
    model = _bert()
    paths = _prune(model)
    keys_before = list(model.state_dict())
    model.save_pretrained(tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["config.json", "model.safetensors", MASKS]
    plain = transformers.BertForSequenceClassification.from_pretrained(tmp_path).eval()  # no prunekit call
    assert not prunekit.is_pruned(plain)
    for path in paths:
        module, name = prunekit.reparam.owner_of(model, path)
        loaded = plain.get_parameter(path)
        assert torch.equal(loaded, getattr(module, name).detach()), path
        assert int((loaded == 0).sum()) == int((getattr(module, name + "_mask") == 0).sum()) > 0, path
    assert torch.equal(_out(plain), _out(model))
    # the model's own state dict keeps torch's layout
    assert list(model.state_dict()) == keys_before and "classifier.bias_orig" in keys_before


def test_load_pretrained_gives_the_pruned_model_back(tmp_path):
    model = _bert()
    paths = _prune(model)
    model.save_pretrained(tmp_path)
    again = prunekit.load_pretrained(tmp_path)
    assert type(again) is type(model) or type(again).__name__ == type(model).__name__
    for path in paths:
        module, name = prunekit.reparam.owner_of(model, path)
        other, _ = prunekit.reparam.owner_of(again, path)
        assert torch.equal(getattr(other, name + "_mask"), getattr(module, name + "_mask")), path
        assert getattr(other, name + "_mask").dtype == getattr(module, name + "_mask").dtype
        assert torch.equal(getattr(other, name), getattr(module, name).detach()), path
    assert sorted(again.state_dict()) == sorted(model.state_dict())
    assert torch.equal(_out(again), _out(model))
    # restoring again into a pruned model replaces the masks in place: the same buffers
    buffer = again.classifier.bias_mask
    assert prunekit.restore_masks(again, tmp_path) == 3 and again.classifier.bias_mask is buffer


def test_a_scaling_mask_and_its_weight_orig_come_back_exactly(tmp_path):
    model = _bert()
    dense = model.bert.pooler.dense
    scale = torch.rand(dense.weight.shape, generator=torch.Generator().manual_seed(2))
    scale[scale < 0.3] = 0
    prunekit.custom_from_mask(dense, "weight", scale)
    model.save_pretrained(tmp_path)
    plain = transformers.BertForSequenceClassification.from_pretrained(tmp_path)
    assert torch.equal(plain.bert.pooler.dense.weight, dense.weight.detach())
    again = prunekit.load_pretrained(tmp_path, transformers.BertForSequenceClassification)
    assert torch.equal(again.bert.pooler.dense.weight_orig, dense.weight_orig)
    assert torch.equal(again.bert.pooler.dense.weight_mask, dense.weight_mask)


def test_saving_an_unpruned_model_removes_a_stale_masks_file(tmp_path):
    model = _bert()
    _prune(model)
    model.save_pretrained(tmp_path)
    assert prunekit.remove_all(model) == 3
    model.save_pretrained(tmp_path)  # same folder, no masks now
    assert sorted(os.listdir(tmp_path)) == ["config.json", "model.safetensors"]
    assert prunekit.restore_masks(transformers.BertForSequenceClassification.from_pretrained(tmp_path), tmp_path) == 0


def test_a_failed_save_leaves_the_folder_masks_as_they_were(tmp_path, monkeypatch):
    model = _bert()
    _prune(model)
    model.save_pretrained(tmp_path)
    before = {f: (tmp_path / f).read_bytes() for f in os.listdir(tmp_path)}
    prunekit.l1_unstructured(model.bert.pooler.dense, "weight", 0.5)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt("interrupted while writing the weights")

    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", interrupted)
    with pytest.raises(KeyboardInterrupt):
        model.save_pretrained(tmp_path)
    assert sorted(os.listdir(tmp_path)) == sorted(before)  # no temporary file left behind
    assert (tmp_path / MASKS).read_bytes() == before[MASKS]


def test_a_given_state_dict_is_written_dense_too(tmp_path):
    # accelerate's way: unwrap_model(model).save_pretrained(folder, state_dict=accelerator.get_state_dict(model))
    model = _bert()
    _prune(model)
    model.save_pretrained(tmp_path, state_dict=model.state_dict())
    plain = transformers.BertForSequenceClassification.from_pretrained(tmp_path).eval()
    assert torch.equal(_out(plain), _out(model))
    assert prunekit.restore_masks(plain, tmp_path) == 3


def test_a_merged_lora_model_saves_its_merged_pruned_weights(tmp_path):
    peft = pytest.importorskip("peft")
    from prunekit.compat.peft import mask_lora_updates

    model = _bert()
    query = model.bert.encoder.layer[0].attention.self.query
    prunekit.l1_unstructured(query, "weight", 0.5)
    lora = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["query"], init_lora_weights=False))
    mask_lora_updates(lora)
    merged = lora.merge_and_unload()
    merged.save_pretrained(tmp_path)
    plain = transformers.BertForSequenceClassification.from_pretrained(tmp_path)
    loaded = plain.bert.encoder.layer[0].attention.self.query.weight
    assert torch.equal(loaded, query.weight.detach()) and int((loaded == 0).sum()) == query.weight.numel() // 2


def test_trainer_save_model_writes_a_plain_folder(tmp_path):
    pytest.importorskip("accelerate")
    model = _bert()
    _prune(model)
    args = transformers.TrainingArguments(output_dir=str(tmp_path / "run"), use_cpu=True, report_to=[])
    transformers.Trainer(model=model, args=args).save_model(str(tmp_path / "final"))
    plain = transformers.BertForSequenceClassification.from_pretrained(tmp_path / "final").eval()
    assert torch.equal(_out(plain), _out(model))
    assert prunekit.restore_masks(plain, tmp_path / "final") == 3


# ----------------------------------------------------------------------------- the masks file is hostile input
def _saved(tmp_path):
    model = _bert()
    _prune(model)
    model.save_pretrained(tmp_path)
    return transformers.BertForSequenceClassification.from_pretrained(tmp_path)


def _rewrite(path, change_tensors=None, change_meta=None):
    from safetensors.torch import load_file, save_file
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
    tensors = load_file(str(path))
    if change_tensors:
        change_tensors(tensors)
    if change_meta:
        entries = json.loads(meta["masks"])
        change_meta(meta, entries)
        meta["masks"] = json.dumps(entries)
    save_file(tensors, str(path), metadata=meta)


QUERY = "bert.encoder.layer.0.attention.self.query.weight"


@pytest.mark.parametrize("change_tensors,change_meta,message", [
    (None, lambda m, e: m.update(format="other"), "not a prunekit masks file"),
    (None, lambda m, e: m.update(version="9"), "version '9' is not supported"),
    (None, lambda m, e: e[QUERY].update(shape=[16, 8]), "mask of shape [16, 8] for the model's tensor of shape [16, 16]"),
    (None, lambda m, e: e.__setitem__("bert.nowhere.weight", e.pop(QUERY)), "has no parameter 'bert.nowhere.weight'"),
    (None, lambda m, e: e[QUERY].update(weight_zeros=-1), "bad weight_dtype"),
    (None, lambda m, e: e[QUERY].update(extra=1), "must hold exactly"),
    (lambda t: t.__setitem__(QUERY + "_mask", t[QUERY + "_mask"][:-1].clone()), None, "expected U8 [32]"),
    (lambda t: t.__setitem__("stray", torch.zeros(1)), None, "not described by its metadata"),
    (lambda t: t.__setitem__("classifier.bias_mask", t["classifier.bias_mask"] | 0x80), None, "padding bits"),
])
def test_a_damaged_masks_file_is_refused_and_changes_nothing(tmp_path, change_tensors, change_meta, message):
    plain = _saved(tmp_path)
    _rewrite(tmp_path / MASKS, change_tensors, change_meta)
    before = {k: v.clone() for k, v in plain.state_dict().items()}
    with pytest.raises(ValueError) as err:
        prunekit.restore_masks(plain, tmp_path)
    assert str(err.value).startswith(str(tmp_path / MASKS)) and message in str(err.value)
    assert not prunekit.is_pruned(plain)
    assert all(torch.equal(v, before[k]) for k, v in plain.state_dict().items())


def test_masks_that_do_not_belong_to_the_weights_are_refused(tmp_path):
    plain = _saved(tmp_path)
    with torch.no_grad():  # weights trained on after the save: non-zero where the mask prunes
        plain.bert.encoder.layer[0].attention.self.query.weight.add_(1.0)
    with pytest.raises(ValueError, match="non-zero entries where the saved mask prunes it"):
        prunekit.restore_masks(plain, tmp_path)
    assert not prunekit.is_pruned(plain)


def test_a_masks_file_that_is_not_a_regular_file_is_refused(tmp_path):
    plain = _saved(tmp_path)
    os.remove(tmp_path / MASKS)
    os.mkfifo(tmp_path / MASKS)
    with pytest.raises(ValueError, match="not a regular file"):
        prunekit.restore_masks(plain, tmp_path)


# ----------------------------------------------------------------------------- remove_all
def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))


def test_remove_all_bakes_every_mask_like_remove():
    import torch.nn.utils.prune as tprune

    net, ref = _net(), _net()
    for m in (net, ref):
        torch.manual_seed(3)
        prunekit.l1_unstructured(m[0], "weight", 12)
        prunekit.random_unstructured(m[0], "bias", 2)
    tprune.l1_unstructured(net[2], "weight", 4)  # torch's own pruning too
    tprune.l1_unstructured(ref[2], "weight", 4)
    params = {n: p for n, p in net.named_parameters()}
    assert prunekit.remove_all(net) == 3
    prunekit.remove(ref[0], "weight")
    prunekit.remove(ref[0], "bias")
    tprune.remove(ref[2], "weight")
    assert not prunekit.is_pruned(net) and sorted(net.state_dict()) == ["0.bias", "0.weight", "2.bias", "2.weight"]
    for k, v in ref.state_dict().items():
        assert torch.equal(net.state_dict()[k], v), k
    assert net[0].weight is params["0.weight_orig"]  # the same Parameter: optimizers keep working
    assert prunekit.remove_all(net) == 0


@pytest.mark.parametrize("fail_at", [0, 1, 2])
@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_remove_all_is_all_or_nothing(monkeypatch, fail_at, error):
    import torch.nn.utils.prune as tprune

    net = _net()
    prunekit.l1_unstructured(net[0], "weight", 12)
    prunekit.random_unstructured(net[0], "bias", 2)
    tprune.l1_unstructured(net[2], "weight", 4)
    before = {k: v.clone() for k, v in net.state_dict().items()}
    classes = [type(m) for m in net]
    hooks = [dict(m._forward_pre_hooks) for m in net]
    params = [dict(m._parameters) for m in net]
    unmask, calls = prunekit.reparam.unmask, []

    def failing(module, name, *, bake=True):
        calls.append(name)
        if len(calls) > fail_at:
            unmask(module, name, bake=bake)  # done, then interrupted before the call returns
            raise error("injected")
        return unmask(module, name, bake=bake)

    monkeypatch.setattr(prunekit.reparam, "unmask", failing)
    with pytest.raises(error):
        prunekit.remove_all(net)
    assert len(calls) == fail_at + 1
    after = net.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in after)
    assert [type(m) for m in net] == classes and [dict(m._forward_pre_hooks) for m in net] == hooks
    assert [dict(m._parameters) for m in net] == params
    monkeypatch.undo()
    assert prunekit.remove_all(net) == 3


def test_remove_all_refuses_what_is_not_a_module():
    with pytest.raises(TypeError, match="remove_all\\(\\) needs an nn.Module, got dict"):
        prunekit.remove_all({})


# ----------------------------------------------------------------------------- neighbours that write files
def test_safetensors_save_model_keeps_the_torch_layout_and_a_dense_load_is_not_silent(tmp_path):
    from safetensors.torch import load_model, save_model

    net = _net()
    prunekit.l1_unstructured(net[0], "weight", 12)
    save_model(net, str(tmp_path / "m.safetensors"))
    with pytest.raises(RuntimeError, match="Missing key"):
        load_model(_net(), str(tmp_path / "m.safetensors"))  # strict by default: refuses, nothing silent
    dense = _net()
    from safetensors.torch import load_file

    prunekit.load_state_dict(dense, load_file(str(tmp_path / "m.safetensors")))
    assert torch.equal(dense[0].weight, net[0].weight)
