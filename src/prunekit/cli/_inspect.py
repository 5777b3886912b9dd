"""``prunekit inspect CHECKPOINT``: per-layer sparsity of a checkpoint file."""

from __future__ import annotations

import argparse
import sys
import warnings
from typing import Any

from ._common import CliError, emit_json, human_bytes, path_bytes, print_report, read_key, read_state_dict

_EPILOG = """\
examples:
  prunekit inspect model.pt                       a state dict saved with torch.save (read with weights_only=True)
  prunekit inspect pruned.pt                      torch.nn.utils.prune-style (weight_orig / weight_mask)
  prunekit inspect model-90.safetensors --json    prunekit's compressed format, or plain safetensors
  prunekit inspect out/                           a Hugging Face folder in the compressed-tensors layout
  prunekit inspect full-model.pt --trust-pickle   a pickled nn.Module (runs code from the file: trusted files only)
  prunekit inspect signed.safetensors --key-file secret.key
                                                  verify a file saved with save_compressed(..., key=...)
                                                  (or set PRUNEKIT_KEY); a wrong key or an unsigned file exits 2

columns: sparsity = zero weights; zero channels = output channels whose weights are all zero;
2:4 fit = groups of 4 input channels holding at most 2 non-zeros; 4x1 blocks zero = all-zero
blocks of 4 output channels x 1 input channel.
"""


def add_parser(sub: Any) -> None:
    p = sub.add_parser("inspect", help="per-layer sparsity of a checkpoint (state dict, pruned, compressed)",
                       description="Show shapes and sparsity (element-wise, by channel, 2:4, 4x1 blocks) of every "
                                   "weight in a checkpoint, with totals.",
                       epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", help=".pt/.pth state dict, .safetensors, a prunekit compressed checkpoint, "
                                      "or a compressed-tensors model folder")
    p.add_argument("--trust-pickle", action="store_true",
                   help="allow full unpickling for files torch.load(weights_only=True) refuses (runs code!)")
    p.add_argument("--key-file", metavar="FILE",
                   help="verify a signed prunekit checkpoint with the secret stored in FILE (its exact bytes); "
                        "default: the PRUNEKIT_KEY environment variable. With a key, an unsigned file, a "
                        "wrong key or an altered file exits 2")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from prunekit.report import model_report

    from prunekit.io import UnverifiedSignatureWarning

    path = args.checkpoint
    key = read_key(args.key_file)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", UnverifiedSignatureWarning)
        sd, kind = read_state_dict(path, args.trust_pickle, "checkpoint", key=key)
    unverified = any(issubclass(w.category, UnverifiedSignatureWarning) for w in caught)
    for w in caught:
        if not issubclass(w.category, UnverifiedSignatureWarning):
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    if not sd:
        raise CliError(f"{path} holds no tensors")
    signature = "verified" if key is not None else "not verified" if unverified else "none"
    if unverified:
        print(f"prunekit: note: {path} is signed; its signature was not verified (checksums were): "
              "pass --key-file FILE or set PRUNEKIT_KEY", file=sys.stderr)
    report = model_report(sd)
    size = path_bytes(path)
    if args.json:
        emit_json({"command": "inspect", "path": path, "format": kind, "signature": signature, "bytes": size,
                   "report": report.to_dict()})
        return 0
    signed = {"verified": ", signature verified", "not verified": ", signed: not verified"}.get(signature, "")
    print_report(report, f"{path}  ({kind}{signed}, {human_bytes(size)})")
    return 0
