"""``prunekit prune``: prune a model (factory + weights) and write a compressed checkpoint."""

from __future__ import annotations

import argparse
import os
import re
from typing import Any, Dict, List, Optional, Tuple

from ._common import (
    CliError,
    add_model_args,
    amount_type,
    emit_json,
    write_report,
    existing_file,
    first_line,
    human_bytes,
    load_model,
    print_report,
    say,
    writable_path,
)

METHODS = ("global_magnitude", "l1_unstructured", "random_unstructured", "ln_structured", "random_structured")
GRADIENT_PRUNERS = ("snip", "snip_momentum", "gradient")

_EPILOG = """\
examples:
  prunekit prune --model mypkg.nets:make_cnn --weights cnn.pt --amount 0.8 --out cnn-80.safetensors
  prunekit prune --model nets.py:make_cnn --weights cnn.safetensors --method ln_structured --amount 0.3 \\
                 --out cnn-ch.safetensors --report cnn-ch.json
  prunekit prune --model mypkg.nets:make_cnn --weights cnn.pt --pattern 2:4 --out cnn-24.safetensors
  prunekit prune --model mypkg.nets:make_cnn --weights cnn.pt --config pruning.yaml --out cnn-p.safetensors

methods (--method, with --amount; applied to every Linear/Conv weight matched by --layers):
  global_magnitude     one ranking by |w| across all selected layers (default)
  l1_unstructured      the smallest |w| of each layer
  random_unstructured  random entries of each layer
  ln_structured        whole output channels of each layer, by L-n norm (--norm, default 2)
  random_structured    random whole output channels of each layer
--pattern NxM | N:M | channelx1 | 1xchannel prunes one-shot by magnitude with prunekit.training's
patterns (--amount is the target sparsity; N:M sets its own). --config reads a prunekit.training
config (YAML or JSON); magnitude pruners run their whole schedule at once (no training data here).

The output is prunekit's compressed safetensors format: masked weights keep their masks, so
prunekit.load_state_dict(model, prunekit.sparse.load_compressed(path)) restores the pruned model;
--bake stores plain weights with the zeros baked in (loads into the dense model directly).
Weights are read with torch.load(weights_only=True) or safetensors; --trust-pickle allows more.
"""


def add_parser(sub: Any) -> None:
    p = sub.add_parser("prune", help="prune a model by a method, pattern or config; write a compressed checkpoint",
                       description="Prune a model built by a Python factory, loaded with a weights file, and write "
                                   "a compressed checkpoint plus a sparsity report.",
                       epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    how = p.add_mutually_exclusive_group()
    how.add_argument("--method", choices=METHODS, help="pruning method (default global_magnitude)")
    how.add_argument("--pattern", help="a prunekit.training pattern: 1x1, 4x1, 2:4, channelx1, 1xchannel, ...")
    how.add_argument("--config", metavar="FILE", help="a prunekit.training config file (YAML or JSON)")
    p.add_argument("--amount", type=amount_type, help="fraction of the selected weights to prune, in [0, 1]")
    p.add_argument("--layers", metavar="REGEX",
                   help="prune only Linear/Conv modules whose name matches (re.search), with every option; "
                        "matching none is an error")
    p.add_argument("--norm", default="2", help="norm for ln_structured: a number, inf, -inf, fro, nuc (default 2)")
    p.add_argument("--seed", type=int, default=0, help="seed for the random methods (default 0)")
    p.add_argument("--out", required=True, metavar="FILE", help="compressed checkpoint to write (.safetensors)")
    p.add_argument("--bake", action="store_true", help="store plain weights (masks baked in) instead of masks")
    p.add_argument("--report", metavar="FILE", help="also write the sparsity report as JSON")
    p.set_defaults(func=run)


_LAYER_TYPES = ("Linear", "Conv1d", "Conv2d", "Conv3d")


def _targets(model: Any, layers: str) -> List[Tuple[str, Any]]:
    """The Linear/Conv layers ``--layers`` selects (all of them without it), the same for every option.

    Nothing selected is a one-line error (exit 2) that lists the layers the model has.
    """
    from torch import nn

    try:
        rx = re.compile(layers) if layers else None
    except re.error as e:
        raise CliError(f"--layers {layers!r} is not a regular expression ({e})") from None
    candidates = [(n, m) for n, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d))]
    out = [(n, m) for n, m in candidates if rx is None or rx.search(n)]
    if not out:
        if not candidates:
            raise CliError(f"the model ({type(model).__name__}) has no Linear/Conv layer to prune")
        names = [n for n, _ in candidates]
        shown = ", ".join(names[:12]) + (f", ... ({len(names)} in all)" if len(names) > 12 else "")
        raise CliError(f"--layers {layers!r} matches no Linear/Conv layer; the model's layers are: {shown}")
    return out


def _restrict(cfg: Any, model: Any, layers: str) -> Any:
    """``cfg`` with every pruner limited to the layers ``--layers`` selects (exact names)."""
    import dataclasses

    from prunekit.training import PruningConfig, select_modules

    allowed = {n for n, _ in _targets(model, layers)}
    out = []
    for i, pc in enumerate(cfg.pruners):
        chosen = [n for n in select_modules(model, pc) if n in allowed]
        if not chosen:
            raise CliError(f"pruners[{i}] of the config selects none of the layers --layers {layers!r} matches "
                           f"({', '.join(sorted(allowed))}); widen --layers or the entry's names")
        out.append(dataclasses.replace(pc, names=["^" + re.escape(n) + "$" for n in chosen]))
    return PruningConfig(out)


def _norm(text: str) -> Any:
    t = text.strip().lower()
    if t in ("fro", "nuc"):
        return t
    try:
        return float(t)
    except ValueError:
        raise CliError(f"--norm {text!r}: write a number, inf, -inf, fro or nuc") from None


def _read_config(path: str) -> Any:
    from prunekit.io import UnreadableFileError, read_config

    existing_file(path, "config file")
    try:
        return read_config(path)
    except ImportError:
        raise CliError("reading a YAML config needs pyyaml: pip install 'prunekit[yaml]'", 1) from None
    except UnreadableFileError as e:
        raise CliError(f"config {first_line(e)}") from None


def _one_shot_training(model: Any, config: Any, where: str, layers: Optional[str] = None) -> Dict[str, Any]:
    """Run a prunekit.training config to its end without data (magnitude-scored pruners only),
    on the layers ``--layers`` selects."""
    from prunekit.training import load_config, prepare_pruning

    try:
        cfg = load_config(config)
    except (ValueError, TypeError) as e:
        raise CliError(f"{where}: {first_line(e)}") from None
    if layers:
        cfg = _restrict(cfg, model, layers)
    for i, pc in enumerate(cfg.pruners):
        if pc.prune_type in GRADIENT_PRUNERS:
            raise CliError(
                f"{where}: pruners[{i}] prune_type={pc.prune_type!r} scores weights by their gradients, which need "
                "training data; use prunekit.training.prepare_pruning in your training loop, or prune_type: magnitude"
            )
    try:
        callbacks = prepare_pruning(model, cfg)
    except (ValueError, TypeError) as e:
        raise CliError(f"{where}: {first_line(e)}") from None
    last = max(pc.end_step for pc in cfg.pruners)
    for step in range(last + 1):
        callbacks.on_step_begin(step)
        callbacks.on_before_optimizer_step()
        callbacks.on_after_optimizer_step()
        callbacks.on_step_end()
    callbacks.on_train_end()
    return {"config": cfg.to_dict(), "skipped": callbacks.skipped}


def _prune(model: Any, args: argparse.Namespace) -> Dict[str, Any]:
    import torch

    import prunekit

    if args.config:
        return _one_shot_training(model, _read_config(args.config), f"config {args.config}", args.layers)
    if args.pattern:
        if args.amount is None and ":" not in args.pattern:
            raise CliError(f"--pattern {args.pattern} needs --amount (the target sparsity, e.g. 0.5); "
                           "only N:M patterns such as 2:4 set their own")
        cfg: Dict[str, Any] = {"prune_type": "magnitude", "pattern": args.pattern, "start_step": 0, "end_step": 0,
                               "max_sparsity_ratio_per_layer": 1.0, "prune_layer_type": list(_LAYER_TYPES)}
        if args.amount is not None:
            cfg["target_sparsity"] = args.amount
        return _one_shot_training(model, cfg, f"--pattern {args.pattern}", args.layers)
    if args.amount is None:
        raise CliError("give --amount (the fraction to prune, e.g. 0.5) with --method, or use --pattern/--config")
    method = args.method or "global_magnitude"
    targets = _targets(model, args.layers)
    torch.manual_seed(args.seed)
    if method == "global_magnitude":
        prunekit.global_unstructured([(m, "weight") for _, m in targets],
                                     pruning_method=prunekit.L1Unstructured, amount=args.amount)
    else:
        fn = getattr(prunekit, method)
        for _, m in targets:
            if method == "ln_structured":
                fn(m, "weight", amount=args.amount, n=_norm(args.norm), dim=0)
            elif method == "random_structured":
                fn(m, "weight", amount=args.amount, dim=0)
            else:
                fn(m, "weight", amount=args.amount)
    return {"method": method, "amount": args.amount, "layers": [n for n, _ in targets]}


def run(args: argparse.Namespace) -> int:
    import prunekit
    from prunekit.report import model_report
    from prunekit.sparse import save_compressed

    writable_path(args.out, "--out")
    if args.report:
        writable_path(args.report, "--report")
    if args.method and args.amount is None:
        raise CliError(f"--method {args.method} needs --amount (the fraction to prune, e.g. 0.5)")
    model, kind = load_model(args)
    what = _prune(model, args)
    report = model_report(model)
    state = prunekit.dense_state_dict(model) if args.bake else model
    save_compressed(state, args.out, drop_masked_values=True, keep_zero_sign=False)
    size = os.path.getsize(args.out)
    data = {
        "command": "prune", "model": args.model, "weights": args.weights, "weights_format": kind,
        "pruning": what, "output": args.out, "bytes": size, "baked": bool(args.bake), "report": report.to_dict(),
    }
    if args.weights:
        data["weights_bytes"] = os.path.getsize(args.weights)
    write_report(args.report, data)
    if args.json:
        emit_json(data)
        return 0
    print_report(report, f"{args.model} pruned ({what.get('method') or 'config'})")
    extra = f" (weights file {human_bytes(data['weights_bytes'])})" if args.weights else ""
    say(f"wrote {args.out}: {human_bytes(size)}{extra}" + (f"; report in {args.report}" if args.report else ""))
    for name, why in sorted(what.get("skipped", {}).items()):
        say(f"  skipped {name}: {why}")
    return 0
