"""``prunekit oneshot``: prune a pretrained model in one shot from calibration text or batches."""

from __future__ import annotations

import argparse
import os
from typing import Any, List, Optional, Tuple

from ._common import (
    CliError,
    add_model_args,
    amount_type,
    console,
    emit_json,
    existing_file,
    first_line,
    human_bytes,
    load_factory,
    load_weights,
    print_table,
    say,
    writable_path,
)

_EPILOG = """\
examples:
  prunekit oneshot --model path/to/hf-model-folder --calibration sentences.txt --sparsity 0.5 --out pruned.safetensors
  prunekit oneshot --model path/to/hf-model-folder --calibration texts.json --pattern 2:4 --method sparsegpt --out p.safetensors
  prunekit oneshot --model mypkg.nets:make_lm --weights lm.pt --tokenizer path/to/tokenizer --calibration c.txt --out p.safetensors

  prunekit oneshot --model path/to/hf-model-folder --calibration c.txt --method sparsegpt --out path/to/new-folder
  torchrun --nproc-per-node 4 -m prunekit oneshot --model big-model --calibration c.txt --out pruned-model

--model is a Hugging Face model folder (loaded with transformers.AutoModel, its tokenizer from the same
folder) or a factory (package.module:function or file.py:function, with --weights and --tokenizer).
--calibration is a text file with one sample per line, or a .json file holding a list of strings.
Methods: magnitude, wanda, sparsegpt, prunekit (the default: best quality), prunekit-fast.
The output is prunekit's compressed safetensors file (masks and pruned weights; prunekit.load_compressed)
when --out ends in .safetensors. Any other --out with a model folder is a NEW folder: the model is pruned
from disk to disk, one block in memory at a time, into a copy of the folder (same shards, config and
tokenizer files) that transformers loads; it appears complete or not at all. Under torchrun the ranks
share the work (gloo on CPU, nccl with --device cuda) and give the result of one process.
"""


def add_parser(sub: Any) -> None:
    from prunekit.oneshot.api import METHODS

    p = sub.add_parser("oneshot", help="prune a pretrained model from calibration data (Wanda, SparseGPT, prunekit)",
                       description="Prune every linear layer inside the model's repeated blocks in one shot, block by "
                                   "block, from a few hundred calibration samples; report sparsity, reconstruction "
                                   "error and time per layer.",
                       epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    p.add_argument("--tokenizer", metavar="DIR", help="tokenizer folder (default: the --model folder)")
    p.add_argument("--calibration", required=True, metavar="FILE",
                   help="calibration samples: a text file (one per line) or a JSON list of strings")
    p.add_argument("--sparsity", type=amount_type, default=0.5, help="fraction of each layer to prune (default 0.5)")
    p.add_argument("--pattern", default="unstructured", help="'unstructured' (default) or 'N:M', e.g. 2:4")
    p.add_argument("--method", default="prunekit", choices=METHODS, help="default: prunekit")
    p.add_argument("--max-length", type=int, default=128, metavar="N", help="tokens per sample at most (default 128)")
    p.add_argument("--batch-size", type=int, default=16, metavar="N", help="samples per calibration batch (default 16)")
    p.add_argument("--device", help="working device for each block, e.g. cuda (default: where the model is)")
    p.add_argument("--out", required=True, metavar="FILE|DIR",
                   help="where to write the pruned model: a .safetensors file, or a new folder (disk to disk)")
    p.set_defaults(func=run)


CALIBRATION_LIMIT = 64 * 1024 * 1024  # a few hundred samples are kilobytes; 64 MiB is far past any real set


def read_calibration(path: str) -> List[str]:
    """Samples from a text file (one per non-empty line) or a JSON list of strings.

    The file goes through prunekit's hostile reader: a regular file (a FIFO or
    ``/dev/zero`` exits 2 at once) of at most 64 MiB of UTF-8, strict JSON for
    ``.json``.

    Examples:
        >>> import json, os, tempfile
        >>> from prunekit.cli._oneshot import read_calibration
        >>> with tempfile.TemporaryDirectory() as d:
        ...     p = os.path.join(d, "c.json")
        ...     with open(p, "w") as f:
        ...         json.dump(["one sample", "another"], f)
        ...     read_calibration(p)
        ['one sample', 'another']
    """
    from prunekit.io.reader import loads_json_strict, read_text

    existing_file(path, "--calibration")
    try:
        text = read_text(path, limit=CALIBRATION_LIMIT, what="calibration file")
        data = loads_json_strict(text, path) if path.endswith(".json") else None
    except ValueError as e:  # not a regular file, too large, not UTF-8, not strict JSON: named by the reader
        raise CliError(f"--calibration {first_line(e)}") from None
    except OSError as e:
        raise CliError(f"--calibration {path}: cannot read it ({first_line(e)})") from None
    if path.endswith(".json"):
        if not isinstance(data, list) or not all(isinstance(s, str) for s in data):
            raise CliError(f"--calibration {path}: must hold a JSON list of strings, e.g. [\"a sentence\", \"another\"]")
        samples = [s for s in data if s.strip()]
    else:
        samples = [line.strip() for line in text.splitlines() if line.strip()]
    if not samples:
        raise CliError(f"--calibration {path}: no sample in it; write one sample per line (or a JSON list)")
    return samples


def _load(args: argparse.Namespace) -> Tuple[Any, Any, Optional[str]]:
    try:
        import transformers
    except ImportError:
        transformers = None  # type: ignore[assignment]
    kind: Optional[str]
    if os.path.isdir(args.model):
        if transformers is None:
            raise CliError("--model is a folder: reading Hugging Face models needs transformers (pip install prunekit[hf])")
        if args.weights:
            raise CliError("--weights goes with a factory --model; a model folder holds its own weights")
        try:
            model = transformers.AutoModel.from_pretrained(args.model)
        except Exception as e:  # transformers raises many types for a bad folder
            raise CliError(f"--model {args.model}: not a Hugging Face model folder ({first_line(e)})") from None
        kind = "hf-folder"
    else:
        model = load_factory(args.model, args.model_kwargs)
        kind = load_weights(model, args.weights, args.trust_pickle)
    tok_dir = args.tokenizer or (args.model if os.path.isdir(args.model) else None)
    if tok_dir is None:
        raise CliError("--tokenizer is needed with a factory --model (the folder of a Hugging Face tokenizer)")
    if transformers is None:
        raise CliError("tokenizing the calibration text needs transformers (pip install prunekit[hf])")
    try:
        tok = transformers.AutoTokenizer.from_pretrained(tok_dir)
    except Exception as e:
        raise CliError(f"--tokenizer {tok_dir}: cannot load a tokenizer ({first_line(e)})") from None
    return model, tok, kind


def run(args: argparse.Namespace) -> int:
    from prunekit.oneshot import oneshot  # the function the callable package runs
    from prunekit.sparse import save_compressed

    to_folder = os.path.isdir(args.model) and not args.out.endswith(".safetensors")
    if to_folder:
        return _run_folder(args)
    writable_path(args.out, "--out")
    _check_args(args)
    samples = read_calibration(args.calibration)
    model, tok, kind = _load(args)
    progress, stop = _progress(args.json)
    try:
        report = oneshot(model, samples, tokenizer=tok, sparsity=args.sparsity, pattern=args.pattern,
                         method=args.method, device=args.device, batch_size=args.batch_size,
                         max_length=args.max_length, progress=progress)
    except ValueError as e:
        raise CliError(first_line(e), 1) from None
    finally:
        stop()
    save_compressed(model, args.out, drop_masked_values=True, keep_zero_sign=False)
    data = {"command": "oneshot", "model": args.model, "weights_format": kind, "calibration": args.calibration,
            "samples": len(samples), "output": args.out, "bytes": os.path.getsize(args.out), "report": report.to_dict()}
    if args.json:
        emit_json(data)
        return 0
    rows = [[r.name, "x".join(map(str, r.shape)), f"{100 * r.sparsity:.1f}%",
             "-" if r.error is None else f"{r.error:.4f}", f"{r.seconds:.2f}"] for r in report.layers]
    print_table(f"{args.model}: one-shot {report.method} ({report.pattern})",
                ["layer", "shape", "sparsity", "rel. error", "seconds"], rows)
    say(f"{len(report.layers)} layers in {report.blocks} blocks, sparsity {100 * report.sparsity:.2f}%, "
        f"{report.samples} samples / {report.tokens} tokens, {report.seconds:.1f} s")
    say(f"wrote {args.out} ({human_bytes(data['bytes'])})")
    return 0


def _check_args(args: argparse.Namespace) -> None:
    from prunekit.oneshot.api import parse_pattern

    try:
        parse_pattern(args.pattern)
    except ValueError as e:
        raise CliError(f"--pattern: {first_line(e)}") from None
    if args.sparsity >= 1.0:
        raise CliError(f"--sparsity {args.sparsity} is out of range; write the fraction to prune, in [0, 1), e.g. 0.5")
    for opt in ("max_length", "batch_size"):
        if getattr(args, opt) < 1:
            raise CliError(f"--{opt.replace('_', '-')} must be a positive number, got {getattr(args, opt)}")


def _process_group(device: Optional[str]) -> Any:
    """``True`` (the default group, set up here) under torchrun with more than one process, else ``None``."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return None
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("nccl" if (device or "").startswith("cuda") else "gloo")
    return True


def _run_folder(args: argparse.Namespace) -> int:
    """``--model DIR --out DIR``: disk to disk, one block in memory."""
    from prunekit.oneshot import oneshot_folder

    out = os.path.abspath(args.out)
    if os.path.lexists(out):
        raise CliError(f"--out {args.out} exists; the pruned model goes to a new folder (remove it or pick a new name)")
    if not os.path.isdir(os.path.dirname(out)):
        raise CliError(f"--out folder does not exist: {os.path.dirname(out)}")
    if args.weights:
        raise CliError("--weights goes with a factory --model; a model folder holds its own weights")
    _check_args(args)
    samples = read_calibration(args.calibration)
    try:
        import transformers

        tok = transformers.AutoTokenizer.from_pretrained(args.tokenizer or args.model)
    except ImportError:
        raise CliError("disk-to-disk one-shot needs transformers and accelerate (pip install prunekit[hf])") from None
    except Exception as e:
        raise CliError(f"--tokenizer {args.tokenizer or args.model}: cannot load a tokenizer ({first_line(e)})") from None
    group = _process_group(args.device)
    progress, stop = _progress(args.json or group is not None)
    try:
        report = oneshot_folder(args.model, out, samples, tokenizer=tok, sparsity=args.sparsity, pattern=args.pattern,
                                method=args.method, device=args.device, batch_size=args.batch_size,
                                max_length=args.max_length, progress=progress, group=group)
    except (ValueError, FileExistsError) as e:
        raise CliError(first_line(e), 1) from None
    finally:
        stop()
    if group is not None:
        import torch.distributed as dist

        if dist.get_rank() != 0:
            return 0
    size = sum(os.path.getsize(os.path.join(out, n)) for n in os.listdir(out))
    data = {"command": "oneshot", "model": args.model, "weights_format": "hf-folder", "calibration": args.calibration,
            "samples": len(samples), "output": args.out, "bytes": size, "report": report.to_dict()}
    if args.json:
        emit_json(data)
        return 0
    say(f"{len(report.layers)} layers in {report.blocks} blocks, sparsity {100 * report.sparsity:.2f}%, "
        f"{report.samples} samples / {report.tokens} tokens, {report.seconds:.1f} s")
    say(f"wrote the folder {args.out} ({human_bytes(size)})")
    return 0


def _progress(quiet: bool) -> Tuple[Any, Any]:
    """A rich progress bar on stderr, one step per block (nothing when quiet or rich is missing)."""
    con = None if quiet else console(stderr=True)
    if con is None:
        return None, lambda: None
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                   console=con, transient=True)
    task = bar.add_task("one-shot: capturing block inputs", total=None)
    bar.start()

    def update(done: int, total: int, name: str) -> None:
        bar.update(task, completed=done, total=total, description=f"one-shot: block {name}")

    return update, bar.stop
