"""prunekit against torch.nn.utils.prune, side by side, in one run.

Every measurement runs in a fresh interpreter (a child process of the same
Python), so one library's allocations, caches and thread pools never colour the
other's numbers. Runs alternate between the libraries (A B, B A, A B, ...).
The parent prints the median of each metric over the runs and the ratio
torch / prunekit (above 1 means prunekit is faster or leaner).

Because prunekit is API-identical, one piece of case code serves both
libraries: it receives the module ``prune`` (``prunekit`` or
``torch.nn.utils.prune``) and calls ``prune.l1_unstructured(...)`` etc.

Usage::

    python benchmarks/bench_core.py                 # all cases, table on stdout
    python benchmarks/bench_core.py --quick         # smoke run (2 runs, fewer iterations)
    python benchmarks/bench_core.py --json          # the same, as JSON on stdout
    python benchmarks/bench_core.py --cases forward_nograd,bytes_held
    python benchmarks/bench_core.py --libs torch,torch   # harness check without prunekit
    # one measurement in this process (what the parent runs in each child):
    python benchmarks/bench_core.py --case l1_unstructured --lib prunekit --json
    # ... with a cProfile / torch.profiler listing of the measured call on stderr:
    python benchmarks/bench_core.py --case global_unstructured --lib prunekit --profile

Cases live in the ``CASES`` dictionary at the bottom; add one by writing a
child function and registering a :class:`Case` (see the docstring there).
"""

from __future__ import annotations

import argparse
import copy
import gc
import importlib
import json
import os
import platform
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from _harness import (  # noqa: E402
    MIB,
    MemoryMeter,
    fmt,
    median,
    reachable_storage_bytes,
    run_child,
    table,
)

# ============================================================================ libraries


def load_lib(name: str):
    """The pruning module for a library name: ``prunekit`` or ``torch``."""
    if name == "torch":
        return importlib.import_module("torch.nn.utils.prune")
    if name == "prunekit":
        try:
            return importlib.import_module("prunekit")
        except ModuleNotFoundError:
            # Not installed into the interpreter: use the source tree next to us.
            sys.path.insert(0, str(HERE.parent / "src"))
            return importlib.import_module("prunekit")
    return importlib.import_module(name)  # e.g. a future tensorplay adapter


@dataclass
class Ctx:
    """What a child measurement gets besides the pruning module."""

    lib: str
    option: str = ""
    quick: bool = False
    profile: bool = False
    torch_profile: bool = False

    def measure(self, fn: Callable[[], Any]) -> float:
        """Run ``fn`` once and return its wall time in seconds (profiled if asked)."""
        if self.profile:
            import cProfile
            import pstats

            prof = cProfile.Profile()
            t0 = time.perf_counter()
            prof.runcall(fn)
            dt = time.perf_counter() - t0
            print(f"--- cProfile of the measured call ({self.lib}) ---", file=sys.stderr)
            pstats.Stats(prof, stream=sys.stderr).sort_stats("cumulative").print_stats(30)
            return dt
        if self.torch_profile:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
                t0 = time.perf_counter()
                fn()
                dt = time.perf_counter() - t0
            print(f"--- torch.profiler of the measured call ({self.lib}) ---", file=sys.stderr)
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25),
                  file=sys.stderr)
            return dt
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0


def _seeded_linear(n_in: int = 4096, n_out: int = 4096, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(n_in, n_out)


def _weight_bytes(modules: list[nn.Module]) -> int:
    total = 0
    for m in modules:
        w = m.weight_orig if hasattr(m, "weight_orig") else m.weight
        total += w.numel() * w.element_size()
    return total


def _mask_of(module: nn.Module) -> torch.Tensor:
    return module.weight_mask != 0


def _warm_up(prune, method: str) -> None:
    """One tiny call of the same API, so lazy imports / thread pools are not timed."""
    torch.manual_seed(123)
    small = [nn.Linear(64, 64), nn.Linear(64, 64)]
    if method == "global":
        prune.global_unstructured([(m, "weight") for m in small],
                                  pruning_method=prune.L1Unstructured, amount=0.5)
    elif method == "ln":
        prune.ln_structured(small[0], "weight", amount=0.5, n=2, dim=0)
    else:
        prune.l1_unstructured(small[0], "weight", amount=0.5)


# ============================================================================ model shapes


def resnet50_weight_shapes() -> list[tuple[int, ...]]:
    """Weight shapes of torchvision's ResNet-50 convolutions and its fc layer (no BN).

    >>> shapes = resnet50_weight_shapes()
    >>> len(shapes), sum(torch.Size(s).numel() for s in shapes)
    (54, 25502912)
    """
    shapes: list[tuple[int, ...]] = [(64, 3, 7, 7)]
    inplanes = 64
    for planes, blocks in [(64, 3), (128, 4), (256, 6), (512, 3)]:
        for b in range(blocks):
            shapes += [(planes, inplanes, 1, 1), (planes, planes, 3, 3), (planes * 4, planes, 1, 1)]
            if b == 0:
                shapes.append((planes * 4, inplanes, 1, 1))  # downsample
            inplanes = planes * 4
    shapes.append((1000, 2048))
    return shapes


def build_stack(shapes: list[tuple[int, ...]], seed: int = 0) -> nn.ModuleList:
    """Conv2d / Linear layers (bias-free convs, as in ResNet) with the given weight shapes."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for s in shapes:
        if len(s) == 4:
            layers.append(nn.Conv2d(s[1], s[0], kernel_size=s[2:], bias=False))
        else:
            layers.append(nn.Linear(s[1], s[0]))
    for m in layers:  # distinct values (no ties) for a well-defined L1 selection
        with torch.no_grad():
            m.weight.normal_()
    return nn.ModuleList(layers)


SMALL_STACK_SHAPES = [(1024, 1024)] * 4 + [(256, 256, 3, 3)] * 2  # 5.4 M weights


# ============================================================================ child cases
# Each takes (prune, ctx) and returns a flat dict of numbers (or None for n/a).


def case_l1_unstructured(prune, ctx: Ctx) -> dict:
    _warm_up(prune, "l1")
    m = _seeded_linear()
    gc.collect()
    t = ctx.measure(lambda: prune.l1_unstructured(m, "weight", amount=0.5))
    pruned = int((~_mask_of(m)).sum())
    return {"time_s": t, "ok": pruned == 4096 * 4096 // 2}


def case_global_unstructured(prune, ctx: Ctx) -> dict:
    _warm_up(prune, "global")
    stack = build_stack(resnet50_weight_shapes())
    params = [(m, "weight") for m in stack]
    wbytes = _weight_bytes(list(stack))
    n = sum(m.weight.numel() for m in stack)
    held_before = reachable_storage_bytes(stack)
    kwargs: dict[str, Any] = {"mask_dtype": torch.bool} if ctx.option == "lean" else {}
    meter = MemoryMeter()
    try:
        with meter:
            t = ctx.measure(lambda: prune.global_unstructured(
                params, pruning_method=prune.L1Unstructured, amount=0.8, **kwargs))
    except TypeError as exc:
        return {"note": f"n/a ({type(exc).__name__}: {str(exc)[:60]})"}
    held_after = reachable_storage_bytes(stack)
    pruned = sum(int((~_mask_of(m)).sum()) for m in stack)
    return {
        "time_s": t,
        "peak_extra_x": meter.peak_extra / wbytes,
        "retained_x": meter.retained / wbytes,
        "workspace_x": (meter.peak_extra - meter.retained) / wbytes,
        "held_extra_x": (held_after - held_before) / wbytes,
        "weights_MB": wbytes / MIB,
        "rss_method": meter.method,
        "ok": pruned == round(0.8 * n),
    }


def case_ln_structured(prune, ctx: Ctx) -> dict:
    _warm_up(prune, "ln")
    m = _seeded_linear()
    gc.collect()
    t = ctx.measure(lambda: prune.ln_structured(m, "weight", amount=0.5, n=2, dim=0))
    rows_pruned = int((~_mask_of(m)).all(dim=1).sum())
    return {"time_s": t, "ok": rows_pruned == 2048}


def case_forward_nograd(prune, ctx: Ctx) -> dict:
    dense = _seeded_linear()
    pruned = copy.deepcopy(dense)
    prune.l1_unstructured(pruned, "weight", amount=0.5)
    torch.manual_seed(1)
    x = torch.randn(8, 4096)
    warm, rounds, inner = (3, 6, 2) if ctx.quick else (6, 12, 3)
    per_call: dict[str, list[float]] = {"dense": [], "pruned": []}
    with torch.no_grad():
        expected = nn.functional.linear(x, pruned.weight_orig * pruned.weight_mask.to(x.dtype),
                                        pruned.bias)
        ok = bool(torch.allclose(pruned(x), expected, rtol=1e-5, atol=1e-5))
        for _ in range(warm):
            dense(x)
            pruned(x)
        for r in range(rounds):
            order = [("dense", dense), ("pruned", pruned)]
            for name, mod in order if r % 2 == 0 else order[::-1]:
                t0 = time.perf_counter()
                for _ in range(inner):
                    mod(x)
                per_call[name].append((time.perf_counter() - t0) / inner)
        if ctx.profile or ctx.torch_profile:
            ctx.measure(lambda: [pruned(x) for _ in range(inner)])
    d, p = median(per_call["dense"]), median(per_call["pruned"])
    return {"dense_ms": d * 1e3, "pruned_ms": p * 1e3, "pruned_over_dense": p / d, "ok": ok}


def case_bytes_held(prune, ctx: Ctx) -> dict:
    m = _seeded_linear()
    wbytes = _weight_bytes([m])
    dense_bytes = reachable_storage_bytes(m)
    kwargs: dict[str, Any] = {}
    if ctx.option == "lean":
        kwargs["mask_dtype"] = torch.bool
    try:
        prune.l1_unstructured(m, "weight", amount=0.5, **kwargs)
    except TypeError as exc:
        return {"after_prune_MB": None, "after_forward_MB": None,
                "after_prune_x": None, "after_forward_x": None,
                "note": f"n/a ({type(exc).__name__}: {str(exc)[:60]})"}
    gc.collect()
    after_prune = reachable_storage_bytes(m)
    with torch.no_grad():
        m(torch.randn(8, 4096))
    gc.collect()
    after_fwd = reachable_storage_bytes(m)
    return {
        "dense_MB": dense_bytes / MIB,
        "after_prune_MB": after_prune / MIB,
        "after_forward_MB": after_fwd / MIB,
        "after_prune_x": after_prune / wbytes,
        "after_forward_x": after_fwd / wbytes,
        "mask_dtype": str(m.weight_mask.dtype),
    }


def case_repeated_global(prune, ctx: Ctx) -> dict:
    _warm_up(prune, "global")
    stack = build_stack(SMALL_STACK_SHAPES)
    params = [(m, "weight") for m in stack]
    wbytes = _weight_bytes(list(stack))
    out: dict[str, Any] = {"weights_MB": wbytes / MIB}
    meter0 = MemoryMeter()
    with meter0:
        pass
    rss0 = meter0.after
    held0 = reachable_storage_bytes(stack)
    for k in range(1, 6):
        prune.global_unstructured(params, pruning_method=prune.L1Unstructured, amount=0.2)
        gc.collect()
        out[f"held_x_{k}"] = (reachable_storage_bytes(stack) - held0) / wbytes
        m = MemoryMeter()
        with m:
            pass
        out[f"rss_x_{k}"] = (m.after - rss0) / wbytes
    out["held_growth_x"] = out["held_x_5"] - out["held_x_1"]
    out["rss_growth_x"] = out["rss_x_5"] - out["rss_x_1"]
    remaining = sum(int(_mask_of(m).sum()) for m in stack)
    n = sum(m.weight.numel() for m in stack)
    expected = n
    for _ in range(5):
        expected -= round(0.2 * expected)
    out["ok"] = remaining == expected
    return out


def case_tensorplay(prune, ctx: Ctx) -> dict:
    """prunekit on a ``tensorplay.nn.Linear(4096, 4096)`` (option ``tensorplay``) or on the
    same ``torch.nn.Linear`` (option ``torch``): l1_unstructured 0.5 and ln_structured 0.5, n=2."""
    if ctx.option == "tensorplay":
        try:
            import tensorplay as tp
        except ImportError:
            return {"note": "n/a (tensorplay is not installed)"}

        def make():
            return tp.from_dlpack(_seeded_linear().weight.detach().clone())

        def module():
            m = tp.nn.Linear(4096, 4096)
            with tp.no_grad():
                m.weight.copy_(make())
            return m

        warm = tp.nn.Linear(64, 64)
        prune.l1_unstructured(warm, "weight", amount=0.5)
        prune.ln_structured(warm, "weight", amount=0.5, n=2, dim=0)
    else:
        module = _seeded_linear
        _warm_up(prune, "l1")
        _warm_up(prune, "ln")
    a, b = module(), module()
    gc.collect()
    t_l1 = ctx.measure(lambda: prune.l1_unstructured(a, "weight", amount=0.5))
    t_ln = ctx.measure(lambda: prune.ln_structured(b, "weight", amount=0.5, n=2, dim=0))
    ok = int((a.weight_mask == 0).sum()) == 4096 * 4096 // 2 and int((b.weight_mask.sum(1) == 0).sum()) == 2048
    return {"l1_s": t_l1, "ln_s": t_ln, "ok": ok}


def _tensorplay_variants(cand: str, ref: str) -> list[tuple[str, str, str]]:
    return [(f"{cand} tensorplay", cand, "tensorplay"), (f"{cand} torch", cand, "torch")]


def _tensorplay_report(s: Summary) -> str:
    tpl, tch = _tensorplay_variants(s.cand, s.ref)[0][0], _tensorplay_variants(s.cand, s.ref)[1][0]
    rows = []
    for key, what in (("l1_s", "l1_unstructured"), ("ln_s", "ln_structured")):
        a, b = s.med(tpl, key), s.med(tch, key)
        rows.append([what, "s", a, b, None if not a or b is None else a / b])
    text = table(["call", "unit", f"{tpl} (median)", f"{tch} (median)", "tensorplay/torch"], rows)
    notes = [f"   {lab}: {s.first(lab, 'note')}" for lab in (tpl, tch) if s.first(lab, "note")]
    return "\n".join([text] + notes)


# ============================================================================ case registry


@dataclass
class Case:
    """One benchmark.

    ``child(prune, ctx) -> dict`` runs in a fresh process and returns flat
    metrics. ``metrics`` lists the ones shown in the table as
    ``(key, unit, lower_is_better)``. ``variants`` returns the (label, lib,
    option) triples to run, given the candidate and reference library names;
    by default the two libraries themselves. ``report`` (optional) replaces the
    default table; ``checks`` returns (what, value, target text, passed) rows.
    ``env`` is extra environment for the child.
    """

    child: Callable[[Any, Ctx], dict]
    title: str
    metrics: list[tuple[str, str, bool]] = field(default_factory=list)
    variants: Callable[[str, str], list[tuple[str, str, str]]] | None = None
    report: Callable[["Summary"], str] | None = None
    checks: Callable[["Summary"], list[tuple[str, Any, str, bool]]] | None = None
    env: dict[str, str] = field(default_factory=dict)
    runs: int | None = None  # override of --runs for deterministic cases


@dataclass
class Summary:
    name: str
    case: Case
    cand: str  # label of the candidate (prunekit)
    ref: str  # label of the reference (torch)
    runs: dict[str, list[dict]]

    def med(self, label: str, key: str) -> float | None:
        vals = [r[key] for r in self.runs.get(label, [])
                if "error" not in r and isinstance(r.get(key), (int, float))
                and not isinstance(r.get(key), bool)]
        return median(vals) if vals else None

    def first(self, label: str, key: str) -> Any:
        for r in self.runs.get(label, []):
            if key in r:
                return r[key]
        return None

    def ratio(self, key: str) -> float | None:
        a, b = self.med(self.ref, key), self.med(self.cand, key)
        if a is None or b is None or b == 0:
            return None
        return a / b


def _default_report(s: Summary) -> str:
    labels = [s.cand, s.ref] + [lab for lab in s.runs if lab not in (s.cand, s.ref)]
    others = [lab for lab in labels if lab != s.ref]
    rows = []
    for key, unit, _lower in s.case.metrics:
        ref = s.med(s.ref, key)
        row = [key, unit] + [s.med(lab, key) for lab in labels]
        for lab in others:
            v = s.med(lab, key)
            row.append(None if v in (None, 0) or ref is None else ref / v)
        rows.append(row)
    text = table(["metric", "unit"] + [f"{lab} (median)" for lab in labels]
                 + [f"{s.ref}/{lab}" for lab in others], rows)
    notes = [f"   {lab}: {s.first(lab, 'note')}" for lab in labels if s.first(lab, "note")]
    return "\n".join([text] + notes)


def _speed_check(key: str, min_ratio: float) -> Callable[[Summary], list]:
    def check(s: Summary) -> list:
        r = s.ratio(key)
        return [(f"{s.name}: {s.ref} time / {s.cand} time", r, f">= {min_ratio:g}",
                 r is not None and r >= min_ratio)]
    return check


def _global_checks(s: Summary) -> list:
    out = _speed_check("time_s", 5.0)(s)
    peak = s.med(s.cand, "peak_extra_x")
    out.append((f"{s.name}: {s.cand} peak extra RSS / weight bytes", peak, "<= 1",
                peak is not None and peak <= 1.0))
    return out


def _forward_checks(s: Summary) -> list:
    r = s.med(s.cand, "pruned_over_dense")
    return [(f"{s.name}: {s.cand} pruned / dense forward time", r, "<= 1.15",
             r is not None and r <= 1.15)]


def _bytes_variants(cand: str, ref: str) -> list[tuple[str, str, str]]:
    return [(ref, ref, ""), (cand, cand, ""), (f"{cand} lean(bool)", cand, "lean")]


def _bytes_report(s: Summary) -> str:
    rows = []
    ref_p, ref_f = s.med(s.ref, "after_prune_MB"), s.med(s.ref, "after_forward_MB")
    for label in s.runs:
        p, f = s.med(label, "after_prune_MB"), s.med(label, "after_forward_MB")
        note = s.first(label, "note") or s.first(label, "mask_dtype") or ""
        rows.append([label, p, s.med(label, "after_prune_x"), f, s.med(label, "after_forward_x"),
                     None if p is None or ref_p is None else ref_p / p,
                     None if f is None or ref_f is None else ref_f / f, note])
    return table(["variant", "after prune MB", "x weight", "after fwd MB", "x weight",
                  f"{s.ref}/this (prune)", f"{s.ref}/this (fwd)", "mask dtype / note"], rows)


def _bytes_checks(s: Summary) -> list:
    out = []
    ref = s.med(s.ref, "after_forward_MB")
    for label in s.runs:
        if label == s.ref:
            continue
        v = s.med(label, "after_forward_MB")
        lean = label.endswith("lean(bool)")  # lean must beat torch; default must not be worse
        out.append((f"{s.name}: {label} bytes held after forward, MB", v,
                    f"{'<' if lean else '<='} {s.ref} ({fmt(ref)})",
                    v is not None and ref is not None and (v < ref if lean else v <= ref)))
    return out


def _repeated_report(s: Summary) -> str:
    rows = [[f"after call {k}",
             s.med(s.cand, f"held_x_{k}"), s.med(s.ref, f"held_x_{k}"),
             s.med(s.cand, f"rss_x_{k}"), s.med(s.ref, f"rss_x_{k}")] for k in range(1, 6)]
    rows.append(["growth call 1 -> 5", s.med(s.cand, "held_growth_x"),
                 s.med(s.ref, "held_growth_x"), s.med(s.cand, "rss_growth_x"),
                 s.med(s.ref, "rss_growth_x")])
    return ("retained memory in multiples of the weights' bytes "
            f"({fmt(s.med(s.ref, 'weights_MB'))} MB); 'held' = tensor storages reachable "
            "from the modules beyond the start, 'RSS' = resident memory beyond the start\n"
            + table(["", f"{s.cand} held", f"{s.ref} held", f"{s.cand} RSS", f"{s.ref} RSS"],
                    rows))


def _repeated_checks(s: Summary) -> list:
    g = s.med(s.cand, "held_growth_x")
    return [(f"{s.name}: {s.cand} held-memory growth over 5 calls / weight bytes", g,
             "<= 0.01", g is not None and g <= 0.01)]


# Memory cases run with glibc's mmap threshold fixed at its default (128 KiB). Left
# dynamic, glibc raises it after the first large free and then keeps freed blocks
# of up to 32 MiB in the heap, so RSS "retained" would count allocator cache, not
# live tensors (measured: prunekit repeated global pruning 2.7x "growth" with the
# dynamic threshold, 0.06x with it fixed; torch 12x vs 4x = its real leak).
# Both libraries get the same environment. --glibc-default turns this off.
FIXED_MMAP = {"MALLOC_MMAP_THRESHOLD_": "131072"}

# To add a case (e.g. the TensorPlay line): write `def case_x(prune, ctx) -> dict`
# above, then register it here. `variants` may name any library `load_lib` knows.
CASES: dict[str, Case] = {
    "l1_unstructured": Case(
        case_l1_unstructured, "l1_unstructured, Linear(4096, 4096) float32, amount=0.5",
        metrics=[("time_s", "s", True)], checks=_speed_check("time_s", 10.0)),
    "global_unstructured": Case(
        case_global_unstructured,
        "global_unstructured(L1Unstructured, amount=0.8) over ResNet-50-shaped weights "
        "(54 tensors, 25.5 M weights)",
        metrics=[("time_s", "s", True),
                 ("peak_extra_x", "x weight bytes", True),
                 ("retained_x", "x weight bytes", True),
                 ("workspace_x", "x weight bytes", True),
                 ("held_extra_x", "x weight bytes", True)],
        checks=_global_checks, env=FIXED_MMAP,
        variants=lambda cand, ref: [(cand, cand, ""), (ref, ref, ""),
                                    (f"{cand} lean(bool)", cand, "lean")]),
    "ln_structured": Case(
        case_ln_structured, "ln_structured, Linear(4096, 4096), amount=0.5, n=2, dim=0",
        metrics=[("time_s", "s", True)], checks=_speed_check("time_s", 1.0)),
    "forward_nograd": Case(
        case_forward_nograd,
        "no-grad forward, Linear(4096, 4096) pruned 50% vs the same dense layer, batch 8",
        metrics=[("dense_ms", "ms", True), ("pruned_ms", "ms", True),
                 ("pruned_over_dense", "x", True)],
        checks=_forward_checks),
    "bytes_held": Case(
        case_bytes_held,
        "bytes held by one pruned Linear(4096, 4096) (l1_unstructured 0.5): unique tensor "
        "storages reachable from the module",
        variants=_bytes_variants, report=_bytes_report, checks=_bytes_checks, runs=1),
    "repeated_global": Case(
        case_repeated_global,
        "global_unstructured(L1Unstructured, amount=0.2) 5 times over a small stack "
        "(4 x Linear(1024,1024) + 2 x Conv2d(256,256,3))",
        report=_repeated_report, checks=_repeated_checks, env=FIXED_MMAP),
    "tensorplay": Case(
        case_tensorplay,
        "TensorPlay: prunekit on tensorplay.nn.Linear(4096, 4096) vs the same on torch.nn.Linear: "
        "l1_unstructured 0.5, ln_structured 0.5 n=2 dim=0",
        variants=_tensorplay_variants, report=_tensorplay_report),
}

# ============================================================================ parent


def _labels(libs: list[str]) -> tuple[str, str]:
    cand, ref = libs
    if cand == ref:
        return f"{cand}(cand)", ref
    return cand, ref


def run_all(args: argparse.Namespace) -> dict:
    libs = args.libs.split(",")
    if len(libs) != 2:
        raise SystemExit(f"--libs takes two names, candidate,reference; got {args.libs!r}")
    cand_label, ref_label = _labels(libs)
    names = list(CASES) if not args.cases else args.cases.split(",")
    unknown = [n for n in names if n not in CASES]
    if unknown:
        raise SystemExit(f"unknown case(s) {unknown}; choose from {list(CASES)}")
    t_start = time.perf_counter()
    result: dict[str, Any] = {
        "meta": {"python": sys.version.split()[0], "torch": torch.__version__,
                 "threads": args.threads or torch.get_num_threads(), "cpus": os.cpu_count(),
                 "machine": platform.machine(), "candidate": libs[0], "reference": libs[1],
                 "quick": args.quick,
                 "malloc_env": {} if args.glibc_default else FIXED_MMAP},
        "cases": {}, "checks": []}
    summaries = []
    for name in names:
        case = CASES[name]
        runs = min(case.runs, args.runs) if case.runs is not None else args.runs
        lab = {cand_label: libs[0], ref_label: libs[1]}
        variants = (case.variants(cand_label, ref_label) if case.variants
                    else [(cand_label, libs[0], ""), (ref_label, libs[1], "")])
        variants = [(label, lab.get(lib, lib), opt) for label, lib, opt in variants]
        per: dict[str, list[dict]] = {label: [] for label, _, _ in variants}
        for r in range(runs):
            order = variants if r % 2 == 0 else variants[::-1]
            for label, lib, opt in order:
                argv = [str(Path(__file__).resolve()), "--case", name, "--lib", lib, "--json"]
                if opt:
                    argv += ["--option", opt]
                if args.quick:
                    argv.append("--quick")
                t0 = time.perf_counter()
                env = {} if args.glibc_default else dict(case.env)
                if args.threads:
                    env.update(OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads))
                res = run_child(argv, env=env)
                print(f"[{name}] run {r + 1}/{runs} {label}: "
                      f"{'ERROR' if 'error' in res else 'ok'} ({time.perf_counter() - t0:.1f} s)",
                      file=sys.stderr, flush=True)
                res["loadavg_1min"] = os.getloadavg()[0]
                per[label].append(res)
        s = Summary(name, case, cand_label, ref_label, per)
        summaries.append(s)
        checks = case.checks(s) if case.checks else []
        result["cases"][name] = {
            "title": case.title, "runs": per,
            "medians": {label: {k: s.med(label, k) for k in
                                sorted({k for r in rs for k in r})}
                        for label, rs in per.items()},
        }
        result["checks"] += [{"what": w, "value": v, "target": t, "pass": p}
                             for w, v, t, p in checks]
    result["meta"]["wall_s"] = time.perf_counter() - t_start
    loads = [r["loadavg_1min"] for c in result["cases"].values()
             for rs in c["runs"].values() for r in rs]
    result["meta"]["loadavg_1min_max"] = max(loads) if loads else None
    result["_summaries"] = summaries
    return result


def render(result: dict) -> str:
    out = []
    m = result["meta"]
    out.append(f"bench_core: candidate={m['candidate']} reference={m['reference']}  "
               f"python {m['python']}, torch {m['torch']}, {m['threads']} threads, "
               f"{m['cpus']} CPUs{'  [QUICK]' if m['quick'] else ''}")
    out.append("each number is the median over fresh processes; ratios are "
               "reference/candidate (> 1: candidate faster or smaller)")
    for s in result["_summaries"]:
        out.append("")
        n_runs = max(len(v) for v in s.runs.values())
        out.append(f"== {s.name}: {s.case.title}  [{n_runs} run(s) per variant]")
        errors = [(lab, r["error"]) for lab, rs in s.runs.items() for r in rs if "error" in r]
        for lab, e in errors[:3]:
            out.append(f"   ERROR in {lab}: {e.splitlines()[-1] if e else e}")
        bad = [lab for lab, rs in s.runs.items()
               if any(r.get("ok") is False for r in rs)]
        if bad:
            out.append(f"   WRONG RESULT (pruned count / output check failed) for: {bad}")
        out.append((s.case.report or _default_report)(s))
        method = s.first(s.cand, "rss_method") or s.first(s.ref, "rss_method")
        if method:
            out.append(f"   peak RSS measured by: {method}")
        if s.case.env and m.get("malloc_env"):
            out.append("   children ran with " + " ".join(f"{k}={v}" for k, v in s.case.env.items())
                       + " (fixed glibc mmap threshold, so RSS tracks live memory; same for both)")
    out.append("")
    out.append("== targets")
    out.append(table(["check", "value", "target", "result"],
                     [[c["what"], c["value"], c["target"], "PASS" if c["pass"] else "MISS"]
                      for c in result["checks"]]))
    out.append(f"\ntotal wall time {m['wall_s']:.0f} s; highest 1-min load average seen "
               f"{fmt(m['loadavg_1min_max'])} on {m['cpus']} CPUs")
    if m["loadavg_1min_max"] and m["loadavg_1min_max"] > (m["cpus"] or 1) + 0.5:
        out.append("WARNING: other work was running on this machine; timings are noisy "
                   "(the alternating order shares the noise between the libraries, but "
                   "rerun on a quiet machine before quoting figures)")
    return "\n".join(out)


# ============================================================================ entry point


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--libs", default="prunekit,torch",
                   help="candidate,reference library (default prunekit,torch)")
    p.add_argument("--cases", default="", help=f"comma-separated subset of {list(CASES)}")
    p.add_argument("--runs", type=int, default=5, help="fresh processes per case and library")
    p.add_argument("--quick", action="store_true", help="smoke run: 2 runs, fewer iterations")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    p.add_argument("--threads", type=int, default=0,
                   help="intra-op threads in the children (OMP_NUM_THREADS); default: torch's. "
                        "On a machine busy with other work, 1 avoids OpenMP barrier stalls that "
                        "hit code issuing many short ops far harder than code issuing a few long ones")
    p.add_argument("--glibc-default", action="store_true",
                   help="do not fix MALLOC_MMAP_THRESHOLD_ for the memory cases")
    p.add_argument("--out", default="", help="also write the JSON result to this file")
    # child mode
    p.add_argument("--case", default="", help="run ONE measurement of this case here")
    p.add_argument("--lib", default="prunekit", help="child mode: library to use")
    p.add_argument("--option", default="", help="child mode: case option (e.g. lean)")
    p.add_argument("--profile", action="store_true", help="child mode: cProfile the timed call")
    p.add_argument("--torch-profile", action="store_true",
                   help="child mode: torch.profiler table of the timed call")
    args = p.parse_args(argv)

    if args.case:
        if args.case not in CASES:
            raise SystemExit(f"unknown case {args.case!r}; choose from {list(CASES)}")
        prune = load_lib(args.lib)
        ctx = Ctx(args.lib, args.option, args.quick, args.profile, args.torch_profile)
        res = CASES[args.case].child(prune, ctx)
        res["lib"] = args.lib
        res["threads"] = torch.get_num_threads()
        print(json.dumps(res) if args.json else
              "\n".join(f"{k}: {fmt(v)}" for k, v in res.items()))
        return 0

    if args.quick and args.runs == 5:
        args.runs = 2
    result = run_all(args)
    summaries = result.pop("_summaries")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        result["_summaries"] = summaries
        print(render(result))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BrokenPipeError:  # e.g. `... | head`
        sys.exit(0)
