"""Size limits for src/: no function over 100 lines, no module over 600 lines.

Usage: python tools/check_sizes.py src/prunekit [--baseline tools/size_baseline.txt]

The baseline lists the modules and functions over a limit today, each with its current size: they may
shrink but not grow, and nothing new may pass a limit (a ratchet). A line of the baseline reads
``module path:lines`` or ``module path::qualified.function:lines``. Exit status 1 with one line per
problem; 0 when clean.
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

MODULE_LIMIT = 600
FUNCTION_LIMIT = 100
# generated tables are exempt
EXEMPT_SUFFIXES = ("_tables.py",)


def functions(tree: ast.AST, prefix: str = ""):
    """``(qualified name, lines)`` of every function and method, nested ones included."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            name = f"{prefix}{node.name}"
            yield name, node.end_lineno - node.lineno + 1
            yield from functions(node, name + ".")
        elif isinstance(node, ast.ClassDef):
            yield from functions(node, f"{prefix}{node.name}.")


def measure(root: Path) -> dict[str, int]:
    """Every size over a limit under ``root``, keyed as in the baseline."""
    over: dict[str, int] = {}
    for path in sorted(root.rglob("*.py")):
        if path.name.endswith(EXEMPT_SUFFIXES):
            continue
        rel = path.relative_to(root.parent).as_posix()
        text = path.read_text()
        lines = len(text.splitlines())
        if lines > MODULE_LIMIT:
            over[rel] = lines
        for name, n in functions(ast.parse(text)):
            if n > FUNCTION_LIMIT:
                over[f"{rel}::{name}"] = n
    return over


def read_baseline(path: Path) -> dict[str, int]:
    out = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            line = line.strip()
            if line and not line.startswith("#"):
                key, _, n = line.rpartition(":")
                out[key] = int(n)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("root", type=Path)
    ap.add_argument("--baseline", type=Path, default=Path(__file__).with_name("size_baseline.txt"))
    ap.add_argument("--write-baseline", action="store_true", help="record today's sizes as the baseline")
    args = ap.parse_args(argv)
    over = measure(args.root)
    if args.write_baseline:
        lines = [f"# over the limits of tools/check_sizes.py ({MODULE_LIMIT} lines a module, "
                 f"{FUNCTION_LIMIT} a function): may shrink, never grow"]
        args.baseline.write_text("\n".join(lines + [f"{k}:{v}" for k, v in sorted(over.items())]) + "\n")
        print(f"sizes: baseline of {len(over)} entries written to {args.baseline}")
        return 0
    baseline = read_baseline(args.baseline)
    problems = []
    for key, n in sorted(over.items()):
        limit = MODULE_LIMIT if "::" not in key else FUNCTION_LIMIT
        kind = "module" if "::" not in key else "function"
        if key not in baseline:
            problems.append(f"{key}: {kind} of {n} lines (limit {limit}): split it")
        elif n > baseline[key]:
            problems.append(f"{key}: {kind} grew from {baseline[key]} to {n} lines (limit {limit}): split it")
    for line in problems:
        print(line)
    print(f"sizes: {len(over)} over the limits, {len(baseline)} in the baseline, {len(problems)} problems")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
