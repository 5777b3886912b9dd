"""Real English sentences that ship offline: the docstrings of Python's standard library.

Calibration and evaluation text for one-shot pruning (the demo's MiniLM-L6
stage, the one-shot tests and ``benchmarks/bench_oneshot.py``): sentences are
split from the docstrings of a fixed list of standard-library modules (their
classes and functions included), filtered to plain prose, deduplicated, ordered
by a fixed-seed shuffle, and cut into disjoint sets. No download, no data file.
"""

from __future__ import annotations

import importlib
import inspect
import random
import re
from typing import List, Tuple

__all__ = ["MODULES", "calibration_and_evaluation", "sentences"]

MODULES = (
    "argparse", "asyncio", "base64", "bisect", "calendar", "collections", "concurrent.futures", "configparser",
    "contextlib", "copy", "csv", "datetime", "decimal", "difflib", "email", "fractions", "ftplib", "functools",
    "gettext", "glob", "gzip", "hashlib", "heapq", "hmac", "html", "http.client", "http.server", "imaplib",
    "inspect", "io", "ipaddress", "itertools", "json", "locale", "logging", "mailbox", "mimetypes", "numbers",
    "operator", "optparse", "os", "pathlib", "pdb", "pickle", "platform", "poplib", "pprint", "queue", "random",
    "re", "sched", "secrets", "selectors", "shelve", "shlex", "shutil", "smtplib", "socket", "socketserver",
    "statistics", "string", "subprocess", "tarfile", "tempfile", "textwrap", "threading", "timeit", "tokenize",
    "trace", "traceback", "unittest", "urllib.parse", "urllib.request", "uuid", "warnings", "wave",
    "weakref", "xml.dom.minidom", "zipfile",
)

_SPLIT = re.compile(r"(?<=[.!?])\s+(?=[A-Z])")
_PROSE = re.compile(r"^[A-Z][A-Za-z ,;:'()-]+[a-z][.!?]$")


def _docstrings() -> List[str]:
    out = []
    for name in MODULES:
        try:
            mod = importlib.import_module(name)
        except ImportError:
            continue
        out.append(inspect.getdoc(mod) or "")
        for attr in sorted(vars(mod)):
            obj = getattr(mod, attr, None)
            if (inspect.isclass(obj) or inspect.isfunction(obj)) and getattr(obj, "__module__", "") == mod.__name__:
                out.append(inspect.getdoc(obj) or "")
    return out


def sentences() -> List[str]:
    """Every usable sentence, deduplicated, in a fixed shuffled order.

    Examples:
        >>> from prunekit.demo.text import sentences
        >>> s = sentences()
        >>> len(s) > 500, len(set(s)) == len(s), all(8 <= len(x.split()) <= 40 for x in s)
        (True, True, True)
    """
    seen, found = set(), []
    for doc in _docstrings():
        for para in re.split(r"\n\s*\n", doc):
            text = " ".join(para.split())
            for s in _SPLIT.split(text):
                words = s.split()
                if 8 <= len(words) <= 40 and _PROSE.match(s) and s not in seen:
                    seen.add(s)
                    found.append(s)
    found.sort()
    random.Random(1234).shuffle(found)
    return found


def calibration_and_evaluation(n_cal: int = 128, n_eval: int = 384) -> Tuple[List[str], List[str]]:
    """Two disjoint, fixed lists of sentences: ``n_cal`` for calibration, ``n_eval`` for evaluation.

    Examples:
        >>> from prunekit.demo.text import calibration_and_evaluation
        >>> cal, ev = calibration_and_evaluation(32, 96)
        >>> len(cal), len(ev), set(cal) & set(ev)
        (32, 96, set())
    """
    s = sentences()
    if len(s) < n_cal + n_eval:
        raise ValueError(f"calibration_and_evaluation: only {len(s)} sentences ship here, {n_cal} + {n_eval} "
                         "asked; ask for fewer")
    return s[:n_cal], s[n_cal:n_cal + n_eval]
