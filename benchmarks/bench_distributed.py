"""Exact global magnitude pruning of sharded weights: prunekit.distributed against the naive way.

ResNet-50-shaped weights (54 tensors, 25.5 M entries, float32) are sharded
along their first dimension over W processes (gloo on CPU, one thread each),
as FSDP2's ``fully_shard`` shards them. Both approaches select the same 80 %
of all weights by magnitude, in the same run, interleaved:

* **prunekit**: :func:`prunekit.kernels.select_sharded.keep_mask_smallest_sharded`
  -- every rank histograms its own shard, one all-reduce sums the histograms,
  a few candidate keys are gathered; no weight leaves its rank;
* **naive**: all-gather the weights (every rank receives every shard), select
  on rank 0 with prunekit's single-process kernel, scatter each rank's part of
  the masks (one byte per weight).

Per rank it measures the bytes sent -- read from ``/proc/self/io`` (``wchar``
counts the socket writes of gloo's TCP transport; every byte sent is received
by another rank) -- and the wall time of the call (the slowest rank's; median
of the interleaved repetitions). It checks that both give identical masks and
exactly ``k`` pruned weights. From the measured constants it then projects
bytes per rank for a model 10x larger (on paper).

Finally, under FSDP2 proper (``fully_shard`` on every layer), it runs
``prunekit.global_unstructured`` on the sharded model, checks the masks equal
the kernel's, and measures per rank the bytes its masks hold (float32 and
boolean) against the bytes of its parameter shards, and the peak extra
resident memory of the call.

Usage::

    python benchmarks/bench_distributed.py                 # W = 2 and 4, 5 repetitions
    python benchmarks/bench_distributed.py --worlds 2 --reps 3 --json
    python benchmarks/bench_distributed.py --quick         # smoke run (a 3 M-weight model, 2 reps)

The numbers depend on the machine's load (printed); compare the ratios.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

AMOUNT = 0.8


def resnet50_weight_shapes() -> List[tuple]:
    """Weight shapes of torchvision's ResNet-50 convolutions and its fc layer (as in bench_core)."""
    shapes: List[tuple] = [(64, 3, 7, 7)]
    inplanes = 64
    for planes, blocks in [(64, 3), (128, 4), (256, 6), (512, 3)]:
        for b in range(blocks):
            shapes += [(planes, inplanes, 1, 1), (planes, planes, 3, 3), (planes * 4, planes, 1, 1)]
            if b == 0:
                shapes.append((planes * 4, inplanes, 1, 1))
            inplanes = planes * 4
    shapes.append((1000, 2048))
    return shapes


def quick_shapes() -> List[tuple]:
    return [(256, 256, 3, 3)] * 4 + [(1000, 512)]


# =============================================================================== worker
def _wchar() -> int:
    with open("/proc/self/io") as fh:
        for line in fh:
            if line.startswith("wchar:"):
                return int(line.split()[1])
    return 0


def _chunk(size: int, world: int, rank: int) -> tuple:
    chunk = -(-size // world)
    start = min(rank * chunk, size)
    return start, max(min(chunk, size - start), 0)


def _full_weights(shapes, seed: int = 0):
    import torch

    g = torch.Generator().manual_seed(seed)
    for s in shapes:
        yield torch.randn(s, generator=g)  # distinct values: a well-defined selection


def _naive(pieces, shapes, k, rank, world):
    """All-gather the shards, select on rank 0, scatter each rank's masks."""
    import torch
    import torch.distributed as dist

    from prunekit.kernels.select import keep_mask_smallest_multi

    layout = [[_chunk(s[0], world, r) for s in shapes] for r in range(world)]
    sizes = [sum(ln * math.prod(s[1:]) for (_, ln), s in zip(layout[r], shapes)) for r in range(world)]
    most = max(sizes)
    flat = torch.zeros(most)
    torch.cat([p.reshape(-1) for p in pieces], out=flat[:sizes[rank]])
    gathered = [torch.empty(most) for _ in range(world)]
    dist.all_gather(gathered, flat)
    scatter_list = None
    if rank == 0:
        fulls = []
        offs = [0] * world
        for i, s in enumerate(shapes):
            parts = []
            for r in range(world):
                n = layout[r][i][1] * math.prod(s[1:])
                parts.append(gathered[r][offs[r]:offs[r] + n].view((layout[r][i][1],) + tuple(s[1:])))
                offs[r] += n
            fulls.append(torch.cat(parts))
        keeps = keep_mask_smallest_multi(fulls, k)
        del fulls
        scatter_list = []
        for r in range(world):
            buf = torch.zeros(most, dtype=torch.uint8)
            torch.cat([keeps[i].narrow(0, st, ln).reshape(-1).to(torch.uint8)
                       for i, (st, ln) in enumerate(layout[r])], out=buf[:sizes[r]])
            scatter_list.append(buf)
        del keeps
    del gathered
    out = torch.empty(most, dtype=torch.uint8)
    dist.scatter(out, scatter_list, src=0)
    keeps, off = [], 0
    for p in pieces:
        keeps.append(out[off:off + p.numel()].view(p.shape).to(torch.bool))
        off += p.numel()
    return keeps


def _sharded(pieces, specs, comm, k):
    from prunekit.kernels.select_sharded import keep_mask_smallest_sharded

    return keep_mask_smallest_sharded(pieces, specs, comm, k)


def _measure(fn):
    """``(result, seconds, bytes written to sockets)`` of one collective call on this rank."""
    import torch.distributed as dist

    dist.barrier()
    w0, t0 = _wchar(), time.perf_counter()
    out = fn()
    t1, w1 = time.perf_counter(), _wchar()
    return out, t1 - t0, w1 - w0


def worker(tmp: str, rank: int, world: int, reps: int, quick: bool) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="file://" + os.path.join(tmp, "rendezvous"), rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=600))
    from prunekit.distributed.comm import GroupComm
    from prunekit.kernels.sharded import ShardSpec

    shapes = quick_shapes() if quick else resnet50_weight_shapes()
    n_total = sum(math.prod(s) for s in shapes)
    k = round(AMOUNT * n_total)
    pieces, specs = [], []
    for s, full in zip(shapes, _full_weights(shapes)):
        start, length = _chunk(s[0], world, rank)
        pieces.append(full.narrow(0, start, length).clone())
        specs.append(ShardSpec(tuple(s), 0, start, length))
    comm = GroupComm()
    shard_bytes = sum(p.numel() * p.element_size() for p in pieces)

    def maxed(value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t)

    def summed(value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(t)
        return float(t)

    rows: Dict[str, List[Dict[str, float]]] = {"prunekit": [], "naive": []}
    identical = True
    for rep in range(reps):
        order = ("prunekit", "naive") if rep % 2 == 0 else ("naive", "prunekit")
        results = {}
        for name in order:
            sent0 = comm.sent
            if name == "prunekit":
                keeps, secs, sent = _measure(lambda: _sharded(pieces, specs, comm, k))
            else:
                keeps, secs, sent = _measure(lambda: _naive(pieces, shapes, k, rank, world))
            results[name] = keeps
            rows[name].append({
                "time_s": maxed(secs),
                "sent_max": maxed(sent), "sent_mean": summed(sent) / world,
                "payload": maxed(comm.sent - sent0) if name == "prunekit" else None,
            })
        same = all(torch.equal(a, b) for a, b in zip(results["prunekit"], results["naive"]))
        pruned = summed(sum(int((~m).sum()) for m in results["prunekit"]))
        identical = identical and bool(maxed(0.0 if same else 1.0) == 0.0) and pruned == k
        del results

    fsdp = _fsdp_part(shapes, rank, world, k, pieces, specs, comm)
    out = {"world": world, "n": n_total, "k": k, "shard_bytes_max": maxed(shard_bytes), "identical": identical,
           "rows": rows, "fsdp": fsdp}
    if rank == 0:
        with open(os.path.join(tmp, "result.json"), "w") as f:
            json.dump(out, f)
    dist.barrier()  # leave together: a rank tearing gloo down while a peer still talks can abort it
    dist.destroy_process_group()


def _fsdp_part(shapes, rank, world, k, pieces, specs, comm) -> Dict[str, Any]:
    """``prunekit.global_unstructured`` on an FSDP2-sharded model: masks, mask bytes, peak memory."""
    import gc

    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import init_device_mesh

    import prunekit
    from _harness import MemoryMeter
    from prunekit.kernels.select_sharded import keep_mask_smallest_sharded

    want = keep_mask_smallest_sharded(pieces, specs, comm, k)
    mesh = init_device_mesh("cpu", (world,))
    out: Dict[str, Any] = {}
    for label, dtype in (("float32 masks", None), ("bool masks", torch.bool)):
        layers = nn.ModuleList()
        for s, full in zip(shapes, _full_weights(shapes)):
            layer = nn.Conv2d(s[1], s[0], s[2:], bias=False) if len(s) == 4 else nn.Linear(s[1], s[0], bias=False)
            with torch.no_grad():
                layer.weight.copy_(full)
            fully_shard(layer, mesh=mesh)
            layers.append(layer)
        del full
        gc.collect()
        params = [(m, "weight") for m in layers]
        shard_bytes = sum(m.weight.to_local().numel() * m.weight.to_local().element_size() for m in layers)
        dist.barrier()
        meter = MemoryMeter()
        with meter:
            t0 = time.perf_counter()
            prunekit.global_unstructured(params, prunekit.L1Unstructured, amount=AMOUNT, mask_dtype=dtype)
            secs = time.perf_counter() - t0
        mask_bytes = sum(m.weight_mask.to_local().untyped_storage().nbytes() for m in layers)
        same = all(torch.equal(m.weight_mask.to_local() != 0, w) for m, w in zip(layers, want))
        t = torch.tensor([mask_bytes / shard_bytes, meter.peak_extra / shard_bytes, secs, 0.0 if same else 1.0],
                         dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        out[label] = {"mask_over_shard": float(t[0]), "peak_over_shard": float(t[1]), "time_s": float(t[2]),
                      "identical": float(t[3]) == 0.0, "meter": meter.method}
        if dtype is torch.bool:
            out["save_compressed"] = _save_part(layers, shapes, rank)
        del layers, params
        gc.collect()
    return out


def _save_part(layers, shapes, rank) -> Dict[str, Any]:
    """prunekit.distributed.save_compressed of the sharded model: peak extra memory per rank."""
    import tempfile

    import torch.distributed as dist

    import prunekit
    from _harness import MemoryMeter

    box = [tempfile.mkdtemp(prefix="prunekit-bench-save-") if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    path = os.path.join(box[0], "model.safetensors")
    largest = max(math.prod(s) for s in shapes) * 4
    meter = MemoryMeter()
    dist.barrier()
    with meter:
        t0 = time.perf_counter()
        prunekit.distributed.save_compressed(layers, path)
        secs = time.perf_counter() - t0
    size = os.path.getsize(path) if rank == 0 else 0
    peaks = [None] * dist.get_world_size()
    dist.all_gather_object(peaks, meter.peak_extra)
    dist.barrier()
    if rank == 0:
        shutil.rmtree(box[0], ignore_errors=True)
    return {"rank0_peak_over_largest": peaks[0] / largest, "others_peak_mib": max(peaks[1:] or [0]) / 2**20,
            "largest_mib": largest / 2**20, "model_mib": sum(math.prod(s) for s in shapes) * 4 / 2**20,
            "file_mib": size / 2**20, "time_s": secs}


# =============================================================================== parent
def run_world(world: int, reps: int, quick: bool, timeout: float = 1800) -> Dict[str, Any]:
    tmp = tempfile.mkdtemp(prefix="prunekit-bench-dist-")
    # MALLOC_MMAP_THRESHOLD_: large blocks are mmapped and returned when freed, so resident memory
    # follows live tensors (glibc's adaptive threshold would keep freed blocks and hide later peaks)
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="131072")
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), str(HERE.parent / "src"), env.get("PYTHONPATH", "")])
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", tmp, str(r), str(world), str(reps)]
                              + (["--quick"] if quick else []), env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(world)]
    deadline = time.monotonic() + timeout
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=max(deadline - time.monotonic(), 1))[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise SystemExit(f"W={world}: timed out after {timeout} s")
    path = os.path.join(tmp, "result.json")
    if any(p.returncode for p in procs) or not os.path.exists(path):
        raise SystemExit(f"W={world}: a worker failed:\n" + "\n".join(log[-3000:] for log in logs))
    with open(path) as f:
        result = json.load(f)
    shutil.rmtree(tmp, ignore_errors=True)
    return result


def _median(rows, key):
    vals = sorted(r[key] for r in rows)
    return vals[len(vals) // 2] if len(vals) % 2 else (vals[len(vals) // 2 - 1] + vals[len(vals) // 2]) / 2


def report(results: List[Dict[str, Any]], load: tuple) -> str:
    from _harness import table

    lines = [f"load average at start: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} on {os.cpu_count()} CPUs; "
             "one thread per process"]
    rows = []
    for res in results:
        w, n = res["world"], res["n"]
        pk, nv = res["rows"]["prunekit"], res["rows"]["naive"]
        b_pk, b_nv = _median(pk, "sent_max"), _median(nv, "sent_max")
        t_pk, t_nv = _median(pk, "time_s"), _median(nv, "time_s")
        rows.append([f"W={w}, {n / 1e6:.1f} M weights", f"{b_pk / 1024:.0f} KiB", f"{b_nv / 2**20:.1f} MiB",
                     f"{100 * b_pk / b_nv:.2f} %", f"{t_pk:.3f} s", f"{t_nv:.3f} s", f"{t_nv / t_pk:.2f}x",
                     "yes" if res["identical"] else "NO"])
    lines.append("")
    lines.append(f"exact global magnitude selection of {AMOUNT:.0%}, bytes sent by the busiest rank and wall time "
                 f"of the slowest rank (medians of {len(results[0]['rows']['prunekit'])} interleaved runs):")
    lines.append(table(["case", "prunekit bytes", "naive bytes", "ratio", "prunekit time", "naive time",
                        "speedup", "same masks"], rows))
    # projection from the measured constants
    lines.append("")
    lines.append("bytes sent per rank, projected from the measured constants (prunekit's are independent of the "
                 "model size below 2^31 weights; the naive way's grow with it):")
    proj = []
    for res in results:
        w, n = res["world"], res["n"]
        b_pk = _median(res["rows"]["prunekit"], "sent_max")
        per_weight = _median(res["rows"]["naive"], "sent_max") / n
        for scale in (1, 10):
            proj.append([f"W={w}, {scale * n / 1e6:.0f} M weights", f"{b_pk / 1024:.0f} KiB",
                         f"{per_weight * scale * n / 2**20:.0f} MiB",
                         f"{100 * b_pk / (per_weight * scale * n):.3f} %"])
    lines.append(table(["model", "prunekit", "naive", "ratio"], proj))
    lines.append("")
    lines.append("prunekit.global_unstructured on the FSDP2-sharded model (fully_shard per layer), per rank, "
                 "against the bytes of that rank's parameter shards:")
    frows = []
    for res in results:
        for label, f in res["fsdp"].items():
            if label == "save_compressed":
                continue
            frows.append([f"W={res['world']}, {label}", f"{f['mask_over_shard']:.3f}x",
                          f"{f['peak_over_shard']:.3f}x", f"{f['time_s']:.3f} s",
                          "yes" if f["identical"] else "NO"])
    lines.append(table(["case", "mask bytes / shard bytes", "peak extra RSS / shard bytes", "time",
                        "same masks as the kernel"], frows))
    lines.append("")
    lines.append("prunekit.distributed.save_compressed of that model (boolean masks), one file written by rank 0:")
    srows = []
    for res in results:
        f = res["fsdp"]["save_compressed"]
        srows.append([f"W={res['world']}", f"{f['model_mib']:.0f} MiB", f"{f['largest_mib']:.1f} MiB",
                      f"{f['rank0_peak_over_largest']:.2f}x", f"{f['others_peak_mib']:.1f} MiB",
                      f"{f['file_mib']:.1f} MiB", f"{f['time_s']:.2f} s"])
    lines.append(table(["case", "model", "largest tensor", "rank 0 peak extra / largest tensor",
                        "other ranks' peak extra", "file", "time"], srows))
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--worlds", default="2,4", help="process counts, comma-separated (default 2,4)")
    p.add_argument("--reps", type=int, default=5, help="interleaved repetitions per approach (default 5)")
    p.add_argument("--quick", action="store_true", help="smoke run: a 3 M-weight model, 2 repetitions")
    p.add_argument("--json", action="store_true", help="print the raw results as JSON")
    p.add_argument("--worker", nargs=4, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        tmp, rank, world, reps = args.worker
        worker(tmp, int(rank), int(world), int(reps), args.quick)
        return
    reps = 2 if args.quick and args.reps == 5 else args.reps
    load = os.getloadavg()
    results = [run_world(int(w), reps, args.quick) for w in args.worlds.split(",")]
    if args.json:
        print(json.dumps({"load_average": load, "results": results}, indent=1))
    else:
        print(report(results, load))


if __name__ == "__main__":
    main()
