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
