"""The zoo matrices' table: one row per zoo test (matrix, model, outcome, reason or error, MACs ratio).

A zoo test records what it found with pytest's ``record_property`` (``outcome``, ``reason``,
``macs_ratio``, ``params_ratio``); ``conftest.py`` turns each finished zoo test's report into a
:class:`Row` with :func:`row`, prints the table at the end of the run and, with
``--zoo-table PATH`` (``make test-zoo`` passes ``docs/data/zoo.json``), writes it as JSON. The docs'
supported-models page is generated from that file (``tools/mkdocs_hooks.py``).
"""

from __future__ import annotations

import json
import os
import platform
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from importlib import metadata
from typing import Any, Dict, Iterable, List, Optional, Sequence

#: test module -> the matrix its rows belong to
MATRICES = {
    "test_zoo_torchvision": "torchvision: prune 30% of every channel group, compact",
    "test_zoo_timm": "timm: prune 30% of every channel group, compact",
    "test_zoo_hf": "transformers: compact half the heads and FFN, save_pretrained, plain from_pretrained",
    "test_oneshot_zoo": "transformers: one-shot 50% (SparseGPT), experts included",
    "test_io_zoo_exports": "transformers: 2:4 one-shot, export, load back",
}

#: packages whose versions the file records
PACKAGES = ("torch", "torchvision", "timm", "transformers", "compressed-tensors", "prunekit")


@dataclass
class Row:
    """One zoo test's result."""

    matrix: str
    model: str
    outcome: str  # what the test recorded ("exact", "blocked", "round-trip", ...), or "failed" / "skipped"
    reason: str = ""  # why a model is blocked or refused, or the failure's first line
    macs_ratio: Optional[float] = None
    params_ratio: Optional[float] = None


def row(module: str, case_id: str, passed: bool, skipped: bool, properties: Sequence[Any],
        failure: str = "") -> Optional[Row]:
    """The :class:`Row` of a finished test of zoo module ``module`` (None for a module outside :data:`MATRICES`).

    ``case_id`` is the parametrization id (``resnet18-exact``: the model, then the expected outcome);
    ``properties`` the test's ``record_property`` pairs.
    """
    if module not in MATRICES:
        return None
    props = dict(properties)
    if passed and "outcome" not in props:
        return None  # a zoo module's test of one mechanism, not a model of the matrix
    model = str(props.get("model") or case_id.split("-", 1)[0])
    if skipped:
        outcome, reason = "skipped", failure
    elif not passed:
        outcome, reason = "failed", failure.strip().splitlines()[-1][:300] if failure.strip() else ""
    else:
        outcome, reason = str(props.get("outcome", "passed")), str(props.get("reason", ""))
    ratios = {k: (None if props.get(k) is None else round(float(props[k]), 4)) for k in ("macs_ratio", "params_ratio")}
    return Row(MATRICES[module], model, outcome, reason, **ratios)


def summary(rows: Iterable[Row]) -> Dict[str, Dict[str, int]]:
    """Per matrix, the number of rows of each outcome."""
    out: Dict[str, Dict[str, int]] = {}
    for r in rows:
        counts = out.setdefault(r.matrix, {})
        counts[r.outcome] = counts.get(r.outcome, 0) + 1
    return out


def text(rows: List[Row], every_row: bool = True) -> List[str]:
    """The table as plain lines for the terminal: per matrix its counts, then each row (without
    ``every_row``, only the rows that failed or were skipped)."""
    lines: List[str] = []
    width = max((len(r.outcome) for r in rows), default=0)
    for matrix, counts in summary(rows).items():
        lines.append(f"{matrix}: " + ", ".join(f"{n} {k}" for k, n in sorted(counts.items())))
        for r in rows:
            if r.matrix != matrix or not (every_row or r.outcome in ("failed", "skipped")):
                continue
            macs = "" if r.macs_ratio is None else f"MACs x{r.macs_ratio:.3f}"
            lines.append(f"  {r.model:<34} {r.outcome:<{width}} {macs:<12} {r.reason}".rstrip())
    return lines


def write(rows: List[Row], path: str, command: str) -> None:
    """Write the table to ``path`` (JSON: command, date, machine, versions, rows), atomically."""
    versions: Dict[str, str] = {"python": platform.python_version()}
    for p in PACKAGES:
        try:
            versions[p] = metadata.version(p)
        except metadata.PackageNotFoundError:
            continue
    data = {"command": command, "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "machine": {"os": platform.platform(), "cores": os.cpu_count()}, "versions": versions,
            "rows": [asdict(r) for r in sorted(rows, key=lambda r: (list(MATRICES.values()).index(r.matrix), r.model))]}
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".zoo-", suffix=".json")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1)
            f.write("\n")
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def command_line() -> str:
    """The pytest command as typed (for the file's ``command``)."""
    return "python -m pytest " + " ".join(sys.argv[1:])
