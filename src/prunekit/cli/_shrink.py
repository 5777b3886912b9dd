"""``prunekit shrink``: a Hugging Face model folder in, a smaller dense Hugging Face model folder out."""

from __future__ import annotations

import argparse
import os
from typing import Any, Dict, List, Optional, Tuple

from ._common import CliError, console, emit_json, first_line, human_count, positive_int, print_table, say, write_report

_EPILOG = """\
examples:
  prunekit shrink --model llama-folder --calibration texts.txt --target 0.5 --out llama-half
  prunekit shrink --model minilm --calibration s.txt --target 0.5 --scope blocks --axes ffn,layers --out small
  prunekit shrink --model llama-folder --calibration c.txt --sizes hidden=2048,layers=24 --out llama-small \\
                  --distill train.txt --distill-steps 2000

--calibration (and --distill) is a text file with one sample per line, or a .json file holding a list of
strings. --target is the fraction of the model's parameters (or --measure macs) kept, or a count.
The output folder loads with plain transformers (from_pretrained); it appears complete or not at all.
"""

AXES = ("hidden", "heads", "ffn", "layers", "experts")


def add_parser(sub: Any) -> None:
    p = sub.add_parser("shrink", help="make a Hugging Face model smaller and dense (width + depth), then distill",
                       description="Remove hidden channels, attention heads, FFN neurons, whole layers and experts "
                                   "chosen on calibration text to reach a size target; optionally recover the "
                                   "quality by distillation from the dense model; write a plain Hugging Face folder.",
                       epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, metavar="DIR", help="a Hugging Face model folder (with its tokenizer)")
    p.add_argument("--calibration", required=True, metavar="FILE", help="calibration samples (one per line, or JSON)")
    p.add_argument("--out", required=True, metavar="DIR", help="the folder to write (replaced atomically)")
    p.add_argument("--target", default="0.5", help="fraction of the dense model kept (0.5), or a count (default 0.5)")
    p.add_argument("--measure", choices=("params", "macs"), default="params", help="what --target counts")
    p.add_argument("--scope", choices=("model", "blocks"), default="model",
                   help="count every parameter, or only the transformer blocks' (default: model)")
    p.add_argument("--axes", help=f"comma-separated axes that may shrink, among {','.join(AXES)} (default: all)")
    p.add_argument("--sizes", help="skip the search: units kept per axis, e.g. hidden=2048,ffn=5632,layers=24")
    p.add_argument("--depth-importance", choices=("influence", "loss"), default="influence")
    p.add_argument("--samples", type=positive_int, default=64, metavar="N", help="calibration samples used (64)")
    p.add_argument("--max-length", type=positive_int, default=128, metavar="N", help="tokens per sample (128)")
    p.add_argument("--batch-size", type=positive_int, default=8, metavar="N", help="samples per batch (8)")
    p.add_argument("--distill", metavar="FILE", help="unlabeled text to distill the shrunk model on (optional)")
    p.add_argument("--distill-steps", type=positive_int, default=200, metavar="N", help="optimizer steps (200)")
    p.add_argument("--distill-lr", type=float, default=1e-4, metavar="LR", help="learning rate (1e-4)")
    p.add_argument("--report", metavar="FILE", help="also write the report as JSON to FILE")
    p.add_argument("--json", action="store_true", help="print the report as JSON instead of tables")
    p.set_defaults(func=run)


def _target(text: str) -> Any:
    try:
        value = float(text)
    except ValueError:
        raise CliError(f"--target {text!r} is not a number; write a fraction such as 0.5 or a count") from None
    if value.is_integer() and value >= 1:
        return int(value)
    if not 0.0 < value < 1.0:
        raise CliError(f"--target {text} is out of range; write the fraction of the model kept, in (0, 1), e.g. 0.5, "
                       "or a count of at least 1")
    return value


def _sizes(text: Optional[str]) -> Optional[Dict[str, int]]:
    if not text:
        return None
    out = {}
    for part in text.split(","):
        name, _, value = part.partition("=")
        if name.strip() not in AXES or not value.strip().isdigit() or int(value) < 1:
            raise CliError(f"--sizes {part!r}: write axis=count with an axis among {', '.join(AXES)} and a count of "
                           "at least 1, e.g. ffn=1024")
        out[name.strip()] = int(value)
    return out


def _axes(text: Optional[str]) -> Optional[List[str]]:
    if not text:
        return None
    names = [a.strip() for a in text.split(",") if a.strip()]
    bad = [a for a in names if a not in AXES]
    if bad:
        raise CliError(f"--axes {bad[0]!r} is not an axis; choose among {', '.join(AXES)}")
    return names


def _out_folder(path: str) -> None:
    """``CliError`` before any work when ``--out`` cannot become a folder (a file there, no parent folder)."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise CliError(f"--out {path} exists and is not a folder; give a folder name")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise CliError(f"--out {path}: the folder {parent} does not exist; create it first")


def load_hf(folder: str) -> Tuple[Any, Any]:
    """The model (the class its config names, else ``AutoModel``) and tokenizer of a folder; no remote code."""
    try:
        import transformers
    except ImportError:
        raise CliError("shrink reads Hugging Face folders: it needs transformers (pip install prunekit[hf])") from None
    if not os.path.isdir(folder):
        raise CliError(f"--model {folder}: not a folder; give a Hugging Face model folder")
    try:
        config = transformers.AutoConfig.from_pretrained(folder)
        names = [n for n in (getattr(config, "architectures", None) or []) if hasattr(transformers, n)]
        cls = getattr(transformers, names[0]) if names else transformers.AutoModel
        model = cls.from_pretrained(folder).eval()
    except Exception as e:  # transformers raises many types for a bad folder
        raise CliError(f"--model {folder}: not a Hugging Face model folder ({first_line(e)})") from None
    try:
        tok = transformers.AutoTokenizer.from_pretrained(folder)
    except Exception as e:
        raise CliError(f"--model {folder}: no tokenizer in the folder ({first_line(e)})") from None
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token or tok.unk_token
    return model, tok


def batches_of(tok: Any, samples: List[str], batch_size: int, max_length: int) -> List[Dict[str, Any]]:
    """Tokenized batches (``input_ids`` and ``attention_mask``) of the samples."""
    out = []
    for i in range(0, len(samples), batch_size):
        enc = tok(samples[i:i + batch_size], return_tensors="pt", padding=True, truncation=True, max_length=max_length)
        out.append({"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]})
    return out


def run(args: argparse.Namespace) -> int:
    from prunekit.io.writer import atomic_folder
    from prunekit.shrink import shrink

    from ._oneshot import read_calibration

    target, sizes, axes = _target(args.target), _sizes(args.sizes), _axes(args.axes)
    _out_folder(args.out)
    samples = read_calibration(args.calibration)[: args.samples]
    distill_samples = read_calibration(args.distill) if args.distill else None
    model, tok = load_hf(args.model)
    calibration = batches_of(tok, samples, args.batch_size, args.max_length)
    try:
        report = shrink(model, calibration, target, measure=args.measure, scope=args.scope, axes=axes, sizes=sizes,
                        depth_importance=args.depth_importance)
    except (ValueError, TypeError) as e:
        raise CliError(first_line(e), 1) from None
    distilled = None
    if distill_samples:
        distilled = _distill(args, model, tok, distill_samples)
    with atomic_folder(args.out) as tmp:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
    data = {"command": "shrink", "model": args.model, "output": args.out, "model_type": report.model_type,
            "objective": report.objective, "dense": _cand(report.dense), "chosen": _cand(report.chosen),
            "params": report.params, "score": report.score, "removed_layers": report.removed_layers,
            "candidates": [_cand(c) for c in report.candidates], "seconds": report.seconds,
            "distill": distilled}
    write_report(args.report, data)
    if args.json:
        emit_json(data)
        return 0
    axes_shown = sorted(report.dense.sizes)
    rows = [[*(str(c.sizes.get(a, "")) for a in axes_shown), human_count(c.params), f"{c.score:.4g}"]
            for c in report.candidates[:10]]
    print_table(f"{args.model}: candidates (best first; {report.objective})", [*axes_shown, "params", "score"], rows)
    say(f"{report.dense.params:,} -> {report.params:,} parameters ({report.params / report.dense.params:.1%}); "
        f"{report.objective} {report.dense.score:.4g} -> {report.score:.4g}")
    if distilled:
        say(f"distilled {distilled['steps']} steps: loss {distilled['initial_loss']:.4g} -> {distilled['final_loss']:.4g}")
    say(f"wrote {args.out}")
    return 0


def _cand(c: Any) -> Dict[str, Any]:
    return {"sizes": c.sizes, "params": c.params, "macs": c.macs, "score": c.score}


def _distill(args: argparse.Namespace, student: Any, tok: Any, samples: List[str]) -> Dict[str, Any]:
    from prunekit.shrink import distill

    teacher, _ = load_hf(args.model)
    data = batches_of(tok, samples, args.batch_size, args.max_length)
    con = None if args.json else console(stderr=True)
    bar = task = None
    if con is not None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                       console=con, transient=True)
        task = bar.add_task("distilling", total=args.distill_steps)
        bar.start()

    def progress(step: int, loss: float) -> None:
        if bar is not None and task is not None:
            bar.update(task, completed=step, description=f"distilling: loss {loss:.4g}")

    try:
        rep = distill(student, teacher, data, steps=args.distill_steps, lr=args.distill_lr, callback=progress)
    except (ValueError, TypeError) as e:
        raise CliError(f"--distill: {first_line(e)}", 1) from None
    finally:
        if bar is not None:
            bar.stop()
    student.eval()
    return {"steps": rep.steps, "initial_loss": rep.initial_loss, "final_loss": rep.final_loss}
