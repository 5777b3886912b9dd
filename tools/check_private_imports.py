"""Fail when a prunekit module imports a private name (``_x``) from another package of prunekit.

The layering contracts (``.importlinter``) check which modules import which;
this checks *what* they import: a name starting with one underscore is private
to its package (``prunekit.training``, ``prunekit.compact``, ... or the
top-level modules, which form the package ``prunekit`` itself), so another
package must not import it -- it should use a public name, or the helper
should move to a module both can use. Private *modules* of the root package
(``prunekit._backend``) are shared machinery: their public names may be
imported from anywhere. A private module of another package
(``prunekit.training._undo``) is that package's own, except the internal tiers
named in ``INTERNAL_TIERS``: the modules through which a package hands other
packages of prunekit what is not public (``prunekit.reparam._internal``).

Run by ``make lint``: ``python tools/check_private_imports.py [src/prunekit]``.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path
from typing import Iterator, List, Optional, Tuple

# private modules that other packages may import from: a package's internal tier
INTERNAL_TIERS = frozenset({"prunekit.reparam._internal"})


def package_of(module: str) -> str:
    """``prunekit.training`` for ``prunekit.training.report``; ``prunekit`` for ``prunekit.methods``."""
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 2 else parts[0]


def module_name(path: Path, root: Path) -> Tuple[str, bool]:
    rel = path.relative_to(root.parent).with_suffix("")
    parts = list(rel.parts)
    is_package = parts[-1] == "__init__"
    if is_package:
        parts = parts[:-1]
    return ".".join(parts), is_package


def resolve(importer: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = importer.split(".")
    if not is_package:
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def private_module(target: str, root: Path) -> Optional[str]:
    """The first private module of a sub-package on the dotted path ``target`` (``None`` if none)."""
    parts = target.split(".")
    for i in range(2, len(parts)):
        if parts[i].startswith("_") and not parts[i].startswith("__"):
            path = root / Path(*parts[1:i + 1])
            if path.with_suffix(".py").exists() or (path / "__init__.py").exists():
                return ".".join(parts[:i + 1])
            return None
    return None


def violations(root: Path) -> Iterator[str]:
    for path in sorted(root.rglob("*.py")):
        importer, is_package = module_name(path, root)
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom):
                continue
            source = resolve(importer, is_package, node)
            if not source.startswith(root.name):
                continue
            for alias in node.names:
                name = alias.name
                module = private_module(f"{source}.{name}", root)
                if module is not None and module not in INTERNAL_TIERS and \
                        package_of(module) != package_of(importer if not is_package else importer + ".x"):
                    yield f"{path}:{node.lineno}: {importer} imports from the private module {module} of another package"
                    continue
                if not name.startswith("_") or name.startswith("__"):
                    continue
                target = f"{source}.{name}"
                if (root / Path(*target.split(".")[1:])).with_suffix(".py").exists() or \
                        (root / Path(*target.split(".")[1:]) / "__init__.py").exists():
                    continue  # a private module, not a private name
                if package_of(source + ".x") != package_of(importer if not is_package else importer + ".x"):
                    yield f"{path}:{node.lineno}: {importer} imports the private name {name} from {source}"


def main(argv: List[str]) -> int:
    root = Path(argv[1] if len(argv) > 1 else "src/prunekit").resolve()
    found = list(violations(root))
    for line in found:
        print(line)
    if found:
        print(f"{len(found)} private name(s) imported across packages; use a public name or move the helper "
              "to a module both packages may import")
        return 1
    print("private names: none imported across packages")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
