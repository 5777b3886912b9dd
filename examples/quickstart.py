"""prunekit quickstart: the documented example, then a small conv net pruned per layer and globally.

Run with `make demo` (or `python examples/quickstart.py` inside the virtualenv).
"""

import torch
from torch import nn

import prunekit as prune  # drop-in for `import torch.nn.utils.prune as prune`


def sparsity(t: torch.Tensor) -> str:
    return f"{100.0 * float((t == 0).sum()) / t.numel():5.1f}% zeros"


def report(model: nn.Module, title: str) -> None:
    print(f"\n{title}")
    for name, module in model.named_modules():
        for pname in ("weight", "bias"):
            t = getattr(module, pname, None)
            if isinstance(t, torch.Tensor) and name:
                state = "pruned" if hasattr(module, pname + "_mask") else "dense "
                print(f"  {name + '.' + pname:<16} {str(list(t.shape)):<16} {state}  {sparsity(t)}")


torch.manual_seed(0)

# 1. The documented example -------------------------------------------------
print("1. The documented example: Linear(64, 32, bias=False)")
model = nn.Linear(64, 32, bias=False)
prune.l1_unstructured(model, name="weight", amount=0.3)
print(f"  l1_unstructured(amount=0.3): {int((model.weight_mask == 0).sum())} of {model.weight.numel()} "
      f"weights pruned ({sparsity(model.weight)})")
prune.ln_structured(model, name="weight", amount=0.1, n=2, dim=0)
rows = int((model.weight_mask.sum(dim=1) == 0).sum())
print(f"  ln_structured(amount=0.1, n=2, dim=0): {rows} of 32 output rows removed entirely "
      f"({sparsity(model.weight)} in all)")
print(f"  is_pruned(model) = {prune.is_pruned(model)}")
print(f"  the mask is a buffer: weight_mask {tuple(model.weight_mask.shape)} {model.weight_mask.dtype}, "
      f"first row: {model.weight_mask[0, :12].int().tolist()} ...")
print(f"  the original weights stay trainable as weight_orig (a Parameter): "
      f"{[n for n, _ in model.named_parameters()]}")

# 2. A small conv net, per layer ----------------------------------------------
net = nn.Sequential(
    nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(),
    nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(),
    nn.AdaptiveAvgPool2d(1), nn.Flatten(),
    nn.Linear(16, 10),
)
x = torch.randn(4, 1, 8, 8)
prune.l1_unstructured(net[0], "weight", amount=0.5)
prune.ln_structured(net[2], "weight", amount=0.25, n=2, dim=0)  # 4 of 16 filters
prune.random_unstructured(net[6], "weight", amount=0.2)
report(net, "2. A small conv net, pruned layer by layer (50% L1, 25% of filters by L2 norm, 20% random):")
print(f"  the forward pass runs as usual: output {tuple(net(x).shape)}")

# 3. Globally ----------------------------------------------------------------
torch.manual_seed(0)
net2 = nn.Sequential(
    nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(),
    nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(),
    nn.AdaptiveAvgPool2d(1), nn.Flatten(),
    nn.Linear(16, 10),
)
params = [(net2[0], "weight"), (net2[2], "weight"), (net2[6], "weight")]
prune.global_unstructured(params, pruning_method=prune.L1Unstructured, amount=0.6)
total = sum(m.weight.numel() for m, _ in params)
zeros = sum(int((m.weight == 0).sum()) for m, _ in params)
report(net2, f"3. The same net pruned globally, 60% of all conv/linear weights at once "
             f"({zeros} of {total}); each layer gets what its magnitudes deserve:")

# 4. remove: make it permanent ----------------------------------------------------
for module, name in params:
    prune.remove(module, name)
print("\n4. remove() bakes the masks in: the model is a plain nn.Module again")
print(f"  is_pruned = {prune.is_pruned(net2)}, parameters: {[n for n, _ in net2.named_parameters()][:4]} ...")
print(f"  zeros kept: {sum(int((m.weight == 0).sum()) for m, _ in params)} of {total}")
