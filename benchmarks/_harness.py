"""Measurement helpers shared by the benchmark scripts in ``benchmarks/``.

Nothing here knows about pruning. It provides:

* :class:`MemoryMeter` - peak and retained resident memory (RSS) around a block
  of code, read from ``/proc/self`` (Linux only);
* :func:`reachable_storage_bytes` - the bytes of the unique tensor storages an
  object graph (a module, its hooks, ...) keeps alive;
* :func:`run_child` - run one measurement in a fresh interpreter and read back
  its JSON result;
* the load rule: :func:`add_load_argument` and :func:`headline_allowed` -- a
  benchmark prints no headline speed figure while the 1-minute load average
  exceeds :data:`QUIET_LOAD` (after waiting up to :data:`SETTLE_S` for it to fall)
  unless it was given ``--allow-load``, and
  :func:`load_note` is printed beside every figure;
* small statistics and table-formatting helpers;
* results files: every :func:`table` a benchmark prints is also recorded, and when
  the script ends the tables are written to ``benchmarks/results/<script>.json``
  (``<script>.<flag>....json`` for a run given other flags than ``--allow-load``)
  with the command, date, machine, load averages and versions
  (:func:`write_results`); the docs' benchmarks page is generated from these files.
"""

from __future__ import annotations

import functools
import gc
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
import types
import weakref
from typing import Any, Callable, Iterable, Sequence

import torch

KIB = 1024
MIB = 1024 * 1024


# ----------------------------------------------------------------------------- memory


def _status_kib(field: str) -> int:
    """Return a ``/proc/self/status`` field such as ``VmRSS`` in KiB."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field} line")


def rss_bytes() -> int:
    """Current resident set size of this process, in bytes."""
    return _status_kib("VmRSS") * KIB


def _statm_rss_bytes(page: int = os.sysconf("SC_PAGE_SIZE")) -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * page


def _can_reset_hwm() -> bool:
    """True when writing ``5`` to ``/proc/self/clear_refs`` resets VmHWM here."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
    except OSError:
        return False
    # After a reset the high-water mark equals the current RSS (give or take
    # pages touched in between); a kernel that ignores the write leaves it at
    # the process's lifetime peak, which after `import torch` is above RSS.
    return _status_kib("VmHWM") <= _status_kib("VmRSS") + 1024


class MemoryMeter:
    """Measure peak and retained RSS of a block, relative to RSS before it.

    Usage::

        meter = MemoryMeter()
        with meter:
            work()
        meter.peak_extra, meter.retained   # bytes

    ``peak_extra`` is the highest RSS reached inside the block minus the RSS
    just before it; ``retained`` is the RSS after the block (after a
    ``gc.collect()``) minus the RSS before it. The peak comes from VmHWM after
    resetting it through ``/proc/self/clear_refs`` when the kernel allows it
    (exact: the kernel tracks every page), otherwise from a thread sampling
    ``/proc/self/statm`` about every millisecond (may miss short spikes).
    ``method`` says which one was used.
    """

    def __init__(self, sample_interval_s: float = 0.001, force_sampling: bool = False) -> None:
        self.sample_interval_s = sample_interval_s
        self.method = "sampling /proc/self/statm every ~1 ms"
        if not force_sampling and _can_reset_hwm():
            self.method = "VmHWM reset via /proc/self/clear_refs"
        self.before = self.peak = self.after = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._sampled_peak = 0

    @property
    def uses_hwm(self) -> bool:
        return self.method.startswith("VmHWM")

    def _sample(self) -> None:
        while not self._stop.is_set():
            self._sampled_peak = max(self._sampled_peak, _statm_rss_bytes())
            time.sleep(self.sample_interval_s)

    def __enter__(self) -> "MemoryMeter":
        gc.collect()
        if self.uses_hwm:
            with open("/proc/self/clear_refs", "w") as fh:
                fh.write("5")
        self.before = rss_bytes()
        if not self.uses_hwm:
            self._sampled_peak = self.before
            self._stop.clear()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.uses_hwm:
            self.peak = _status_kib("VmHWM") * KIB
        else:
            self._stop.set()
            assert self._thread is not None
            self._thread.join()
            self.peak = max(self._sampled_peak, _statm_rss_bytes())
        gc.collect()
        self.after = rss_bytes()

    @property
    def peak_extra(self) -> int:
        return max(self.peak - self.before, 0)

    @property
    def retained(self) -> int:
        return self.after - self.before


# ----------------------------------------------------------------------------- reachable tensors

_ATOMS = (str, bytes, int, float, complex, bool, type(None), type, types.ModuleType,
          weakref.ReferenceType, torch.dtype, torch.device)


def _children(obj: Any) -> Iterable[Any]:
    """Objects that ``obj`` keeps alive, as far as tensors are concerned."""
    if isinstance(obj, torch.nn.Module):
        yield from vars(obj).values()  # _parameters, _buffers, _modules, hook dicts, attrs
        return
    if isinstance(obj, dict):
        yield from obj.values()
        return
    if isinstance(obj, (list, tuple, set, frozenset)):
        yield from obj
        return
    if isinstance(obj, functools.partial):
        yield obj.func
        yield from obj.args
        yield from obj.keywords.values()
        return
    if isinstance(obj, types.MethodType):
        yield obj.__self__
        yield obj.__func__
        return
    if isinstance(obj, types.FunctionType):
        for cell in obj.__closure__ or ():
            try:
                yield cell.cell_contents
            except ValueError:  # empty cell
                pass
        return
    if isinstance(obj, (types.BuiltinFunctionType, types.CodeType)):
        return
    if hasattr(obj, "__dict__"):
        yield from vars(obj).values()
    for klass in type(obj).__mro__:
        for slot in getattr(klass, "__slots__", ()):
            if isinstance(slot, str) and hasattr(obj, slot):
                yield getattr(obj, slot)


def reachable_storage_bytes(*roots: Any) -> int:
    """Bytes of the unique tensor storages reachable from ``roots``.

    Walks modules (parameters, buffers, submodules, plain attributes, hook
    dictionaries), containers, hook objects (their ``__dict__``/slots,
    bound-method owners, ``functools.partial`` arguments, closure cells) and
    tensors' ``.grad``. A view counts its whole base storage once (a slice of
    a big tensor keeps all of it alive). Weak references are not followed.
    Autograd graphs hanging off non-leaf tensors are not followed, so measure
    after no-grad work.

    >>> lin = torch.nn.Linear(4, 3)
    >>> reachable_storage_bytes(lin)
    60
    """
    seen: set[int] = set()
    storages: dict[tuple[str, int], int] = {}
    stack: list[Any] = list(roots)
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, _ATOMS):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            if obj.device.type == "meta":
                continue
            st = obj.untyped_storage()
            key = (str(st.device), st.data_ptr())
            storages[key] = max(storages.get(key, 0), st.nbytes())
            if obj.is_leaf and obj.grad is not None:
                stack.append(obj.grad)
            continue
        stack.extend(_children(obj))
    return sum(storages.values())


# ----------------------------------------------------------------------------- machine load

# Above this 1-minute load average (on the 2-core machine) the figures say more about the other
# processes than about the code: a multi-threaded op waits for its slowest thread, and a thread
# that is descheduled stalls the whole op.
QUIET_LOAD = 1.5
# The benchmark's own earlier parts count in the load average too (two busy threads pull it toward 2
# within a minute or two), so before refusing, a part waits this long for the average to fall: the
# benchmark's own load decays (time constant one minute), other processes' load does not.
SETTLE_S = 120.0


def load_average() -> tuple[float, float, float]:
    """The 1, 5 and 15-minute load averages (NaN where the platform has none)."""
    try:
        return os.getloadavg()
    except OSError:
        return (float("nan"),) * 3


def load_note() -> str:
    """``'load average 0.66 0.70 0.81'``: print it beside every speed figure."""
    one, five, fifteen = load_average()
    return f"load average {one:.2f} {five:.2f} {fifteen:.2f}"


def add_load_argument(parser: Any) -> None:
    """Add ``--allow-load`` to an ``argparse`` parser (see :func:`headline_allowed`)."""
    parser.add_argument("--allow-load", action="store_true",
                        help=f"print headline speed figures even when the load average exceeds {QUIET_LOAD} "
                             f"(they are then marked as taken under load)")


def _settle(limit: float, settle_s: float) -> float:
    """Sleep (up to ``settle_s``) until the 1-minute load average is at most ``limit``; the last reading."""
    deadline = time.monotonic() + settle_s
    one = load_average()[0]
    while one == one and one > limit and time.monotonic() < deadline:
        time.sleep(5.0)
        one = load_average()[0]
    return one


def headline_allowed(allow_load: bool, what: str = "speed figures", limit: float = QUIET_LOAD,
                     settle_s: float = SETTLE_S) -> bool:
    """Whether headline figures may be printed now: a quiet machine, or ``--allow-load``.

    Above ``limit`` it first waits up to ``settle_s`` seconds for the load
    average to fall (the benchmark's own previous part counts in it). Prints
    one line saying what was withheld (or that the figures are taken under
    load) and returns ``False`` when they may not be printed.
    """
    one = load_average()[0] if allow_load else _settle(limit, settle_s)
    if one == one and one > limit:  # NaN: no load average on this platform, nothing to refuse on
        if not allow_load:
            print(f"   {what}: not measured -- {load_note()} exceeds {limit} (other processes would set the "
                  f"figures); rerun on a quiet machine, or pass --allow-load to print them marked as loaded")
            return False
        print(f"   {what}: measured under load ({load_note()} > {limit}, --allow-load): not headline figures")
    return True


def loaded_mark(limit: float = QUIET_LOAD) -> str:
    """``'  [loaded 3.2]'`` when the 1-minute load average exceeds ``limit`` now, else ``''``."""
    one = load_average()[0]
    return f"  [loaded {one:.1f}]" if one == one and one > limit else ""


# ----------------------------------------------------------------------------- timing


def time_call(fn: Callable[[], Any]) -> float:
    """Wall-clock seconds of one call of ``fn``."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


# ----------------------------------------------------------------------------- child processes


def run_child(argv: list[str], env: dict[str, str] | None = None, timeout: float = 600) -> dict:
    """Run ``python argv...`` in a fresh interpreter; return the JSON its last stdout line holds."""
    full_env = dict(os.environ, PRUNEKIT_BENCH_CHILD="1")
    if env:
        full_env.update(env)
    proc = subprocess.run([sys.executable, *argv], capture_output=True, text=True,
                          env=full_env, timeout=timeout)
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout)[-2000:]
        return {"error": f"child {' '.join(argv)} exited with {proc.returncode}: {tail.strip()}"}
    try:
        return json.loads(lines[-1])
    except json.JSONDecodeError:
        return {"error": f"child printed no JSON; last line: {lines[-1][:200]!r}"}


# ----------------------------------------------------------------------------- formatting


def fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, str):
        return value
    if isinstance(value, float):
        if value != value:
            return "nan"
        if value == 0:
            return "0"
        if abs(value) >= 1000:
            return f"{value:,.0f}"
        return f"{value:.{digits}g}"
    return str(value)


def table(header: Sequence[str], rows: Sequence[Sequence[Any]], *, title: str = "") -> str:
    """A plain-text table with columns padded to their widest cell; also recorded for the results file."""
    record_table(header, rows, title=title)
    cells = [[fmt(c) for c in header]] + [[fmt(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = []
    for n, row in enumerate(cells):
        lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                               for i, (c, w) in enumerate(zip(row, widths))).rstrip())
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


# ----------------------------------------------------------------------------- results files

#: flags that change no setting of a run (only whether loaded figures are printed, marked): a run with them
#: writes the same results file as one without (the file records the load and the command)
SAME_RUN_FLAGS = ("allow-load",)
RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
_RECORDED: list[dict] = []
#: when the script started (this module is imported at its start), and the load average then
_STARTED = {"date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "load_average": list(load_average())}


def record_table(header: Sequence[str], rows: Sequence[Sequence[Any]], *, title: str = "") -> None:
    """Keep one table for the results file (the first call arms writing it when the script ends)."""
    if not _RECORDED and _is_main_run():
        import atexit

        atexit.register(write_results)
    _RECORDED.append({"title": title, "header": [fmt(c) for c in header],
                      "rows": [[fmt(c) for c in row] for row in rows]})


def _is_main_run() -> bool:
    script = os.path.basename(sys.argv[0]) if sys.argv else ""
    return script.startswith("bench_") and not os.environ.get("PRUNEKIT_BENCH_CHILD")


def machine() -> dict:
    """CPU model, core count, memory and OS of this machine."""
    import platform

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    mem = None
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_bytes": mem, "os": platform.platform()}


def versions() -> dict:
    """Versions of Python and of the packages a comparison may involve (those installed)."""
    import importlib.metadata as md
    import platform

    out = {"python": platform.python_version()}
    for name in ("prunekit", "torch", "transformers", "torch-pruning", "llmcompressor", "compressed-tensors",
                 "tensorplay", "onnxruntime"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            pass
    return out


def _run_flags(argv: list[str]) -> list[str]:
    """The parts of a results file's name for a run's flags: ``--only minilm`` -> ``only-minilm``,
    ``--quick`` -> ``quick`` (a value made safe for a file name); :data:`SAME_RUN_FLAGS` left out."""
    out = []
    for i, a in enumerate(argv):
        if not a.startswith("--"):
            continue
        flag, _, value = a[2:].partition("=")
        if not value and i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            value = argv[i + 1]
        if flag not in SAME_RUN_FLAGS:
            out.append(f"{flag}-{re.sub(r'[^A-Za-z0-9_+-]+', '_', value)}" if value else flag)
    return out


def write_results(path: str | None = None) -> str:
    """Write the recorded tables with command, date, machine, load and versions; return the path."""
    name = os.path.splitext(os.path.basename(sys.argv[0]))[0]
    path = path or os.path.join(RESULTS_DIR, ".".join([name, *_run_flags(sys.argv[1:])]) + ".json")
    data = {
        "benchmark": name,
        "command": " ".join(["python", f"benchmarks/{os.path.basename(sys.argv[0])}", *sys.argv[1:]]),
        "date": _STARTED["date"],
        "machine": machine(),
        "load_average": {"start": _STARTED["load_average"], "end": list(load_average())},
        "torch_threads": torch.get_num_threads(),
        "versions": versions(),
        "tables": _RECORDED,
    }
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            json.dump(data, f, indent=1)
            f.write("\n")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    print(f"results: {os.path.relpath(path)}")
    return path
