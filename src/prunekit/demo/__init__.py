"""The end-to-end demo behind ``prunekit demo``: prune a small CNN on scikit-learn's digits, and MiniLM-L6.

:func:`run_demo` trains a small convolutional network dense on the 8x8 digit
images that ship with scikit-learn (no download), then prunes copies of it
side by side (:mod:`prunekit.demo.stages`, one function per stage):

* global magnitude, one-shot (:func:`prunekit.global_unstructured`, no fine-tuning);
* gradual magnitude and gradual SNIP-momentum during fine-tuning
  (:func:`prunekit.training.prepare_pruning`, cubic schedule);
* 2:4 semi-structured, gradual magnitude;
* whole channels (:func:`prunekit.compact.prune_groups`), fine-tuned, then
  compacted into a smaller dense model (:func:`prunekit.compact.compact`).

For each model it measures sparsity, test accuracy, parameters, MACs (all, and
those on non-zero weights: :func:`prunekit.compact.count_macs`), the size of its
compressed checkpoint (:func:`prunekit.sparse.save_compressed`) and its median
CPU latency, measured side by side with the dense model in one loop.

Then it prunes the pretrained MiniLM-L6 sentence encoder in one shot from a few
calibration sentences (:mod:`prunekit.demo.pretrained`, :func:`prunekit.oneshot`)
with magnitude, SparseGPT and prunekit's default, and compares each pruned
model's sentence embeddings with the dense model's; without ``transformers`` or
the model package that stage is skipped with a note.

It writes the checkpoints, two PNG plots and ``results.json`` to the output
folder and returns the same figures as a dict. A pruning stage that fails is
recorded in ``errors`` and the others still run. It logs and never prints; the
``prunekit demo`` command draws the tables and the progress bar.

Example (a tiny run; the real one is ``prunekit demo``)::

    from prunekit.demo import DemoSettings, run_demo
    result = run_demo(DemoSettings.quick(), "demo-out")
    print(result["checks"])
"""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import Any, Dict, Optional

import torch

from .digits import Progress, load_data, make_model
from .pretrained import minilm_oneshot
from .settings import DemoSettings
from .stages import DemoRun, channels, gradual, measure, oneshot_magnitude, targets, train_dense, two_four, write_files

__all__ = ["DemoSettings", "make_model", "load_data", "run_demo"]


def run_demo(settings: Optional[DemoSettings] = None, out_dir: str = "demo-out",
             progress: Optional[Progress] = None) -> Dict[str, Any]:
    """Run the whole comparison and write checkpoints, plots and ``results.json`` to ``out_dir``.

    ``progress(stage, done_steps, total_steps)`` is called as training
    advances. Returns the dict written to ``results.json``: ``settings``,
    ``dense``, ``results`` (one entry per pruned model), ``checks`` (the
    demo's targets, each with ``passed``), ``errors`` (stages that failed;
    the others still ran), ``pretrained`` (the MiniLM-L6 one-shot figures, or
    why that stage was skipped), ``chosen_layers`` (the per-layer report of
    the chosen model), ``files`` and ``elapsed_s``.
    """
    settings = settings or DemoSettings()
    started = time.perf_counter()
    old_threads = torch.get_num_threads()
    torch.set_num_threads(settings.threads)
    try:
        run = DemoRun.start(settings, load_data(settings.seed), out_dir, progress)
        train_dense(run)
        for stage in (oneshot_magnitude, gradual, two_four, channels):
            stage(run)
        dense_row, rows = measure(run)
        checks = targets(run, dense_row, rows)
        pretrained = run.attempt("minilm_oneshot", lambda: minilm_oneshot(settings, run.stepper.stage))
        result: Dict[str, Any] = {
            "settings": asdict(settings),
            "dense": dense_row,
            "results": rows,
            "checks": checks,
            "errors": run.errors,
            "pretrained": pretrained,
            "chosen": None,
            "chosen_layers": None,
            "files": None,
            "threads": settings.threads,
            "elapsed_s": None,
        }
        write_files(run, rows, result, started)
        if progress:
            progress("done", run.stepper.total, run.stepper.total)
        return result
    finally:
        torch.set_num_threads(old_threads)
