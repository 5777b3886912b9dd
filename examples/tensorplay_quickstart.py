"""prunekit on TensorPlay: the documented example, written for `tensorplay.nn` modules.

The same calls as the PyTorch quickstart; only the framework import changes.
Run with `make demo` (or `python examples/tensorplay_quickstart.py` inside the
virtualenv, with the `tensorplay` extra installed).
"""

import io

import tensorplay as tp

from prunekit import global_unstructured, is_pruned, l1_unstructured, ln_structured, L1Unstructured, remove


def zeros(t) -> str:
    return f"{int((t == 0).sum())}/{t.numel()} zeros ({100.0 * float((t == 0).sum()) / t.numel():.1f}%)"


tp.manual_seed(0)

# 1. The documented example -------------------------------------------------
print("1. The documented example: tp.nn.Linear(64, 32, bias=False)")
model = tp.nn.Linear(64, 32, bias=False)
l1_unstructured(model, name="weight", amount=0.3)
print(f"   after l1_unstructured(amount=0.3):  weight_mask has {zeros(model.weight_mask)}")
ln_structured(model, name="weight", amount=0.1, n=2, dim=0)
rows_gone = int((model.weight_mask.sum(dim=1) == 0).sum())
print(f"   after ln_structured(amount=0.1, n=2, dim=0): {rows_gone} of 32 output rows removed, "
      f"weight_mask has {zeros(model.weight_mask)}")
print(f"   is_pruned(model) = {is_pruned(model)}")
print(f"   type(model.weight_mask) = {type(model.weight_mask).__module__}.{type(model.weight_mask).__name__}, "
      f"dtype {model.weight_mask.dtype}")
print(f"   parameters: {[n for n, _ in model.named_parameters()]}, buffers: {[n for n, _ in model.named_buffers()]}")
print(f"   model.weight_mask[:2, :8] =\n{model.weight_mask[:2, :8]}")

# 2. A small network: global pruning, training, checkpoint, remove ----------
print("\n2. A small MLP: global_unstructured(amount=0.5), train 30 steps, save/load, remove")
net = tp.nn.Sequential(tp.nn.Linear(16, 16), tp.nn.ReLU(), tp.nn.Linear(16, 4))
global_unstructured([(net[0], "weight"), (net[2], "weight")], pruning_method=L1Unstructured, amount=0.5)
for i in (0, 2):
    print(f"   net[{i}].weight: {zeros(net[i].weight)}")
opt = tp.optim.SGD(net.parameters(), lr=0.05)
x, y = tp.randn(64, 16), tp.randn(64, 4)
for step in range(30):
    opt.zero_grad()
    loss = ((net(x) - y) ** 2).mean()
    loss.backward()
    opt.step()
    if step in (0, 29):
        print(f"   step {step:2d}: loss {float(loss.item()):.4f}")
print(f"   after training, net[0].weight: {zeros(net[0].weight)} (pruned entries stay zero)")

buf = io.BytesIO()
tp.save(net.state_dict(), buf)
buf.seek(0)
print(f"   tp.save/tp.load state dict keys: {sorted(tp.load(buf))}")
for i in (0, 2):
    remove(net[i], "weight")
print(f"   after remove: is_pruned(net) = {is_pruned(net)}, net[0].weight: {zeros(net[0].weight)}, "
      f"parameters: {[n for n, _ in net.named_parameters()]}")
