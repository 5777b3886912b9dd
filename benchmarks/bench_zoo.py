"""The vision zoos side by side: prunekit and Torch-Pruning 1.6.1 on every torchvision classifier and the timm list.

Every model is built with random weights, 10 classes and a small input by ``tests/helpers/vision_models.py``
(the models of ``tests/compact/test_zoo_torchvision.py`` and ``test_zoo_timm.py``). Each library
prunes 30% of the channels of every group by L2 magnitude, the classifier's outputs kept, in a
child process of its own with a time limit (``--timeout``):

* prunekit: ``build_dependency_graph`` + ``prune_groups`` + ``compact`` (its own output check
  included). Outcome ``exact`` (compacted output equal to the masked model's, relative error at
  most 1e-5), ``blocked`` (no prunable group; every group says why), ``wrong`` (a larger error),
  ``crash`` (an exception) or ``timeout``.
* Torch-Pruning: ``MetaPruner(pruning_ratio=0.3, MagnitudeImportance(p=2))`` with every layer of
  10 outputs ignored, then ``step()``. It removes channels without masks, so there is no masked
  model to compare with: outcome ``runs`` (the pruned model runs on the input), ``broken`` (it
  does not), ``crash`` or ``timeout``.

MACs ratios (pruned / dense) are counted by ``prunekit.compact.count_macs`` for both; seconds are
the pruning calls only (not building the model, not counting MACs).

Run (torchvision and timm beside the environment, see ``make test-zoo``):
    PYTHONPATH=src:tests:.zoo .venv/bin/python benchmarks/bench_zoo.py [--zoo torchvision,timm]
        [--only resnet18,convnext] [--jobs 4] [--timeout 300] [--libraries prunekit,torch-pruning]
Results: ``benchmarks/results/bench_zoo.json`` (one row per model, and the counts).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
sys.path.insert(0, HERE)

import torch  # noqa: E402

from _harness import load_note, table  # noqa: E402

LIBRARIES = ("prunekit", "torch-pruning")
AMOUNT = 0.3


def _build(zoo: str, name: str):
    from helpers import vision_models as V

    return (V.build_torchvision if zoo == "torchvision" else V.build_timm)(name)


def _short(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".replace("\n", " ")
    return text if len(text) <= 160 else text[:157] + "..."


def child_prunekit(zoo: str, name: str) -> dict:
    from helpers import vision_models as V

    model, x = _build(zoo, name)
    try:
        o = V.prune_and_compact(model, x, AMOUNT)
    except Exception as exc:
        return {"outcome": "crash", "error": _short(exc)}
    reasons = sorted(o.blocked, key=lambda r: -o.blocked[r])
    return {"outcome": o.verdict, "rel_error": o.rel_error, "macs_ratio": o.macs_ratio, "seconds": o.seconds,
            "pruned_groups": o.pruned_groups, "blocked_groups": sum(o.blocked.values()),
            "error": reasons[0][:160] if o.verdict == "blocked" and reasons else ""}


def child_torch_pruning(zoo: str, name: str) -> dict:
    import torch_pruning as tp
    from helpers import vision_models as V
    from prunekit.compact import count_macs

    model, x = _build(zoo, name)
    dense = count_macs(model, x)
    ignored = [m for m in model.modules() if (isinstance(m, torch.nn.Linear) and m.out_features == V.NUM_CLASSES)
               or (isinstance(m, torch.nn.Conv2d) and m.out_channels == V.NUM_CLASSES)]
    t0 = time.perf_counter()
    try:
        pruner = tp.pruner.MetaPruner(model, example_inputs=x, importance=tp.importance.MagnitudeImportance(p=2),
                                      pruning_ratio=AMOUNT, ignored_layers=ignored)
        pruner.step()
    except Exception as exc:
        return {"outcome": "crash", "error": _short(exc)}
    seconds = time.perf_counter() - t0
    try:
        with torch.no_grad():
            model(x)
    except Exception as exc:
        return {"outcome": "broken", "seconds": seconds, "error": _short(exc)}
    return {"outcome": "runs", "seconds": seconds, "macs_ratio": count_macs(model, x) / dense, "error": ""}


def run_case(lib: str, zoo: str, name: str, args) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", lib, "--zoo", zoo, "--only", name,
           "--threads", str(args.threads)]
    env = dict(os.environ, PRUNEKIT_BENCH_CHILD="1", OMP_NUM_THREADS=str(args.threads),
               PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"outcome": "timeout", "error": f"over {args.timeout} s"}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()
        return {"outcome": "crash", "error": f"exit {proc.returncode}: {(tail or ['?'])[-1][:140]}"}
    return json.loads(lines[-1])


def names_of(zoo: str):
    from helpers import vision_models as V

    return V.torchvision_names() if zoo == "torchvision" else V.timm_names()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--zoo", default="torchvision,timm")
    ap.add_argument("--only", default="", help="comma-separated model (torchvision) or family (timm) names")
    ap.add_argument("--libraries", default=",".join(LIBRARIES))
    ap.add_argument("--jobs", type=int, default=1, help="models run at once (one child process each)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per child")
    ap.add_argument("--timeout", type=int, default=300, help="seconds per model and library")
    ap.add_argument("--child", choices=LIBRARIES, help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.child:
        fn = child_prunekit if args.child == "prunekit" else child_torch_pruning
        print(json.dumps(fn(args.zoo, args.only)), flush=True)
        return
    from helpers import vision_models as V

    if not V.prepare_torchvision():
        sys.exit("torchvision is not importable: install it beside the environment (make test-zoo) and put it on "
                 "PYTHONPATH")
    only = {n for n in args.only.split(",") if n}
    libs = [lib for lib in args.libraries.split(",") if lib]
    cases = [(zoo, n) for zoo in args.zoo.split(",") for n in names_of(zoo) if not only or n in only]
    print(f"{len(cases)} models x {libs}, {args.jobs} at once, {args.threads} thread(s) each; {load_note()}", flush=True)
    results: dict = {}
    with concurrent.futures.ThreadPoolExecutor(max(args.jobs, 1)) as pool:
        futures = {pool.submit(run_case, lib, zoo, n, args): (lib, zoo, n) for zoo, n in cases for lib in libs}
        for fut in concurrent.futures.as_completed(futures):
            lib, zoo, n = futures[fut]
            results[(lib, zoo, n)] = r = fut.result()
            print(f"  {zoo}/{n} {lib}: {r['outcome']} {r.get('error', '')[:100]}", flush=True)
    rows = []
    for zoo, n in cases:
        row = [f"{zoo}/{n}"]
        for lib in libs:
            r = results[(lib, zoo, n)]
            row += [r["outcome"], r.get("macs_ratio"), r.get("seconds")]
            if lib == "prunekit":
                row.insert(len(row) - 2, r.get("rel_error"))
        row.append("; ".join(f"{lib}: {results[(lib, zoo, n)]['error']}" for lib in libs
                             if results[(lib, zoo, n)].get("error")))
        rows.append(row)
    header = ["model"]
    for lib in libs:
        header += [f"{lib}", "rel. error", "MACs ratio", "s"] if lib == "prunekit" else [f"{lib}", "MACs ratio", "s"]
    header.append("why")
    print()
    print(table(header, rows, title=f"{AMOUNT:.0%} of every group by L2 magnitude, classifier outputs kept"))
    counts = []
    for lib in libs:
        for zoo in args.zoo.split(","):
            got = [results[(lib, z, n)]["outcome"] for z, n in cases if z == zoo]
            kinds = sorted(set(got))
            counts.append([lib, zoo, len(got), ", ".join(f"{k} {got.count(k)}" for k in kinds)])
    print()
    print(table(["library", "zoo", "models", "outcomes"], counts, title="outcomes"))
    if set(libs) == set(LIBRARIES):
        ratios = [results[("prunekit", z, n)]["seconds"] / results[("torch-pruning", z, n)]["seconds"]
                  for z, n in cases if results[("prunekit", z, n)]["outcome"] == "exact"
                  and results[("torch-pruning", z, n)]["outcome"] == "runs"]
        if ratios:
            print(f"\nwhere prunekit is exact and Torch-Pruning's model runs ({len(ratios)} models): prunekit's time "
                  f"/ Torch-Pruning's, median {statistics.median(ratios):.2f} ({load_note()})")


if __name__ == "__main__":
    main()
