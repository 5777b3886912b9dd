"""Execution policies for one pruned layer, and their measurement in context.

A *policy* is a way to run a layer: a storage layout, a kernel and a thread
count. :func:`candidates` lists the policies that can run a given layer (and
why each other one cannot); :func:`measure_in_context` times each of them the
way a model runs it -- every call right after the dense layer's own call, so
each candidate starts with the dense op's OpenMP threads still spinning and
its caches holding the dense op's data -- and returns medians.

Policy names (the ``-1t`` variants run on one thread, the others on torch's
thread count):

=================  =============================================================
``csr``            prunekit's compiled CSR kernel (:mod:`prunekit.sparse.native`)
``csr-torch``      ``torch.sparse`` CSR (MKL on CPU, cuSPARSE on CUDA)
``bsr4x1``         prunekit's compiled kernel over 4x1 blocks (4 outputs x 1 input)
``bsr1x4``         ... over 1x4 blocks (1 output x 4 consecutive inputs)
``channels``       all-zero rows/columns dropped: a smaller dense product + scatter
``2:4``            ``torch.sparse`` semi-structured 2:4 (CUDA only)
=================  =============================================================
"""

from __future__ import annotations

import statistics
import time
from functools import partial
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from . import native
from .modules import (
    BSRLinear,
    ChannelLinear,
    CSRConv2d,
    CSRLinear,
    block_fill,
    bsr_unsupported_reason,
)

__all__ = ["POLICIES", "candidates", "measure_in_context", "preferred"]

POLICIES: Tuple[str, ...] = ("csr", "csr-1t", "csr-torch", "csr-torch-1t", "bsr4x1", "bsr4x1-1t", "bsr1x4",
                             "bsr1x4-1t", "channels", "2:4")
_FORMAT_POLICIES = {
    "csr": ("csr", "csr-1t", "csr-torch", "csr-torch-1t"),
    "bsr": ("bsr4x1", "bsr4x1-1t", "bsr1x4", "bsr1x4-1t"),
    "channels": ("channels",),
    "2:4": ("2:4",),
    "auto": POLICIES,
}
# A blocked layout stores whole blocks; past a third of stored zeros it does more work than CSR.
MIN_BLOCK_FILL = 0.75
# The smaller dense product must drop at least a fifth of the weight to be worth the gather/scatter.
MAX_CHANNEL_AREA = 0.8

Builder = Callable[[], nn.Module]


def _split(name: str) -> Tuple[str, str, int]:
    """'csr-torch-1t' -> ('csr', 'torch', 1)."""
    threads = 1 if name.endswith("-1t") else 0
    base = name[:-3] if threads else name
    kernel = "torch" if base.endswith("-torch") else "prunekit"
    layout = base[:-6] if kernel == "torch" else base
    return layout, kernel, threads


def policies_for_format(fmt: str) -> Tuple[str, ...]:
    """The policies a ``format`` of :func:`prunekit.sparse.sparsify_for_inference` allows."""
    return _FORMAT_POLICIES[fmt]


def candidates(kind: str, module: Union[nn.Linear, nn.Conv2d], weight: torch.Tensor, wanted: Sequence[str], keep_original: bool,
               semi_structured: Optional[Callable[[], Any]] = None,
               semi_structured_reason: str = "") -> Tuple[Dict[str, Builder], Dict[str, str]]:
    """Which of the ``wanted`` policies can run this layer: ``({name: builder}, {name: why not})``.

    Examples:
        >>> import torch
        >>> from prunekit.sparse.policies import candidates
        >>> lin = torch.nn.Linear(64, 64)
        >>> with torch.no_grad():
        ...     lin.weight[:, ::2] = 0      # every other input: half of each 1x4 block
        >>> build, why_not = candidates("linear", lin, lin.weight.detach(), ["csr-torch", "bsr1x4"], True)
        >>> sorted(build)
        ['csr-torch']
        >>> why_not["bsr1x4"]
        "only 50% of the stored 1x4 blocks would be non-zero (needs 75%: prune with pattern '1x4')"
    """
    original = module if keep_original else None
    bias = module.bias if isinstance(module.bias, torch.Tensor) else None  # nn.Linear leaves bias untyped
    cpu = weight.device.type == "cpu"
    one_thread = torch.get_num_threads() == 1
    fills: Dict[Tuple[int, int], float] = {}
    builders: Dict[str, Builder] = {}
    skipped: Dict[str, str] = {}
    for name in wanted:
        layout, kernel, threads = _split(name)
        if name == "2:4":
            if semi_structured is None:
                skipped[name] = semi_structured_reason or "2:4 kernels take only Linear layers"
            else:
                builders[name] = semi_structured
            continue
        if threads == 1 and (one_thread or not cpu):
            skipped[name] = "torch already runs on one thread" if cpu else "thread count applies to CPU only"
            continue
        if kernel == "prunekit" and not (cpu and weight.dtype in (torch.float32, torch.float64)):
            skipped[name] = f"prunekit's kernels take float32/float64 CPU tensors, not {weight.dtype} on {weight.device}"
            continue
        if kernel == "prunekit" and not native.available():
            skipped[name] = f"compiled kernels unavailable: {native.unavailable_reason()}"
            continue
        if layout == "csr":
            if kind == "linear":
                builders[name] = partial(CSRLinear, weight, bias, original, kernel=kernel, threads=threads)
            elif isinstance(module, nn.Conv2d):
                builders[name] = partial(CSRConv2d, module, weight, keep_original, kernel=kernel, threads=threads)
            else:
                skipped[name] = f"csr runs Linear and Conv2d layers, not {type(module).__name__}"
            continue
        if kind != "linear":
            skipped[name] = f"{layout} runs Linear layers only"
            continue
        if layout in ("bsr4x1", "bsr1x4"):
            block = (4, 1) if layout == "bsr4x1" else (1, 4)
            bad = bsr_unsupported_reason(weight, block)
            if bad:
                skipped[name] = bad
                continue
            fill = fills.setdefault(block, block_fill(weight, block))
            if fill < MIN_BLOCK_FILL:
                skipped[name] = (f"only {fill:.0%} of the stored {block[0]}x{block[1]} blocks would be non-zero "
                                 f"(needs {MIN_BLOCK_FILL:.0%}: prune with pattern '{block[0]}x{block[1]}')")
                continue
            builders[name] = partial(BSRLinear, weight, bias, original, block=block, threads=threads)
        elif layout == "channels":
            nz = weight != 0
            area = float(nz.any(1).sum()) * float(nz.any(0).sum()) / max(weight.numel(), 1)
            if area > MAX_CHANNEL_AREA:
                skipped[name] = (f"whole zero rows/columns leave {area:.0%} of the weight (needs at most "
                                 f"{MAX_CHANNEL_AREA:.0%})")
                continue
            builders[name] = partial(ChannelLinear, weight, bias, original)
        else:  # pragma: no cover - names are validated by the caller
            skipped[name] = "unknown policy"
    return builders, skipped


def preferred(names: Sequence[str]) -> List[str]:
    """The order to try policies in without measuring: blocked layouts, compiled CSR, torch's CSR on one thread."""
    order = ["2:4", "bsr4x1", "bsr1x4", "csr", "csr-torch-1t", "csr-torch", "csr-1t", "bsr4x1-1t", "bsr1x4-1t",
             "channels"]
    return sorted(names, key=lambda n: order.index(n) if n in order else len(order))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_in_context(dense: Callable[[], Any], fns: Mapping[str, Callable[[], Any]], device: torch.device,
                       budget_s: float, min_rounds: int = 5, max_rounds: int = 50) -> Tuple[float, Dict[str, float]]:
    """Median seconds of the dense call and of each candidate, every candidate call right after a dense call.

    Each candidate has a rotation of its own -- dense, candidate, dense, candidate, ... -- as
    between the dense layers of a model: at least ``min_rounds`` and at most ``max_rounds``
    pairs, until its share of ``budget_s`` is spent (the first pair, right after the previous
    candidate, is a warm-up). Measured in one shared rotation (dense, a, dense, b, ...) the
    candidates slowed one another: after torch's MKL kernel, which widens its indices on every
    call, and its one-thread variant, which switches the thread count, the next candidate ran
    10-25% slower although a dense call ran in between. A candidate's figure is its median put
    on the dense figure of all rotations (times the ratio of the overall dense median to its own
    rotation's), so a change of machine load between rotations cancels out; the dense figure
    is the median over all dense calls.

    Examples:
        >>> import torch
        >>> from prunekit.sparse.policies import measure_in_context
        >>> a = torch.randn(64, 64)
        >>> dense_s, times = measure_in_context(lambda: a @ a, {"same": lambda: a @ a}, a.device, 0.0)
        >>> sorted(times), dense_s > 0
        (['same'], True)
    """
    dense()
    for fn in fns.values():
        fn()
    _sync(device)
    dense_all: List[float] = []
    own: Dict[str, Tuple[float, float]] = {}
    share = budget_s / max(len(fns), 1)
    for name, fn in fns.items():
        dense_times: List[float] = []
        times: List[float] = []
        start = time.perf_counter()
        pair = 0
        while len(times) < max_rounds and (len(times) < min_rounds or time.perf_counter() - start < share):
            t0 = time.perf_counter()
            dense()
            _sync(device)
            t1 = time.perf_counter()
            fn()
            _sync(device)
            t2 = time.perf_counter()
            if pair:  # the first pair after another candidate warms up
                dense_times.append(t1 - t0)
                times.append(t2 - t1)
            pair += 1
        dense_all += dense_times
        own[name] = (statistics.median(dense_times), statistics.median(times))
    ref = statistics.median(dense_all) if dense_all else 0.0
    return ref, {name: t * ref / d if d > 0 else t for name, (d, t) in own.items()}
