import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # the Trainer needs it

from prunekit.training.hf import PruningTrainerCallback  # noqa: E402


class _Data(torch.utils.data.Dataset):
    def __init__(self, n=32):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, 50, (n, 8), generator=g)
        self.labels = (self.ids[:, 0] % 2).long()

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "attention_mask": torch.ones(8, dtype=torch.long), "labels": self.labels[i]}


def test_trainer_callback_prunes_tiny_bert_to_target(tmp_path):
    cfg = transformers.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                  intermediate_size=32, max_position_embeddings=16, num_labels=2)
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(cfg)  # built from a config: no download
    cb = PruningTrainerCallback({"prune_type": "snip_momentum", "pattern": "1x1", "target_sparsity": 0.5,
                                 "end_step": 4, "update_frequency_on_step": 2, "names": ["encoder"]})
    args = transformers.TrainingArguments(output_dir=str(tmp_path), max_steps=6, per_device_train_batch_size=8,
                                          use_cpu=True, report_to=[], save_strategy="no", logging_strategy="no",
                                          disable_tqdm=True)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=_Data(), callbacks=[cb])
    trainer.train()
    pruning = cb.pruning
    assert pruning.global_step == 6 and not pruning.wired
    layers = [n for p in pruning.pruners for n in p.modules]
    assert layers and all("encoder" in n for n in layers)
    zeros = sum(int((m.weight_mask == 0).sum()) for p in pruning.pruners for m in p.modules.values())
    total = sum(m.weight_mask.numel() for p in pruning.pruners for m in p.modules.values())
    assert zeros == round(0.5 * total)
    for p in pruning.pruners:
        for m in p.modules.values():
            assert torch.all(m.weight_orig[m.weight_mask == 0] == 0)


class _StopAt(transformers.TrainerCallback):
    """Ends the run right after the checkpoint of step ``step`` is written (a crash, as far as training goes)."""

    def __init__(self, step):
        self.step = step

    def on_save(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            raise KeyboardInterrupt("stopped after the checkpoint")


def _bert(seed=0):
    cfg = transformers.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=32, max_position_embeddings=16, num_labels=2)
    torch.manual_seed(seed)
    return transformers.BertForSequenceClassification(cfg)  # built from a config: no download


def _trainer(tmp_path, model, callbacks, restore=False):
    args = transformers.TrainingArguments(output_dir=str(tmp_path), max_steps=8, per_device_train_batch_size=4,
                                          use_cpu=True, report_to=[], save_strategy="steps", save_steps=3,
                                          logging_strategy="no", disable_tqdm=True, seed=0, data_seed=0,
                                          restore_callback_states_from_checkpoint=restore,
                                          optim="adamw_torch", learning_rate=1e-2)
    return transformers.Trainer(model=model, args=args, train_dataset=_Data(), callbacks=callbacks)


# snip_momentum (scores accumulated at every step) through a 4x1 schedule that is mid-way at step 3
_RESUME_CONFIG = {"prune_type": "snip_momentum", "pattern": "4x1", "target_sparsity": 0.75, "start_step": 1,
                  "end_step": 6, "names": ["encoder"], "sparsity_decay_type": "cube"}


@pytest.mark.parametrize("restore", [False, True], ids=["plain-resume", "restore_callback_states"])
def test_resumed_trainer_continues_the_schedule_and_ends_with_the_same_masks(tmp_path, restore):
    # reference: one uninterrupted run
    reference_model = _bert()
    _trainer(tmp_path / "a", reference_model, [PruningTrainerCallback(_RESUME_CONFIG)]).train()
    reference = {k: v.clone() for k, v in reference_model.state_dict().items()}
    masks = [k for k in reference if k.endswith("weight_mask")]
    assert masks and all(".encoder." in k for k in masks)
    # a run stopped right after the checkpoint of step 3 (mid-schedule)...
    first = _bert()
    with pytest.raises(KeyboardInterrupt):
        _trainer(tmp_path / "b", first, [PruningTrainerCallback(_RESUME_CONFIG), _StopAt(3)]).train()
    ckpt = tmp_path / "b" / "checkpoint-3"
    assert (ckpt / "prunekit_pruning_scores.safetensors").is_file()
    saved = transformers.TrainerState.load_from_json(str(ckpt / "trainer_state.json"))
    pruner_state = saved.stateful_callbacks["PruningTrainerCallback"]["attributes"]["_resumed_from"]["pruners"][0]
    assert pruner_state["global_step"] == 3 and 0 < pruner_state["current_sparsity_ratio"] < 0.75
    # ...and resumed in a fresh process: a new model, a new callback, the same script
    resumed_model = _bert(seed=1)  # different initial weights: everything must come from the checkpoint
    cb = PruningTrainerCallback(_RESUME_CONFIG)
    _trainer(tmp_path / "b", resumed_model, [cb], restore=restore).train(resume_from_checkpoint=str(ckpt))
    resumed = resumed_model.state_dict()
    assert resumed.keys() == reference.keys()
    for k in masks:
        assert torch.equal(resumed[k], reference[k]), k
    zeros = sum(int((reference[k] == 0).sum()) for k in masks)
    assert zeros == round(0.75 * sum(reference[k].numel() for k in masks) / 4) * 4
    for k in reference:
        assert torch.allclose(resumed[k], reference[k], rtol=1e-5, atol=1e-6), k


def test_resuming_without_the_pruning_callback_state_is_not_silent(tmp_path, caplog):
    first = _bert()
    with pytest.raises(KeyboardInterrupt):
        _trainer(tmp_path, first, [PruningTrainerCallback(_RESUME_CONFIG), _StopAt(3)]).train()
    (tmp_path / "checkpoint-3" / "prunekit_pruning_scores.safetensors").unlink()
    model = _bert()
    _trainer(tmp_path, model, [PruningTrainerCallback(_RESUME_CONFIG)]).train(
        resume_from_checkpoint=str(tmp_path / "checkpoint-3"))
    assert "gradient scores restart from zero" in caplog.text


# ---------------------------------------------------------------- checkpoints are plain Hugging Face folders
def test_a_trainer_checkpoint_loads_pruned_with_plain_from_pretrained(tmp_path):
    model = _bert()
    with pytest.raises(KeyboardInterrupt):
        _trainer(tmp_path, model, [PruningTrainerCallback(_RESUME_CONFIG), _StopAt(3)]).train()
    ckpt = tmp_path / "checkpoint-3"
    assert (ckpt / "prunekit_masks.safetensors").is_file()
    plain = transformers.BertForSequenceClassification.from_pretrained(str(ckpt))  # no prunekit involved
    pruned = {n: m for n, m in model.named_modules() if hasattr(m, "weight_mask")}
    assert pruned
    for name, m in pruned.items():
        loaded = plain.get_submodule(name).weight
        assert torch.equal(loaded, m.weight.detach()), name  # the pruned values, not a random initialisation
        assert int((loaded == 0).sum()) == int((m.weight_mask == 0).sum()) > 0, name


# ---------------------------------------------------------------- a resume checks what it restores
@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """One run stopped right after its checkpoint of step 3 (mid-schedule): the folder to tamper with."""
    out = tmp_path_factory.mktemp("run")
    with pytest.raises(KeyboardInterrupt):
        _trainer(out, _bert(), [PruningTrainerCallback(_RESUME_CONFIG), _StopAt(3)]).train()
    return out / "checkpoint-3"


def _resume_directly(tmp_path, checkpoint, tamper=None):
    """What ``Trainer.train(resume_from_checkpoint=...)`` does up to ``on_train_begin``, without training:
    the callback attaches masks, the checkpoint's weights load with ``strict=False``, the state is read."""
    import shutil

    from safetensors.torch import load_file

    ckpt = tmp_path / "checkpoint-3"
    shutil.copytree(checkpoint, ckpt)
    if tamper is not None:
        tamper(ckpt)
    model = _bert(seed=1)
    args = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    control = transformers.TrainerControl()
    cb = PruningTrainerCallback(_RESUME_CONFIG)
    cb.on_init_end(args, transformers.TrainerState(), control, model=model)
    result = model.load_state_dict(load_file(str(ckpt / "model.safetensors")), False)
    assert not result.missing_keys and not result.unexpected_keys  # the dense weights land in weight_orig
    state = transformers.TrainerState.load_from_json(str(ckpt / "trainer_state.json"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return cb, model, optimizer, args, state, control


def _resume_tampered(tmp_path, checkpoint, tamper):
    cb, model, optimizer, args, state, control = _resume_directly(tmp_path, checkpoint, tamper)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError) as err:
        cb.on_train_begin(args, state, control, model=model, optimizer=optimizer)
    # nothing changed: the model as the checkpoint load left it, the optimizer without our hooks
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in after)
    assert not cb.pruning.wired and cb.pruning.optimizer is None
    assert not optimizer._optimizer_step_pre_hooks and not optimizer._optimizer_step_post_hooks
    assert all(p.global_step == 0 for p in cb.pruning.pruners)
    return str(err.value)


def test_the_direct_resume_restores_what_the_trainer_resume_does(tmp_path, checkpoint):
    cb, model, optimizer, args, state, control = _resume_directly(tmp_path, checkpoint)
    cb.on_train_begin(args, state, control, model=model, optimizer=optimizer)
    assert cb.pruning.wired and cb.pruning.global_step == 3
    p = cb.pruning.pruners[0]
    assert 0 < p.current_sparsity_ratio < 0.75 and p.scores
    zeros = sum(int((m.weight_mask == 0).sum()) for m in p.modules.values())
    assert zeros > 0 and all(torch.all(m.weight_orig[m.weight_mask == 0] == 0) for m in p.modules.values())


def _edit_pruner_state(field, value):
    import json

    def tamper(ckpt):
        path = ckpt / "trainer_state.json"
        data = json.loads(path.read_text())
        data["stateful_callbacks"]["PruningTrainerCallback"]["attributes"]["_resumed_from"]["pruners"][0][field] = value
        path.write_text(json.dumps(data))

    return tamper


@pytest.mark.parametrize("field,value,message", [
    ("global_step", 1000, "global_step=1000 is outside [0, 3]"),
    ("global_step", 2, "global_step=2 puts the schedule (1..6) at sparsity 0.000000"),
    ("global_step", 1, "scored_step=2 is outside [-1, global_step=1]"),
    ("global_step", "3", "global_step='3' is not an integer"),
    ("global_step", 3.0, "global_step=3.0 is not an integer"),
    ("current_sparsity_ratio", 0.75, "current_sparsity_ratio=0.75 was recorded"),
    ("current_sparsity_ratio", 2.0, "current_sparsity_ratio=2.0 is not a ratio in [0, 1]"),
    ("prune_type", "magnitude", "prune_type='magnitude', but this config's pruner is 'snip_momentum'"),
    ("typo_step", 3, "unknown fields ['typo_step']"),
])
def test_a_tampered_pruner_state_is_refused_and_changes_nothing(tmp_path, checkpoint, field, value, message):
    msg = _resume_tampered(tmp_path, checkpoint, _edit_pruner_state(field, value))
    assert "trainer_state.json: PruningTrainerCallback pruners[0]" in msg and message in msg


def _edit_scores(change):
    from safetensors.torch import load_file, save_file

    def tamper(ckpt):
        path = str(ckpt / "prunekit_pruning_scores.safetensors")
        tensors = load_file(path)
        change(tensors)
        save_file(tensors, path)

    return tamper


def _first(tensors):
    return sorted(tensors)[0]


@pytest.mark.parametrize("change,message", [
    (lambda t: t.__setitem__(_first(t), t[_first(t)].to(torch.int64)), "is I64"),
    (lambda t: t.__setitem__(_first(t), t[_first(t)].double()), "is F64"),
    (lambda t: t.__setitem__(_first(t), t[_first(t)][:1].clone()), "must be torch.float32"),
    (lambda t: t[_first(t)].view(-1).__setitem__(0, float("inf")), "non-finite scores"),
    (lambda t: t[_first(t)].view(-1).__setitem__(0, float("nan")), "non-finite scores"),
    (lambda t: t.__setitem__("7/" + _first(t)[2:], t[_first(t)].clone()), "names pruner '7'"),
    (lambda t: t.__setitem__("0/nowhere", t[_first(t)].clone()), "names layer 'nowhere'"),
    (lambda t: t.pop(_first(t)), "no scores for layers"),
])
def test_tampered_scores_are_refused_and_change_nothing(tmp_path, checkpoint, change, message):
    msg = _resume_tampered(tmp_path, checkpoint, _edit_scores(change))
    assert "prunekit_pruning_scores.safetensors" in msg and message in msg


def test_a_checkpoint_without_its_masks_file_is_refused(tmp_path, checkpoint):
    msg = _resume_tampered(tmp_path, checkpoint, lambda ckpt: (ckpt / "prunekit_masks.safetensors").unlink())
    assert "prunekit_masks.safetensors" in msg and "resume_from_checkpoint" in msg


def test_masks_of_other_weights_are_refused(tmp_path, checkpoint):
    def tamper(ckpt):  # one more zero in a pruned weight: not the weights the masks were saved with
        from safetensors.torch import load_file, save_file

        weights = load_file(str(ckpt / "model.safetensors"))
        key = next(k for k in weights if ".encoder." in k and k.endswith("query.weight"))
        flat = weights[key].view(-1)
        flat[(flat != 0).nonzero()[0]] = 0.0
        save_file(weights, str(ckpt / "model.safetensors"), metadata={"format": "pt"})

    msg = _resume_tampered(tmp_path, checkpoint, tamper)
    assert "prunekit_masks.safetensors" in msg and "zeros, the masks file recorded" in msg


def test_a_failure_while_wiring_undoes_the_restored_state(tmp_path, checkpoint, monkeypatch):
    from prunekit.training.wiring import PruningCallbacks

    wire = PruningCallbacks.wire

    def failing_wire(self, optimizer):
        wire(self, optimizer)  # the hooks are in place...
        raise KeyboardInterrupt("interrupted while wiring")  # ...then the call is interrupted

    monkeypatch.setattr(PruningCallbacks, "wire", failing_wire)
    cb, model, optimizer, args, state, control = _resume_directly(tmp_path, checkpoint)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(KeyboardInterrupt):
        cb.on_train_begin(args, state, control, model=model, optimizer=optimizer)
    after = model.state_dict()
    assert all(torch.equal(after[k], before[k]) for k in after)  # the restored masks rolled back
    assert not cb.pruning.wired and cb.pruning.optimizer is None
    assert not optimizer._optimizer_step_pre_hooks and not optimizer._optimizer_step_post_hooks
    assert all(p.global_step == 0 and not p.optimizers for p in cb.pruning.pruners)


def test_load_best_model_at_end_brings_back_the_best_checkpoints_masks(tmp_path):
    model = _bert()
    args = transformers.TrainingArguments(output_dir=str(tmp_path), max_steps=8, per_device_train_batch_size=4,
                                          use_cpu=True, report_to=[], save_strategy="steps", save_steps=2,
                                          eval_strategy="steps", eval_steps=2, logging_strategy="no",
                                          disable_tqdm=True, load_best_model_at_end=True,
                                          metric_for_best_model="loss", greater_is_better=False,
                                          optim="adamw_torch", learning_rate=1e-2)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=_Data(), eval_dataset=_Data(8),
                                   callbacks=[PruningTrainerCallback(_RESUME_CONFIG)])
    trainer.train()
    best = trainer.state.best_model_checkpoint
    assert best is not None and not best.endswith("checkpoint-8")  # the end of the schedule is not the best
    from prunekit.pretrained import read_masks

    plain = transformers.BertForSequenceClassification.from_pretrained(best)
    saved = {s.path: s.mask for s in read_masks(best, plain)}
    assert saved
    for path, mask in saved.items():
        module = model.get_submodule(path.rsplit(".", 1)[0])
        assert torch.equal(module.weight_mask, mask), path
        assert torch.equal(module.weight.detach(), plain.get_parameter(path)), path
