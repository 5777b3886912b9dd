"""Run test scenarios in W processes joined by torch.distributed (gloo, CPU), from pytest.

``run_world(world, scenarios)`` starts ``world`` Python processes (this file
as a script), each of which joins one process group -- the rendezvous goes
through a file in a fresh temporary directory, so no port is ever chosen and
parallel runs cannot collide (gloo's connections take free ports from the
OS) -- and runs the named scenario functions of ``tests/helpers/dist_scenarios.py``
in order (``"module:function"`` names a scenario of another module of
``tests/``). Each rank records, per scenario, ``"ok"`` or the traceback; the
parent returns them.

Bounded: the process group times out after ``PG_TIMEOUT_S`` (a rank stuck in
a collective whose partner failed raises instead of waiting), and the parent
kills every process still running after ``timeout_s`` and reports it, so a
hang fails the tests instead of blocking CI.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Sequence

PG_TIMEOUT_S = 60
HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.dirname(HERE)  # on the ranks' path: scenarios are ``helpers.<module>:<function>``
#: CPU seconds per rank and scenario of the last run_world call ("startup": imports and joining)
LAST_CPU: Dict[int, Dict[str, float]] = {}


def run_world(world: int, scenarios: Sequence[str], timeout_s: float = 240) -> Dict[str, Dict[int, str]]:
    """``{scenario: {rank: "ok" or the error}}`` from ``world`` processes running ``scenarios``."""
    tmp = tempfile.mkdtemp(prefix="prunekit-dist-")
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONHASHSEED="0")
    # absolute: the ranks run in tests/, where a relative entry (PYTHONPATH=src) would find nothing and the
    # installed prunekit would be imported instead of the one under test
    env["PYTHONPATH"] = os.pathsep.join([TESTS] + [os.path.abspath(p) for p in env.get("PYTHONPATH", "").split(os.pathsep)
                                                  if p])
    procs: List[subprocess.Popen] = []
    logs = []
    for rank in range(world):
        log = open(os.path.join(tmp, f"rank{rank}.log"), "w+b")
        logs.append(log)
        procs.append(subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), tmp, str(rank), str(world), *scenarios],
            stdout=log, stderr=subprocess.STDOUT, env=env, cwd=TESTS,
        ))
    deadline = time.monotonic() + timeout_s
    hung = False
    for p in procs:
        try:
            p.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            hung = True
            break
    if hung:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for p in procs:
            p.wait()
    results: Dict[str, Dict[int, str]] = {s: {} for s in scenarios}
    LAST_CPU.clear()
    for rank, log in enumerate(logs):
        cpu_path = os.path.join(tmp, f"rank{rank}.cpu.json")
        if os.path.exists(cpu_path):
            with open(cpu_path) as f:
                LAST_CPU[rank] = json.load(f)
        path = os.path.join(tmp, f"rank{rank}.json")
        done = {}
        if os.path.exists(path):
            with open(path) as f:
                done = json.load(f)
        log.seek(0)
        tail = log.read().decode(errors="replace")[-3000:]
        log.close()
        for s in scenarios:
            if s in done:
                results[s][rank] = done[s]
            else:
                why = "killed after the time limit (hang)" if hung else f"exit code {procs[rank].returncode}"
                results[s][rank] = f"rank {rank} never finished this scenario: {why}\n--- log tail ---\n{tail}"
    if all(v == "ok" for per in results.values() for v in per.values()):
        shutil.rmtree(tmp, ignore_errors=True)
    return results


def _main(tmp: str, rank: int, world: int, scenarios: List[str]) -> None:
    import datetime
    import traceback

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method="file://" + os.path.join(tmp, "rendezvous"), rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=PG_TIMEOUT_S),
    )
    import importlib

    out: Dict[str, str] = {}
    cpu: Dict[str, float] = {"startup": round(time.process_time(), 2)}
    path = os.path.join(tmp, f"rank{rank}.json")
    try:
        for name in scenarios:
            torch.manual_seed(0)
            t0 = time.process_time()
            try:
                module, _, function = name.rpartition(":")
                getattr(importlib.import_module(module or "helpers.dist_scenarios"), function)(rank, world)
                out[name] = "ok"
            except Exception:  # recorded per scenario; the others still run
                out[name] = traceback.format_exc()
            cpu[name] = round(time.process_time() - t0, 2)
            with open(path + ".tmp", "w") as f:
                json.dump(out, f)
            with open(os.path.join(tmp, f"rank{rank}.cpu.json"), "w") as f:
                json.dump(cpu, f)
            os.replace(path + ".tmp", path)
            dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    _main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:])
