"""Training-aware pruning on real data: scikit-learn's bundled digits, a small CNN.

A CNN is trained dense, then fine-tuned once without pruning (the reference)
and once per pruner x pattern while the pruner prunes it gradually. Prints a
table: dense accuracy, final sparsity, final accuracy, and the median time of
a step that does not update masks against the median plain step, both
measured in this run, interleaved ("ratio": all non-update steps, including
the score accumulation of snip_momentum inside the schedule; "after end": the
steps after end_step, where only the masked forward remains).

Targets (issue 3): 90 % unstructured within 1 point of dense accuracy; 2:4
within 1 point; 80 % 4x1 within 2 points; non-update steps at most 5 % slower.

``--overhead`` measures only the per-step cost of a pruned model against the
same loop on the unpruned one, with SGD-momentum and with Adam, interleaved:
the bare reparameterization (prunekit and torch.nn.utils.prune) and a model
wired to a pruner past its end_step.

Run: python benchmarks/bench_training.py [--quick] [--overhead [--repeats N]]
"""

import argparse
import copy
import os
import statistics
import sys
import time

import torch
import torch.nn.utils.prune as torch_prune
from sklearn.datasets import load_digits
from torch import nn

import prunekit
from prunekit.training import prepare_pruning

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import record_table  # noqa: E402

PATTERNS = [("1x1", 0.9, 1.0), ("2:4", 0.5, 1.0), ("4x1", 0.8, 2.0)]
PRUNERS = ["magnitude", "snip", "snip_momentum", "gradient"]


def data():
    d = load_digits()
    x = torch.tensor(d.data, dtype=torch.float32).view(-1, 1, 8, 8) / 16.0
    y = torch.tensor(d.target)
    g = torch.Generator().manual_seed(0)
    p = torch.randperm(len(y), generator=g)
    return x[p[:1400]], y[p[:1400]], x[p[1400:]], y[p[1400:]]


def cnn():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 64, 3), nn.ReLU(),
                         nn.Flatten(), nn.Linear(64 * 6 * 6, 128), nn.ReLU(), nn.Linear(128, 10))


def accuracy(model, x, y):
    model.eval()
    with torch.no_grad():
        acc = (model(x).argmax(1) == y).float().mean().item()
    model.train()
    return acc


def steps(x, y, n, bs=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    while len(out) < n:
        p = torch.randperm(len(y), generator=g)
        out += [(x[p[i:i + bs]], y[p[i:i + bs]]) for i in range(0, len(y) - bs + 1, bs)]
    return out[:n]


def finetune(model, opt, batches, pruning=None):
    loss_fn = nn.CrossEntropyLoss()
    times = []
    for xb, yb in batches:
        t = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss_fn(model(xb), yb).backward()
        opt.step()
        times.append(time.perf_counter() - t)
    return times


def overhead(quick: bool, repeats: int) -> None:
    """Median step time of pruned variants against the unpruned model, runs interleaved.

    The whole measurement is repeated ``repeats`` times with fresh models (each repeat
    prints its ratios); the last lines give every cell's median over the repeats, so one
    unlucky repeat (a noisy neighbour, an unlucky memory layout) does not make the figure.
    """
    x, y, _, _ = data()
    batches = steps(x, y, 40 if quick else 300, seed=3)
    layers = (2, 5, 7)  # the second conv and both linears, half of each pruned

    def variant(kind, make_opt):
        m = cnn()
        opt = make_opt(m.parameters())
        if kind == "prunekit":
            for i in layers:
                prunekit.l1_unstructured(m[i], "weight", 0.5)
        elif kind == "torch.nn.utils.prune":
            for i in layers:
                torch_prune.l1_unstructured(m[i], "weight", 0.5)
        elif kind == "pruner, after end_step":
            prepare_pruning(m, {"prune_type": "magnitude", "pattern": "1x1", "target_sparsity": 0.5,
                                "start_step": 0, "end_step": 2, "excluded_names": ["^0$"]}, opt)
        return m, opt

    kinds = ["unpruned", "prunekit", "torch.nn.utils.prune", "pruner, after end_step"]
    optimizers = {"SGD-momentum": lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9),
                  "Adam": lambda p: torch.optim.Adam(p, lr=1e-3)}
    print(f"per-step time against the unpruned model ({len(batches)} steps each, interleaved, medians; "
          f"{repeats} repeat(s) with fresh models); load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"{'optimizer':<14}" + "".join(f"{k:>24}" for k in kinds))
    ratios = {name: {k: [] for k in kinds} for name in optimizers}
    for rep in range(repeats):
        for opt_name, make_opt in optimizers.items():
            models = {k: variant(k, make_opt) for k in kinds}
            for k in kinds:  # warm-up (and the pruner's mask updates) outside the timing
                finetune(*models[k], batches[:10])
            times = {k: [] for k in kinds}
            for i in range(0, len(batches), 10):
                for k in kinds:
                    times[k] += finetune(*models[k], batches[i:i + 10])
            base = statistics.median(times["unpruned"])
            for k in kinds:
                ratios[opt_name][k].append(statistics.median(times[k]) / base)
            label = f"{opt_name} #{rep + 1}" if repeats > 1 else opt_name
            print(f"{label:<14}" + "".join(f"{ratios[opt_name][k][-1]:>23.3f}x" for k in kinds))
    summary = []
    for opt_name in optimizers:
        cells = [f"{statistics.median(v):.3f}x ({min(v):.3f}-{max(v):.3f})" for v in ratios[opt_name].values()]
        summary.append([opt_name] + cells)
        if repeats > 1:
            print(f"{opt_name:<14}" + "".join(f"{c:>24}" for c in cells))
    record_table(["optimizer"] + kinds, summary,
                 title=f"training-step time against the unpruned model: median of {repeats} repeats (range)")
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer steps (a smoke run)")
    ap.add_argument("--overhead", action="store_true", help="only the per-step overhead of pruned models")
    ap.add_argument("--repeats", type=int, default=5, help="--overhead: repeats with fresh models (medians over them)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.overhead:
        overhead(args.quick, max(1, args.repeats))
        return
    x, y, xt, yt = data()
    dense_steps, ft_steps = (300, 200) if args.quick else (900, 900)
    model = cnn()
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    finetune(model, opt, steps(x, y, dense_steps, seed=1))
    dense = copy.deepcopy(model.state_dict())
    dense_acc = accuracy(model, xt, yt)
    batches = steps(x, y, ft_steps, seed=2)
    end = int(ft_steps * 0.6)
    print(f"dense accuracy {dense_acc:.4f}  (CNN on digits, {dense_steps} dense steps, {ft_steps} fine-tuning steps)")
    print(f"{'pruner':<14}{'pattern':<8}{'target':>7}{'sparsity':>10}{'acc':>8}{'d acc':>8}{'goal':>6}"
          f"{'plain ms':>10}{'pruned ms':>10}{'ratio':>7}{'after end':>10}")
    results = []
    for pattern, target, tol in PATTERNS:
        for prune_type in PRUNERS:
            ref = cnn(); ref.load_state_dict(dense)
            ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-3)
            m = cnn(); m.load_state_dict(dense)
            m_opt = torch.optim.Adam(m.parameters(), lr=1e-3)
            pruning = prepare_pruning(m, {"prune_type": prune_type, "pattern": pattern, "target_sparsity": target,
                                          "start_step": 0, "end_step": end, "update_frequency_on_step": 20,
                                          "sparsity_decay_type": "cube", "excluded_names": ["^0$"],
                                          "max_sparsity_ratio_per_layer": 0.98}, m_opt)
            plain_t, pruned_t = [], []
            for i in range(0, ft_steps, 50):  # interleave chunks so both see the same machine load
                plain_t += finetune(ref, ref_opt, batches[i:i + 50])
                pruned_t += finetune(m, m_opt, batches[i:i + 50])
            p0 = pruning.pruners[0]
            quiet = [t for s, t in enumerate(pruned_t) if not p0.scheduler.is_update_step(s) and s > 10]
            plain = statistics.median(plain_t[10:])
            pruned = statistics.median(quiet)
            after = statistics.median(pruned_t[end + 1:]) / statistics.median(plain_t[end + 1:])
            rep = pruning.report()
            acc = accuracy(m, xt, yt)
            ok = "yes" if dense_acc - acc <= tol / 100 else "NO"
            print(f"{prune_type:<14}{pattern:<8}{target:>7.2f}{rep.elementwise_over_layers:>10.4f}{acc:>8.4f}"
                  f"{(acc - dense_acc) * 100:>+8.2f}{ok:>6}{plain * 1e3:>10.3f}{pruned * 1e3:>10.3f}"
                  f"{pruned / plain:>7.3f}{after:>10.3f}")
            results.append([prune_type, pattern, f"{target:.2f}", f"{rep.elementwise_over_layers:.4f}",
                            f"{acc:.4f}", f"{(acc - dense_acc) * 100:+.2f}", ok])
            pruning.unwire()
    record_table(["pruner", "pattern", "target", "sparsity", "accuracy", "change (points)", "within goal"], results,
                 title=f"CNN on digits, dense accuracy {dense_acc:.4f}, {ft_steps} fine-tuning steps")


if __name__ == "__main__":
    main()
