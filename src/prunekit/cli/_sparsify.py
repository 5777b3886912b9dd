"""``prunekit sparsify``: which pruned layers run faster on sparse kernels, measured."""

from __future__ import annotations

import argparse
import copy
from functools import partial
from typing import Any, Dict, List

from ._common import (
    CliError,
    add_model_args,
    emit_json,
    write_report,
    load_model,
    pct,
    print_table,
    run_example,
    say,
    shape_type,
    writable_path,
)

_EPILOG = """\
examples:
  prunekit sparsify --model mypkg.nets:make_mlp --weights mlp-90.safetensors --input-shape 8,784
  prunekit sparsify --model nets.py:make_cnn --weights cnn-90.safetensors --input-shape 1,3,32,32 --json
  prunekit sparsify --model nets.py:make_mlp --weights mlp-24.safetensors --input-shape 8,784 --format 2:4

For each pruned Linear/Conv2d layer, prunekit.sparse.sparsify_for_inference times every execution
policy that can run it (prunekit's compiled CSR and 4x1/1x4 block kernels, torch's CSR kernel, each
on all threads and on one, a smaller dense product for whole zero channels, 2:4 on CUDA) right after
the dense layer, on the layer's real input, and keeps the fastest where it is at least --min-speedup
times faster than dense; the table says which policy each layer runs and why, --verbose adds every
policy's figure, and the whole model is timed before and after.
"""


def add_parser(sub: Any) -> None:
    p = sub.add_parser("sparsify", help="convert pruned layers to sparse kernels where measured faster",
                       description="Measure which pruned layers run faster on sparse kernels and report the model's "
                                   "latency before and after conversion.",
                       epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p, weights_required=True)
    p.add_argument("--input-shape", type=shape_type, required=True, metavar="SHAPE",
                   help="shape of the inputs to measure with, e.g. 8,784 or 1,3,32,32")
    p.add_argument("--format", default="auto", choices=("auto", "csr", "bsr", "channels", "2:4"),
                   help="sparse format (default auto: every policy)")
    p.add_argument("--min-sparsity", type=float, default=0.5, help="only layers sparser than this (default 0.5)")
    p.add_argument("--min-speedup", type=float, default=1.2, help="required speedup per layer (default 1.2)")
    p.add_argument("--no-measure", action="store_true", help="convert every eligible layer without timing")
    p.add_argument("--report", metavar="FILE", help="also write the decisions as JSON")
    p.add_argument("--verbose", action="store_true", help="print every measured policy's figure per layer")
    p.set_defaults(func=run)


def _median_ms(models: List[Any], x: Any, repeats: int = 30) -> List[float]:
    """Median milliseconds per forward of each model, timed in one interleaved loop (prunekit.timing)."""
    import torch

    from prunekit.timing import interleaved_medians

    with torch.no_grad():
        return [s * 1e3 for s in interleaved_medians([partial(m, x) for m in models], repeats)]


def run(args: argparse.Namespace) -> int:
    import torch

    from prunekit.sparse import sparsify_for_inference

    if args.report:
        writable_path(args.report, "--report")
    if not 0.0 <= args.min_sparsity <= 1.0:
        raise CliError(f"--min-sparsity {args.min_sparsity} is out of range; write a fraction in [0, 1]")
    if not args.min_speedup > 0:
        raise CliError(f"--min-speedup {args.min_speedup} must be positive")
    model, _ = load_model(args)
    x, expected = run_example(model, args.input_shape)
    dense = copy.deepcopy(model)
    rep = sparsify_for_inference(model, example_inputs=x, format=args.format, min_sparsity=args.min_sparsity,
                                 min_speedup=args.min_speedup, measure=not args.no_measure)
    if rep.converted:
        dense_ms, sparse_ms = _median_ms([dense, model], x)
    else:  # nothing changed: one model, one timing
        dense_ms = sparse_ms = _median_ms([model], x)[0]
    with torch.no_grad():
        diff = float((model(x) - expected).abs().max())
    layers: List[Dict[str, Any]] = [{
        "name": d.name, "kind": d.kind, "shape": list(d.shape), "sparsity": d.sparsity, "converted": d.converted,
        "format": d.format, "policy": d.policy, "reason": d.reason, "dense_ms": d.dense_ms,
        "sparse_ms": d.sparse_ms, "speedup": d.speedup, "timings_ms": d.timings_ms, "not_tried": d.not_tried,
    } for d in rep.layers]
    data: Dict[str, Any] = {
        "command": "sparsify", "model": args.model, "weights": args.weights, "format": args.format,
        "input_shape": list(args.input_shape), "converted": len(rep.converted), "candidates": len(rep.layers),
        "device_note": rep.device_note, "model_dense_ms": dense_ms, "model_sparse_ms": sparse_ms,
        "model_speedup": dense_ms / sparse_ms if sparse_ms > 0 else None, "max_abs_diff": diff, "layers": layers,
    }
    write_report(args.report, data)
    if args.json:
        emit_json(data)
        return 0
    rows = []
    for l in layers:
        sp = "-" if l["speedup"] is None else f"{l['speedup']:.2f}x"
        rows.append([l["name"], l["kind"], "x".join(map(str, l["shape"])), pct(l["sparsity"]),
                     (l["policy"] or "yes") if l["converted"] else "no", sp, l["reason"]])
    print_table(f"{args.model}: sparse-kernel conversion ({args.format})",
                ["layer", "kind", "shape", "sparsity", "policy", "layer speedup", "why"], rows,
                justify=["left", "left", "right", "right", "left", "right", "left"])
    if args.verbose:
        for d in rep.layers:
            if d.timings_line():
                say(f"{d.name}: {d.timings_line()}")
    if rep.device_note:
        say(rep.device_note)
    if rep.converted:
        say(f"{len(rep.converted)} of {len(rep.layers)} layers converted; model {dense_ms:.3f} ms -> {sparse_ms:.3f} "
            f"ms per batch of {args.input_shape[0]} ({dense_ms / sparse_ms:.2f}x, medians measured side by side); "
            f"max |sparse - dense| = {diff:.2e}")
    else:
        say(f"0 of {len(rep.layers)} layers converted: the model stays dense ({dense_ms:.3f} ms per batch of "
            f"{args.input_shape[0]})")
    return 0
