"""MkDocs hooks: the home page is the README; the benchmarks page is generated from the results files under
``benchmarks/results/``, the supported-models page from the zoo matrices' table ``docs/data/zoo.json``.

``docs/benchmarks.md`` holds the marker ``<!-- benchmark-results -->``; at build time it is replaced by one
section per results file (written by ``benchmarks/_harness.py``): the command, date, machine, load
averages, versions and every table the run printed. No figure on the page comes from anywhere else.
``docs/supported-models.md`` holds ``<!-- zoo-table -->``, replaced by the table ``make test-zoo`` wrote
(``tests/helpers/zoo_table.py``): per matrix the count of each outcome, then one row per model.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

MARKER = "<!-- benchmark-results -->"
README_MARKER = "<!-- readme -->"
ZOO_MARKER = "<!-- zoo-table -->"
ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
ZOO = ROOT / "docs" / "data" / "zoo.json"


def readme_for_site() -> str:
    """The README as the site's home page: links into docs/ made site-relative, links to repository files
    outside docs/ kept as plain names."""
    text = (ROOT / "README.md").read_text()
    text = re.sub(r"\]\(docs/", "](", text)
    return re.sub(r"\[([^\]]+)\]\((?!https?:|#)([^)]+\.md|LICENSE)\)",
                  lambda m: m.group(0) if (ROOT / "docs" / m.group(2)).exists() else f"`{m.group(2)}`", text)


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def render_result(data: dict) -> str:
    """Markdown of one results file."""
    m, load = data.get("machine", {}), data.get("load_average", {})
    versions = ", ".join(f"{k} {v}" for k, v in data.get("versions", {}).items())
    mem = m.get("memory_bytes")
    lines = [f"## {data['benchmark']}", "",
             f"`{data['command']}`", "",
             f"- date: {data.get('date', '?')}",
             f"- machine: {m.get('cpu', '?')}, {m.get('cores', '?')} cores"
             + (f", {mem / 2**30:.0f} GiB" if mem else "") + f", {m.get('os', '?')}",
             f"- torch threads: {data.get('torch_threads', '?')}",
             f"- load average (1, 5, 15 min) at start: {load.get('start')}, at end: {load.get('end')}",
             f"- versions: {versions}", ""]
    for t in data.get("tables", []):
        if t.get("title"):
            lines += [f"### {t['title']}", ""]
        lines.append("| " + " | ".join(_cell(h) for h in t["header"]) + " |")
        lines.append("|" + "---|" * len(t["header"]))
        lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in t["rows"]]
        lines.append("")
    return "\n".join(lines)


def render_all(results: Path = RESULTS) -> str:
    files = sorted(results.glob("*.json")) if results.is_dir() else []
    if not files:
        return "No results yet: run a benchmark (each writes `benchmarks/results/<name>.json`)."
    return "\n".join(render_result(json.loads(f.read_text())) for f in files)


def _ratio(x) -> str:
    return "-" if x is None else f"{x:.3f}"


def render_zoo(path: Path = ZOO) -> str:
    """Markdown of the zoo table: where it came from, then per matrix the counts and one row per model."""
    if not path.is_file():
        return "No zoo table yet: `make test-zoo` writes `docs/data/zoo.json`."
    data = json.loads(path.read_text())
    versions = ", ".join(f"{k} {v}" for k, v in data.get("versions", {}).items())
    lines = [f"`{data['command']}` on {data.get('date', '?')}; versions: {versions}.", ""]
    matrices: dict = {}
    for r in data["rows"]:
        matrices.setdefault(r["matrix"], []).append(r)
    for matrix, rows in matrices.items():
        counts: dict = {}
        for r in rows:
            counts[r["outcome"]] = counts.get(r["outcome"], 0) + 1
        lines += [f"### {matrix}", "",
                  f"{len(rows)} models: " + ", ".join(f"{n} {k}" for k, n in sorted(counts.items())) + ".", "",
                  "| model | outcome | MACs ratio | parameters ratio | reason or note |", "|---|---|---|---|---|"]
        lines += [f"| {_cell(r['model'])} | {_cell(r['outcome'])} | {_ratio(r.get('macs_ratio'))} | "
                  f"{_ratio(r.get('params_ratio'))} | {_cell(r.get('reason', ''))} |" for r in rows]
        lines.append("")
    return "\n".join(lines)


def on_page_markdown(markdown: str, page, config, files) -> str:  # noqa: ARG001 - MkDocs hook signature
    if README_MARKER in markdown:
        markdown = markdown.replace(README_MARKER, readme_for_site())
    if ZOO_MARKER in markdown:
        markdown = markdown.replace(ZOO_MARKER, render_zoo())
    if MARKER in markdown:
        return markdown.replace(MARKER, render_all())
    return markdown
