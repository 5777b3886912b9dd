"""``prunekit compact``: remove masked whole channels, writing a smaller dense model."""

from __future__ import annotations

import argparse
import os
from typing import Any

from ._common import (
    CliError,
    add_model_args,
    emit_json,
    first_line,
    human_bytes,
    human_count,
    load_model,
    print_table,
    run_example,
    say,
    shape_type,
    writable_path,
)

_EPILOG = """\
examples:
  prunekit compact --model mypkg.nets:make_cnn --weights cnn.pt --input-shape 1,3,32,32 --amount 0.5 --out small.pt
  prunekit compact --model nets.py:make_cnn --weights cnn-channels.safetensors --input-shape 1,3,32,32 --out small.pt

With --amount, whole groups of coupled channels (a conv, its batchnorm, the next layer's inputs,
both sides of a residual add) are masked by importance first (prunekit.compact.prune_groups);
without it, the weights must already hold masked whole channels. The output is
{"state_dict", "description"} (torch.save, loadable with weights_only=True); rebuild it with
prunekit.compact.load_compacted(factory(), sd["state_dict"], sd["description"]).
"""


def add_parser(sub: Any) -> None:
    p = sub.add_parser("compact", help="turn masked whole channels into a smaller dense model",
                       description="Prune whole channels (or use the masks in --weights) and rebuild the model with "
                                   "smaller dense layers; report parameters and MACs before and after.",
                       epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    p.add_argument("--input-shape", type=shape_type, required=True, metavar="SHAPE",
                   help="shape of an example input to trace the model with, e.g. 1,3,32,32")
    p.add_argument("--amount", type=float, help="fraction of channels to remove per group, in [0, 1)")
    p.add_argument("--importance", default="l1", choices=("l1", "l2", "random"),
                   help="how channels are ranked with --amount (default l1)")
    p.add_argument("--scope", default="local", choices=("local", "global"),
                   help="local: every group loses --amount; global: one ranking across groups")
    p.add_argument("--round-to", type=int, metavar="N", help="keep a multiple of N channels per group")
    p.add_argument("--out", required=True, metavar="FILE", help="where to write the compacted model (.pt)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from prunekit.compact import (
        build_dependency_graph, compact, count_macs, count_params, prune_groups, save_compacted,
    )

    writable_path(args.out, "--out")
    if args.amount is not None and not 0.0 <= args.amount < 1.0:
        raise CliError(f"--amount {args.amount} is out of range; write the fraction of channels to remove, in [0, 1)")
    model, _ = load_model(args)
    x, _ = run_example(model, args.input_shape)
    params_before = count_params(model)
    macs_before = count_macs(model, x)
    graph = None
    if args.amount is not None:  # one trace serves both calls
        graph = build_dependency_graph(model, x)
        prune_groups(model, x, args.amount, importance=args.importance, scope=args.scope, round_to=args.round_to,
                     graph=graph)
    try:
        small = compact(model, x, graph=graph)
    except ValueError as e:
        raise CliError(first_line(e), 1) from None
    with torch.no_grad():
        diff = float((small(x) - model(x)).abs().max())
    save_compacted(small, args.out)
    params_after, macs_after = count_params(small), count_macs(small, x)
    before = dict(model.named_modules())
    layers = []
    for name, mod in small.named_modules():
        w = getattr(mod, "weight", None)
        old = before.get(name)
        if name and isinstance(w, torch.Tensor) and old is not None and w.dim() >= 1:
            ow = getattr(old, "weight", None)
            old_shape = list(ow.shape) if isinstance(ow, torch.Tensor) else None
            if old_shape != list(w.shape):
                layers.append({"name": name, "before": old_shape, "after": list(w.shape)})
    data = {
        "command": "compact", "model": args.model, "output": args.out, "bytes": os.path.getsize(args.out),
        "params_before": params_before, "params_after": params_after,
        "macs_before": macs_before, "macs_after": macs_after, "input_shape": list(args.input_shape),
        "max_abs_diff": diff, "layers": layers,
    }
    if args.json:
        emit_json(data)
        return 0
    print_table(f"{args.model} compacted", ["layer", "weight before", "weight after"],
                [[l["name"], "x".join(map(str, l["before"] or [])), "x".join(map(str, l["after"]))] for l in layers],
                justify=["left", "right", "right"])
    say(f"parameters {human_count(params_before)} -> {human_count(params_after)} "
        f"({params_after / params_before:.3f}x), MACs {human_count(macs_before)} -> {human_count(macs_after)} "
        f"({macs_after / max(macs_before, 1):.3f}x) on input {list(args.input_shape)}; "
        f"max |compacted - masked| = {diff:.2e}")
    say(f"wrote {args.out} ({human_bytes(data['bytes'])})")
    return 0
