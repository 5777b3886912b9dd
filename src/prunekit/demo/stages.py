"""The digits stages of the demo, one function each, sharing one :class:`DemoRun`.

Order (what :func:`prunekit.demo.run_demo` calls): :func:`train_dense`, then the
pruning stages :func:`oneshot_magnitude`, :func:`gradual`, :func:`two_four` and
:func:`channels` (each adds its models to ``run.finals``; a pruning stage that fails
is recorded in ``run.errors`` and the others still run), then :func:`measure`,
:func:`targets` and :func:`write_files`.
"""

from __future__ import annotations

import copy
import logging
import math
import os
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import Tensor, nn

from ..io import write_json
from ..timing import interleaved_medians
from .digits import Progress, Stepper, accuracy, bake, make_model, train
from .settings import DemoSettings

__all__ = ["DemoRun", "channel_key", "channels", "gradual", "measure", "oneshot_magnitude", "targets", "train_dense",
           "two_four", "write_files"]

logger = logging.getLogger(__name__)


def _pct(s: float) -> str:
    return f"{round(100 * s):d}"


@dataclass
class DemoRun:
    """What the stages share: settings, data, folders, the dense model and the pruned models so far.

    Example (random images standing in for the digits, one epoch):
        >>> import tempfile, torch
        >>> from prunekit.demo import DemoSettings
        >>> from prunekit.demo.stages import DemoRun, oneshot_magnitude, train_dense
        >>> x, y = torch.randn(96, 1, 8, 8, generator=torch.Generator().manual_seed(0)), torch.arange(96) % 10
        >>> run = DemoRun.start(DemoSettings(dense_epochs=1, levels=(0.5, 0.9)), (x[:64], y[:64], x[64:], y[64:]),
        ...                     tempfile.mkdtemp(), None)
        >>> train_dense(run); oneshot_magnitude(run)
        >>> list(run.finals), run.errors
        (['oneshot_magnitude_50', 'oneshot_magnitude_90'], [])
    """

    settings: DemoSettings
    data: Tuple[Tensor, Tensor, Tensor, Tensor]
    out_dir: str
    stepper: Stepper
    dense: Optional[nn.Module] = None
    dense_accuracy: float = 0.0
    dense_bytes: int = 0
    finals: Dict[str, nn.Module] = field(default_factory=dict)  # key -> model to evaluate/report (may carry masks)
    meta: Dict[str, Dict[str, Any]] = field(default_factory=dict)
    errors: List[Dict[str, str]] = field(default_factory=list)

    @classmethod
    def start(cls, settings: DemoSettings, data: Tuple[Tensor, Tensor, Tensor, Tensor], out_dir: str,
              progress: Optional[Progress]) -> "DemoRun":
        """Make the output folders and count every training step the stages will take."""
        os.makedirs(os.path.join(out_dir, "checkpoints"), exist_ok=True)
        spe = math.ceil(len(data[0]) / settings.batch_size)
        n_finetunes = 2 * len(settings.levels) + 2
        total = settings.dense_epochs * spe + n_finetunes * settings.finetune_epochs * spe
        return cls(settings, data, out_dir, Stepper(total, progress))

    @property
    def ckpt_dir(self) -> str:
        return os.path.join(self.out_dir, "checkpoints")

    @property
    def steps_per_epoch(self) -> int:
        return math.ceil(len(self.data[0]) / self.settings.batch_size)

    @property
    def trained(self) -> nn.Module:
        """The dense model :func:`train_dense` trained: the starting point of every other stage."""
        if self.dense is None:
            raise ValueError("demo: no dense model yet; run the train_dense stage first")
        return self.dense

    @property
    def example(self) -> Tensor:
        """Two test images: the example input of tracing and MAC counting."""
        return self.data[2][:2]

    def record(self, key: str, method: str, target: Optional[float], model: nn.Module, note: str = "") -> None:
        """Add a pruned model to the comparison."""
        self.finals[key] = model
        self.meta[key] = {"key": key, "method": method, "target": target, "note": note}

    def attempt(self, key: str, fn: Callable[[], Any]) -> Any:
        """Run one pruning stage's ``fn``; a failure is logged and kept in ``errors`` (the other stages still run)."""
        try:
            return fn()
        except Exception as e:  # report it in the results and go on with the other figures
            logger.warning("demo: stage %s failed: %s: %s", key, type(e).__name__, e)
            self.errors.append({"stage": key, "error": f"{type(e).__name__}: {e}"})
            return None

    def finetune(self, model: nn.Module, wire: Optional[Callable[[torch.optim.Optimizer, int], Any]] = None) -> Any:
        """Fine-tune ``model`` as every pruning stage does (``wire`` attaches a pruner); returns what it returned."""
        s = self.settings
        return train(model, self.data, s.finetune_epochs, s.finetune_lr, s, self.stepper, s.seed + 1, wire=wire)


def _gradual_config(run: DemoRun, prune_type: str, pattern: str, target: Optional[float]) -> Dict[str, Any]:
    spe = run.steps_per_epoch
    end = max(1, int(run.settings.prune_until * run.settings.finetune_epochs * spe))
    cfg: Dict[str, Any] = {
        "prune_type": prune_type,
        "pattern": pattern,
        "start_step": 0,
        "end_step": end,
        "update_frequency_on_step": max(1, min(spe // 2, end // 4)),
        "sparsity_decay_type": "cube",
        "prune_domain": "global",
    }
    if target is not None:
        cfg["target_sparsity"] = target
    return cfg


# ----------------------------------------------------------------------------- the stages
def train_dense(run: DemoRun) -> None:
    """Train the dense CNN; keep its test accuracy and the size of its plain safetensors checkpoint."""
    from ..io import save_compressed

    s = run.settings
    run.stepper.stage("training the dense model")
    torch.manual_seed(s.seed)
    dense = make_model()
    train(dense, run.data, s.dense_epochs, s.lr, s, run.stepper, s.seed)
    run.dense = dense
    run.dense_accuracy = accuracy(dense, run.data[2], run.data[3])
    path = os.path.join(run.ckpt_dir, "dense.safetensors")
    save_compressed(dense, path, format="safetensors")
    run.dense_bytes = os.path.getsize(path)
    logger.info("demo: dense accuracy %.4f", run.dense_accuracy)


def oneshot_magnitude(run: DemoRun) -> None:
    """Global magnitude pruning of every conv/linear weight at each level, no fine-tuning."""
    from .. import L1Unstructured, global_unstructured

    run.stepper.stage("one-shot global magnitude")
    for s in run.settings.levels:
        key = f"oneshot_magnitude_{_pct(s)}"

        def one(s: float = s, key: str = key) -> None:
            m = copy.deepcopy(run.trained)
            params = [(mod, "weight") for mod in m.modules() if isinstance(mod, (nn.Conv2d, nn.Linear))]
            global_unstructured(params, pruning_method=L1Unstructured, amount=s)
            run.record(key, "one-shot global magnitude", s, m, "no fine-tuning")

        run.attempt(key, one)


def gradual(run: DemoRun) -> None:
    """Gradual magnitude and SNIP-momentum pruning during fine-tuning, to each level (cubic schedule)."""
    from ..training import prepare_pruning

    for prune_type, label in (("magnitude", "gradual magnitude"), ("snip_momentum", "gradual snip-momentum")):
        for s in run.settings.levels:
            key = f"gradual_{prune_type}_{_pct(s)}"

            def one(s: float = s, key: str = key, prune_type: str = prune_type, label: str = label) -> None:
                run.stepper.stage(f"{label} to {_pct(s)}%")
                m = copy.deepcopy(run.trained)
                cfg = _gradual_config(run, prune_type, "1x1", s)
                run.finetune(m, wire=lambda opt, _t: prepare_pruning(m, cfg, opt))
                run.record(key, label, s, m)

            run.attempt(key, one)


def two_four(run: DemoRun) -> None:
    """2:4 semi-structured sparsity, gradual magnitude during fine-tuning (layers it cannot fit stay dense)."""
    from ..training import prepare_pruning

    def one() -> None:
        run.stepper.stage("2:4 gradual magnitude")
        m = copy.deepcopy(run.trained)
        cfg = _gradual_config(run, "magnitude", "2:4", None)
        hooks = run.finetune(m, wire=lambda opt, _t: prepare_pruning(m, cfg, opt))
        skipped = hooks.skipped if hooks is not None else {}
        run.record("nm_2_4", "2:4 (gradual magnitude)", 0.5, m,
                   "; ".join(f"layer {n!r} left dense ({why})" for n, why in sorted(skipped.items())))

    run.attempt("nm_2_4", one)


def channel_key(settings: DemoSettings) -> str:
    """The results key of the channel-pruned, compacted model.

    Examples:
        >>> from prunekit.demo import DemoSettings
        >>> from prunekit.demo.stages import channel_key
        >>> channel_key(DemoSettings(channel_amount=0.5))
        'channels_50_compacted'
    """
    return f"channels_{_pct(settings.channel_amount)}_compacted"


def channels(run: DemoRun) -> None:
    """Whole channels pruned (:func:`prunekit.compact.prune_groups`), fine-tuned, then compacted."""
    from .. import compact as compaction  # looked up at call time: the package's own compact()

    s = run.settings
    key = channel_key(s)

    def one() -> None:
        run.stepper.stage(f"channel pruning {_pct(s.channel_amount)}% + compaction")
        m = copy.deepcopy(run.trained)
        compaction.prune_groups(m, run.example, s.channel_amount)
        run.finetune(m)
        masked_acc = accuracy(m, run.data[2], run.data[3])
        small = compaction.compact(m, run.example)
        run.record(key, "channels + compact", s.channel_amount, small,
                   f"masked model accuracy {100 * masked_acc:.2f}% before compaction")

    run.attempt(key, one)


# ----------------------------------------------------------------------------- measuring
@torch.no_grad()
def _latencies(models: Dict[str, nn.Module], x: Tensor, repeats: int) -> Dict[str, float]:
    """Median milliseconds per forward, all models timed in one interleaved loop (prunekit.timing)."""
    for m in models.values():
        m.eval()
    medians = interleaved_medians([partial(m, x) for m in models.values()], repeats)
    return {k: s * 1e3 for k, s in zip(models, medians)}


def _compressed_size(model: nn.Module, path: str) -> int:
    from .. import dense_state_dict
    from ..sparse import save_compressed

    # the sign of a pruned zero carries no information: let every zero cost one bit
    save_compressed(dense_state_dict(model), path, keep_zero_sign=False)
    return os.path.getsize(path)


def _row(run: DemoRun, model: nn.Module, baked: nn.Module) -> Dict[str, Any]:
    """The figures every model shares: accuracy, parameters, MACs per image (all and non-zero only)."""
    from ..compact import count_macs, count_params
    from ..report import model_report

    x = run.example
    return {
        "accuracy": accuracy(model, run.data[2], run.data[3]),
        "params": count_params(baked),
        "nonzero_params": model_report(baked).nonzero_all,  # every parameter, counted as every report counts
        "macs": count_macs(baked, x) // x.shape[0],
        "effective_macs": count_macs(baked, x, effective=True) // x.shape[0],
    }


def measure(run: DemoRun) -> Tuple[Dict[str, Any], List[Dict[str, Any]]]:
    """``(dense row, one row per pruned model)``: sparsity, accuracy, size, MACs, latency side by side."""
    from ..report import model_report

    s = run.settings
    run.stepper.stage("measuring latency, size, MACs")
    dense = run.trained
    deploy = {"dense": dense}
    deploy.update({k: bake(v) for k, v in run.finals.items()})
    lat = _latencies(deploy, run.data[2][: s.latency_batch], s.latency_repeats)
    dense_numel = model_report(dense).numel_layers
    dense_row = {"key": "dense", "method": "dense", "target": 0.0, "sparsity": 0.0,
                 **_row(run, dense, dense), "size_bytes": run.dense_bytes, "size_ratio": 1.0,
                 "latency_ms": lat["dense"], "speedup": 1.0, "note": ""}
    rows: List[Dict[str, Any]] = []
    for key, model in run.finals.items():
        size = _compressed_size(model, os.path.join(run.ckpt_dir, f"{key}.safetensors"))
        rows.append({
            **run.meta[key],
            "sparsity": 1 - model_report(model).nonzero_layers / dense_numel,
            **_row(run, model, deploy[key]),
            "size_bytes": size,
            "size_ratio": size / run.dense_bytes,
            "latency_ms": lat[key],
            "speedup": lat["dense"] / lat[key] if lat[key] > 0 else float("nan"),
        })
    return dense_row, rows


def targets(run: DemoRun, dense_row: Dict[str, Any], rows: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """The demo's targets, each ``{"name", "passed", "detail"}``, judged on the measured rows."""
    s = run.settings
    by_key = {r["key"]: r for r in rows}
    dense_acc, dense_bytes = run.dense_accuracy, run.dense_bytes
    checks = []
    top = max(s.levels)
    g = by_key.get(f"gradual_magnitude_{_pct(top)}")
    if g is not None:
        drop = dense_acc - g["accuracy"]
        checks.append({
            "name": f"gradual magnitude at {_pct(top)}% within 1 point of dense accuracy",
            "passed": drop <= 0.01 + 1e-9,
            "detail": f"dense {100 * dense_acc:.2f}%, pruned {100 * g['accuracy']:.2f}% "
                      f"({-100 * drop:+.2f} points)",
        })
        checks.append({
            "name": f"compressed checkpoint at {_pct(top)}% sparsity under 0.15x the dense size",
            "passed": g["size_ratio"] < 0.15,
            "detail": f"{g['size_bytes']} bytes vs dense {dense_bytes} bytes ({g['size_ratio']:.3f}x)",
        })
    key = channel_key(s)
    c = by_key.get(key)
    failed = [e["error"] for e in run.errors if e["stage"] == key]
    n = min(s.latency_batch, len(run.data[2]))
    checks.append({
        "name": "compacted model measurably faster than dense (>= 1.2x, median latency)",
        "passed": c is not None and c["speedup"] >= 1.2,
        "detail": (f"dense {dense_row['latency_ms']:.3f} ms, compacted {c['latency_ms']:.3f} ms per batch of "
                   f"{n} ({c['speedup']:.2f}x)") if c is not None else
                  f"no compacted model: {failed[0] if failed else 'not run'}",
    })
    return checks


def write_files(run: DemoRun, rows: List[Dict[str, Any]], result: Dict[str, Any], started: float) -> Dict[str, Any]:
    """Draw the plots, then write ``result`` to results.json with ``chosen``, ``chosen_layers``, ``files``
    and ``elapsed_s`` (seconds since ``started``, a ``time.perf_counter()``) filled in.

    The plots: accuracy against sparsity, the chosen model's layers, and (when ``result["pretrained"]`` has
    rows) the MiniLM-L6 mean cosines per method and pattern (``minilm_oneshot.png``).
    """
    from ..report import model_report, plot_accuracy_vs_sparsity, plot_grouped_bars, plot_layer_sparsity

    s = run.settings
    fallback = f"gradual_magnitude_{_pct(max(s.levels))}"
    chosen = s.chosen if s.chosen in run.finals else fallback
    chosen_report = model_report(run.finals[chosen]) if chosen in run.finals else None
    files = {
        "accuracy_plot": plot_accuracy_vs_sparsity(
            list(rows), os.path.join(run.out_dir, "accuracy_vs_sparsity.png"), dense_accuracy=run.dense_accuracy,
            title="digits CNN: test accuracy against sparsity"),
        "layers_plot": plot_layer_sparsity(
            chosen_report, os.path.join(run.out_dir, "layer_sparsity.png"),
            title=f"per-layer sparsity of {chosen}") if chosen_report is not None else None,
        "json": os.path.join(run.out_dir, "results.json"),
        "checkpoints": run.ckpt_dir,
    }
    pretrained = result.get("pretrained") or {}
    if pretrained.get("rows"):
        files["pretrained_plot"] = plot_grouped_bars(
            pretrained["rows"], os.path.join(run.out_dir, "minilm_oneshot.png"), group="pattern", series="label",
            value="cosine", ylabel="mean cosine to the dense embeddings", reference=1.0,
            title=f"MiniLM-L6 one-shot from {pretrained['calibration_sentences']} sentences (dense = 1.0)")
    result.update(chosen=chosen, chosen_layers=chosen_report.to_dict() if chosen_report is not None else None,
                  files=files, elapsed_s=time.perf_counter() - started)
    write_json(files["json"], result)
    return result
