"""Unlabeled English text that ships with Python, for the shrink benchmark: no download, no data file.

* :func:`documents` -- the docstrings of the standard library (every importable public module and
  submodule, its classes, their methods, its functions) and the language reference topics of
  ``pydoc_data.topics``, deduplicated, in a fixed order;
* :func:`sentences` -- those split into sentences, deduplicated, in a fixed shuffled order.

The same Python version gives the same text (the results files record the version).
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import io
import pkgutil
import random
import re
import sys
import warnings
from typing import List, Tuple

# modules with side effects on import (a browser, a window, printed text), tests, or tools
SKIP = ("antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo", "test", "lib2to3", "ensurepip", "venv",
        "webbrowser", "pydoc", "__phello__", "xxsubtype", "msilib", "winreg", "winsound", "_")
SPLIT = re.compile(r"(?<=[.!?])\s+(?=[A-Z])")


def _skipped(name: str) -> bool:
    return any(part.startswith("_") or part in SKIP for part in name.split("."))


def _modules() -> List[str]:
    names = []
    for top in sorted(sys.stdlib_module_names):
        if _skipped(top):
            continue
        names.append(top)
        try:
            with _quiet():
                mod = importlib.import_module(top)
        except BaseException:  # noqa: BLE001 - a module that does not import here is left out
            continue
        for info in pkgutil.walk_packages(getattr(mod, "__path__", []) or [], prefix=top + ".", onerror=lambda n: None):
            if not _skipped(info.name):
                names.append(info.name)
    return names


@contextlib.contextmanager
def _quiet():
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), \
            contextlib.redirect_stderr(io.StringIO()):
        warnings.simplefilter("ignore")
        yield


def _docs_of(mod) -> List[Tuple[str, str]]:
    out = [(mod.__name__, inspect.getdoc(mod) or "")]
    for attr in sorted(vars(mod)):
        obj = getattr(mod, attr, None)
        if attr.startswith("_") or getattr(obj, "__module__", None) != mod.__name__:
            continue
        if inspect.isclass(obj):
            out.append((f"{mod.__name__}.{attr}", inspect.getdoc(obj) or ""))
            for meth in sorted(vars(obj)):
                fn = vars(obj)[meth]
                if not meth.startswith("_") and inspect.isfunction(fn):
                    out.append((f"{mod.__name__}.{attr}.{meth}", inspect.getdoc(fn) or ""))
        elif inspect.isfunction(obj):
            out.append((f"{mod.__name__}.{attr}", inspect.getdoc(obj) or ""))
    return out


def documents() -> List[Tuple[str, str]]:
    """``(name, text)`` of every standard-library docstring and reference topic, deduplicated, in a fixed order."""
    from pydoc_data.topics import topics

    found = [(f"topic:{k}", v) for k, v in sorted(topics.items())]
    for name in _modules():
        try:
            with _quiet():
                mod = importlib.import_module(name)
        except BaseException:  # noqa: BLE001
            continue
        found.extend(_docs_of(mod))
    seen, out = set(), []
    for name, text in found:
        text = text.strip()
        if len(text.split()) >= 8 and text not in seen:
            seen.add(text)
            out.append((name, text))
    return out


def sentences(docs: List[Tuple[str, str]]) -> List[str]:
    """Sentences of ``docs`` (6 to 60 words, a capital first, mostly words), deduplicated, in a fixed shuffled order."""
    seen, found = set(), []
    for _, doc in docs:
        for para in re.split(r"\n\s*\n", doc):
            text = " ".join(para.split())
            for s in SPLIT.split(text):
                words = s.split()
                if 6 <= len(words) <= 60 and s[0].isupper() and sum(w.isalpha() for w in words) >= 0.6 * len(words) \
                        and s not in seen:
                    seen.add(s)
                    found.append(s)
    found.sort()
    random.Random(1234).shuffle(found)
    return found
