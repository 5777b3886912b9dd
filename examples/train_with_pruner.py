"""Prune a small CNN to 90 % sparsity while it trains on scikit-learn's digits.

Run: python examples/train_with_pruner.py
"""

import torch
from sklearn.datasets import load_digits
from torch import nn

import prunekit.training as pt

digits = load_digits()
x = torch.tensor(digits.data, dtype=torch.float32).view(-1, 1, 8, 8) / 16.0
y = torch.tensor(digits.target)
x_train, y_train, x_test, y_test = x[:1500], y[:1500], x[1500:], y[1500:]

torch.manual_seed(0)
model = nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 32, 3), nn.ReLU(),
                      nn.Flatten(), nn.Linear(32 * 6 * 6, 10))
opt = torch.optim.Adam(model.parameters(), lr=3e-3)
loss_fn = nn.CrossEntropyLoss()


def epoch():
    for i in range(0, len(y_train), 100):
        opt.zero_grad()
        loss_fn(model(x_train[i:i + 100]), y_train[i:i + 100]).backward()
        opt.step()


def accuracy():
    with torch.no_grad():
        return (model(x_test).argmax(1) == y_test).float().mean().item()


for _ in range(10):
    epoch()
print(f"dense accuracy: {accuracy():.3f}")

# The whole change to the training loop: one call. Every optimizer.step() is now a pruning step.
pruning = pt.prepare_pruning(model, {
    "prune_type": "snip_momentum", "pattern": "1x1", "target_sparsity": 0.9,
    "start_step": 0, "end_step": 100, "update_frequency_on_step": 5, "sparsity_decay_type": "cube",
    "excluded_names": ["^0$"],  # keep the tiny first convolution dense
}, opt)
for _ in range(15):
    epoch()
pruning.unwire()

report = pruning.report()
print(f"sparsity of the pruned layers: {report.elementwise_over_layers:.3f}")
for layer in report.layers:
    print(f"  {layer.name:>3} {str(layer.shape):>18}  {layer.sparsity:.3f}")
print(f"pruned accuracy: {accuracy():.3f}")
