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
