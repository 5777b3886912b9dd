"""The end-to-end demo behind ``prunekit demo``: prune a small CNN on scikit-learn's digits.

:func:`run_demo` trains a small convolutional network dense on the 8x8 digit
images that ship with scikit-learn (no download), then prunes copies of it
side by side:

* global magnitude, one-shot (:func:`prunekit.global_unstructured`, no fine-tuning);
* gradual magnitude and gradual SNIP-momentum during fine-tuning
  (:func:`prunekit.training.prepare_pruning`, cubic schedule);
* 2:4 semi-structured, gradual magnitude;
* whole channels (:func:`prunekit.compact.prune_groups`), fine-tuned, then
  compacted into a smaller dense model (:func:`prunekit.compact.compact`).

For each model it measures sparsity, test accuracy, parameters, MACs, the size
of its compressed checkpoint (:func:`prunekit.sparse.save_compressed`) and its
median CPU latency, measured side by side with the dense model in one loop. It
writes the checkpoints, two PNG plots and ``results.json`` to the output
folder and returns the same figures as a dict. It logs and never prints; the
``prunekit demo`` command draws the table and the progress bar.

Example (a tiny run; the real one is ``prunekit demo``)::

    from prunekit.demo import DemoSettings, run_demo
    result = run_demo(DemoSettings.quick(), "demo-out")
    print(result["checks"])
"""

from __future__ import annotations

import copy
import logging
import math
import os
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import Tensor, nn

from .timing import interleaved_medians
from .io import write_json

__all__ = ["DemoSettings", "make_model", "load_data", "run_demo"]

logger = logging.getLogger(__name__)

Progress = Callable[[str, int, int], None]


@dataclass
class DemoSettings:
    """How long to train and what to compare. ``quick()`` is the ~30-second variant."""

    dense_epochs: int = 12
    finetune_epochs: int = 8
    levels: Tuple[float, ...] = (0.5, 0.8, 0.9)
    channel_amount: float = 0.5
    batch_size: int = 64
    lr: float = 3e-3
    finetune_lr: float = 1e-3
    prune_until: float = 0.6  # share of the fine-tuning steps over which the gradual schedule ramps
    latency_batch: int = 64
    latency_repeats: int = 100
    seed: int = 0
    threads: int = 1
    chosen: str = "gradual_magnitude_90"
    name: str = "full"

    @classmethod
    def quick(cls, **overrides: Any) -> "DemoSettings":
        """A short run (a few epochs, two sparsity levels): what the tests run."""
        base: Dict[str, Any] = dict(dense_epochs=5, finetune_epochs=2, levels=(0.5, 0.9), latency_repeats=15,
                                    name="quick")
        base.update(overrides)
        return cls(**base)

    def __post_init__(self) -> None:
        for key in ("dense_epochs", "finetune_epochs", "batch_size", "latency_batch", "latency_repeats", "threads"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"DemoSettings: {key}={v!r} must be an integer >= 1")
        self.levels = tuple(float(s) for s in self.levels)
        for s in self.levels:
            if not 0.0 < s < 1.0:
                raise ValueError(f"DemoSettings: sparsity level {s!r} must lie strictly between 0 and 1, e.g. 0.9")
        if not 0.0 < self.channel_amount < 1.0:
            raise ValueError(f"DemoSettings: channel_amount={self.channel_amount!r} must lie strictly between 0 and 1")
        if not 0.0 < self.prune_until <= 1.0:
            raise ValueError(f"DemoSettings: prune_until={self.prune_until!r} must lie in (0, 1]")


# ----------------------------------------------------------------------------- model and data
def make_model() -> nn.Module:
    """The demo's CNN for 1x8x8 digit images (about 227k parameters, 2.5M MACs per image).

    Example:
        >>> import torch
        >>> from prunekit.demo import make_model
        >>> make_model()(torch.zeros(2, 1, 8, 8)).shape
        torch.Size([2, 10])
    """
    return nn.Sequential(
        nn.Conv2d(1, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
        nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(64, 128, 3, padding=1), nn.BatchNorm2d(128), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(512, 256), nn.ReLU(), nn.Linear(256, 10),
    )


def load_data(seed: int = 0, test_fraction: float = 0.2) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """scikit-learn's digits as ``(x_train, y_train, x_test, y_test)``; images scaled to [-1, 1].

    The split is stratified by class and fixed by ``seed``.

    Example:
        >>> from prunekit.demo import load_data
        >>> xtr, ytr, xte, yte = load_data()
        >>> tuple(xtr.shape), tuple(xte.shape)
        ((1438, 1, 8, 8), (359, 1, 8, 8))
    """
    try:
        from sklearn.datasets import load_digits
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("the demo needs scikit-learn for its bundled digits data: pip install scikit-learn") from e
    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 8.0 - 1.0
    y = torch.tensor(digits.target, dtype=torch.long)
    g = torch.Generator().manual_seed(seed)
    train, test = [], []
    for c in range(10):
        idx = torch.nonzero(y == c).flatten()
        idx = idx[torch.randperm(idx.numel(), generator=g)]
        n_test = int(round(test_fraction * idx.numel()))
        test.append(idx[:n_test])
        train.append(idx[n_test:])
    tr, te = torch.cat(train), torch.cat(test)
    return x[tr], y[tr], x[te], y[te]


# ----------------------------------------------------------------------------- training
class _Stepper:
    """Counts training steps across the whole demo for the progress callback."""

    def __init__(self, total: int, progress: Optional[Progress]) -> None:
        self.total, self.done, self.progress, self.label = total, 0, progress, ""

    def stage(self, label: str) -> None:
        self.label = label
        logger.info("demo: %s", label)
        if self.progress:
            self.progress(label, self.done, self.total)

    def step(self) -> None:
        self.done += 1
        if self.progress and (self.done % 5 == 0 or self.done == self.total):
            self.progress(self.label, self.done, self.total)


def _train(model: nn.Module, data: Tuple[Tensor, ...], epochs: int, lr: float, settings: DemoSettings,
           stepper: _Stepper, seed: int, wire: Optional[Callable[[torch.optim.Optimizer, int], Any]] = None) -> Any:
    xtr, ytr = data[0], data[1]
    torch.manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-4)
    spe = math.ceil(len(xtr) / settings.batch_size)
    total = epochs * spe
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * min(s, total) / total)))
    hooks = wire(opt, total) if wire else None
    loss_fn = nn.CrossEntropyLoss()
    for _ in range(epochs):
        model.train()
        order = torch.randperm(len(xtr))
        for i in range(0, len(xtr), settings.batch_size):
            b = order[i:i + settings.batch_size]
            opt.zero_grad(set_to_none=True)
            loss_fn(model(xtr[b]), ytr[b]).backward()
            opt.step()
            sched.step()
            stepper.step()
    model.eval()
    return hooks


@torch.no_grad()
def _accuracy(model: nn.Module, x: Tensor, y: Tensor) -> float:
    model.eval()
    return float((model(x).argmax(dim=1) == y).float().mean())


def _bake(model: nn.Module) -> nn.Module:
    """A copy with every mask baked in (plain dense layers holding the zeros)."""
    import prunekit

    out = copy.deepcopy(model)
    for _, module, name in list(prunekit.iter_pruned(out)):
        prunekit.remove(module, name)
    return out


# ----------------------------------------------------------------------------- measuring
def _weights(model: nn.Module) -> Tuple[int, int]:
    from .report import model_report

    r = model_report(model)
    return r.numel_layers, r.nonzero_layers


def _effective_macs(model: nn.Module, x: Tensor) -> int:
    """MACs a kernel that skips zero weights would do (conv/linear only)."""
    total = [0]

    def hook(mod: nn.Module, inp: Any, out: Tensor) -> None:
        nnz = int((mod.weight != 0).sum())
        positions = out.numel() // out.shape[1] if out.dim() > 1 else 1
        total[0] += nnz * positions

    handles = [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, (nn.Conv2d, nn.Linear))]
    try:
        with torch.no_grad():
            model.eval()
            model(x)
    finally:
        for h in handles:
            h.remove()
    return total[0]


def _sizes(model: nn.Module, path: str) -> int:
    import prunekit
    from .sparse import save_compressed

    # the sign of a pruned zero carries no information: let every zero cost one bit
    save_compressed(prunekit.dense_state_dict(model), path, keep_zero_sign=False)
    return os.path.getsize(path)


def _dense_size(model: nn.Module, path: str) -> int:
    from .io import save_compressed

    save_compressed(model, path, format="safetensors")
    return os.path.getsize(path)


@torch.no_grad()
def _latencies(models: Dict[str, nn.Module], x: Tensor, repeats: int) -> Dict[str, float]:
    """Median milliseconds per forward, all models timed in one interleaved loop (prunekit.timing)."""
    for m in models.values():
        m.eval()
    medians = interleaved_medians([lambda m=m: m(x) for m in models.values()], repeats)
    return {k: s * 1e3 for k, s in zip(models, medians)}


# ----------------------------------------------------------------------------- the demo
def _gradual_config(prune_type: str, pattern: str, target: Optional[float], total_steps: int,
                    settings: DemoSettings, spe: int) -> Dict[str, Any]:
    end = max(1, int(settings.prune_until * total_steps))
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


def _pct(s: float) -> str:
    return f"{round(100 * s):d}"


def run_demo(settings: Optional[DemoSettings] = None, out_dir: str = "demo-out",
             progress: Optional[Progress] = None) -> Dict[str, Any]:
    """Run the whole comparison and write checkpoints, plots and ``results.json`` to ``out_dir``.

    ``progress(stage, done_steps, total_steps)`` is called as training
    advances. Returns the dict written to ``results.json``: ``settings``,
    ``dense``, ``results`` (one entry per pruned model), ``checks`` (the
    demo's targets, each with ``passed``), ``errors`` (stages that failed;
    the others still ran), ``chosen_layers`` (the per-layer
    report of the chosen model), ``files`` and ``elapsed_s``.
    """
    import prunekit
    from .compact import compact, count_macs, count_params, prune_groups
    from .report import model_report, plot_accuracy_vs_sparsity, plot_layer_sparsity
    from .training import prepare_pruning

    settings = settings or DemoSettings()
    started = time.perf_counter()
    os.makedirs(out_dir, exist_ok=True)
    ckpt_dir = os.path.join(out_dir, "checkpoints")
    os.makedirs(ckpt_dir, exist_ok=True)
    old_threads = torch.get_num_threads()
    torch.set_num_threads(settings.threads)
    try:
        data = load_data(settings.seed)
        xtr, ytr, xte, yte = data
        spe = math.ceil(len(xtr) / settings.batch_size)
        ft_steps = settings.finetune_epochs * spe
        n_finetunes = 2 * len(settings.levels) + 2
        stepper = _Stepper(settings.dense_epochs * spe + n_finetunes * ft_steps, progress)
        example = xte[:2]

        # ---- dense
        stepper.stage("training the dense model")
        torch.manual_seed(settings.seed)
        dense = make_model()
        _train(dense, data, settings.dense_epochs, settings.lr, settings, stepper, settings.seed)
        dense_acc = _accuracy(dense, xte, yte)
        dense_numel, _ = _weights(dense)
        dense_bytes = _dense_size(dense, os.path.join(ckpt_dir, "dense.safetensors"))
        logger.info("demo: dense accuracy %.4f", dense_acc)

        finals: Dict[str, nn.Module] = {}   # key -> model to evaluate/report (may carry masks)
        meta: Dict[str, Dict[str, Any]] = {}

        def record(key: str, method: str, target: Optional[float], model: nn.Module, note: str = "") -> None:
            finals[key] = model
            meta[key] = {"key": key, "method": method, "target": target, "note": note}

        # ---- one-shot global magnitude, no fine-tuning
        stepper.stage("one-shot global magnitude")
        for s in settings.levels:
            m = copy.deepcopy(dense)
            params = [(mod, "weight") for mod in m.modules() if isinstance(mod, (nn.Conv2d, nn.Linear))]
            prunekit.global_unstructured(params, pruning_method=prunekit.L1Unstructured, amount=s)
            record(f"oneshot_magnitude_{_pct(s)}", "one-shot global magnitude", s, m, "no fine-tuning")

        # ---- gradual pruning during fine-tuning
        for prune_type, label in (("magnitude", "gradual magnitude"), ("snip_momentum", "gradual snip-momentum")):
            for s in settings.levels:
                stepper.stage(f"{label} to {_pct(s)}%")
                m = copy.deepcopy(dense)
                cfg = _gradual_config(prune_type, "1x1", s, ft_steps, settings, spe)
                _train(m, data, settings.finetune_epochs, settings.finetune_lr, settings, stepper,
                       settings.seed + 1, wire=lambda opt, _t, m=m, cfg=cfg: prepare_pruning(m, cfg, opt))
                record(f"gradual_{prune_type}_{_pct(s)}", label, s, m)

        # ---- 2:4
        stepper.stage("2:4 gradual magnitude")
        m = copy.deepcopy(dense)
        cfg = _gradual_config("magnitude", "2:4", None, ft_steps, settings, spe)
        hooks = _train(m, data, settings.finetune_epochs, settings.finetune_lr, settings, stepper,
                       settings.seed + 1, wire=lambda opt, _t: prepare_pruning(m, cfg, opt))
        skipped = hooks.skipped if hooks is not None else {}
        record("nm_2_4", "2:4 (gradual magnitude)", 0.5, m,
               "; ".join(f"layer {n!r} left dense ({why})" for n, why in sorted(skipped.items())))

        # ---- channels + compaction
        stepper.stage(f"channel pruning {_pct(settings.channel_amount)}% + compaction")
        channel_key = f"channels_{_pct(settings.channel_amount)}_compacted"
        errors: List[Dict[str, str]] = []
        m = copy.deepcopy(dense)
        try:
            prune_groups(m, example, settings.channel_amount)
            _train(m, data, settings.finetune_epochs, settings.finetune_lr, settings, stepper, settings.seed + 1)
            masked_acc = _accuracy(m, xte, yte)
            small = compact(m, example)
        except Exception as e:  # report it in the results and go on with the other figures
            logger.warning("demo: channel pruning + compaction failed: %s: %s", type(e).__name__, e)
            errors.append({"stage": channel_key, "error": f"{type(e).__name__}: {e}"})
        else:
            record(channel_key, "channels + compact", settings.channel_amount, small,
                   f"masked model accuracy {100 * masked_acc:.2f}% before compaction")

        # ---- measure everything, latency side by side
        stepper.stage("measuring latency, size, MACs")
        deploy = {"dense": dense}
        deploy.update({k: _bake(v) for k, v in finals.items()})
        xl = xte[: settings.latency_batch]
        lat = _latencies(deploy, xl, settings.latency_repeats)
        dense_macs = count_macs(dense, example) // example.shape[0]

        dense_row = {
            "key": "dense", "method": "dense", "target": 0.0, "sparsity": 0.0, "accuracy": dense_acc,
            "params": count_params(dense), "nonzero_params": count_params(dense), "macs": dense_macs,
            "effective_macs": _effective_macs(dense, example) // example.shape[0], "size_bytes": dense_bytes,
            "size_ratio": 1.0, "latency_ms": lat["dense"], "speedup": 1.0, "note": "",
        }
        rows: List[Dict[str, Any]] = []
        for key, model in finals.items():
            numel, nonzero = _weights(model)
            baked = deploy[key]
            size = _sizes(model, os.path.join(ckpt_dir, f"{key}.safetensors"))
            rows.append({
                **meta[key],
                "sparsity": 1 - nonzero / dense_numel,
                "accuracy": _accuracy(model, xte, yte),
                "params": count_params(baked),
                "nonzero_params": sum(int((p != 0).sum()) for p in baked.parameters()),
                "macs": count_macs(baked, example) // example.shape[0],
                "effective_macs": _effective_macs(baked, example) // example.shape[0],
                "size_bytes": size,
                "size_ratio": size / dense_bytes,
                "latency_ms": lat[key],
                "speedup": lat["dense"] / lat[key] if lat[key] > 0 else float("nan"),
            })
        by_key = {r["key"]: r for r in rows}

        # ---- the demo's targets
        checks = []
        top = max(settings.levels)
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
        c = by_key.get(channel_key)
        checks.append({
            "name": "compacted model measurably faster than dense (>= 1.2x, median latency)",
            "passed": c is not None and c["speedup"] >= 1.2,
            "detail": (f"dense {lat['dense']:.3f} ms, compacted {c['latency_ms']:.3f} ms per batch of "
                       f"{len(xl)} ({c['speedup']:.2f}x)") if c is not None else
                      f"no compacted model: {errors[0]['error'] if errors else 'not run'}",
        })

        # ---- report of the chosen model, plots, json
        chosen = settings.chosen if settings.chosen in finals else f"gradual_magnitude_{_pct(top)}"
        chosen_report = model_report(finals[chosen])
        files = {
            "accuracy_plot": plot_accuracy_vs_sparsity(
                [r for r in rows], os.path.join(out_dir, "accuracy_vs_sparsity.png"), dense_accuracy=dense_acc,
                title="digits CNN: test accuracy against sparsity"),
            "layers_plot": plot_layer_sparsity(
                chosen_report, os.path.join(out_dir, "layer_sparsity.png"),
                title=f"per-layer sparsity of {chosen}"),
            "json": os.path.join(out_dir, "results.json"),
            "checkpoints": ckpt_dir,
        }
        result = {
            "settings": asdict(settings),
            "dense": dense_row,
            "results": rows,
            "checks": checks,
            "errors": errors,
            "chosen": chosen,
            "chosen_layers": chosen_report.to_dict(),
            "files": files,
            "threads": settings.threads,
            "elapsed_s": time.perf_counter() - started,
        }
        write_json(files["json"], result)
        if progress:
            progress("done", stepper.total, stepper.total)
        return result
    finally:
        torch.set_num_threads(old_threads)
