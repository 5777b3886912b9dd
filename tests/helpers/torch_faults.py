"""Companion tests that document a fault of ``torch.nn.utils.prune`` without depending on it.

Each ``test_torch_*`` companion shows torch failing where prunekit's test beside
it passes. Written as a plain ``pytest.raises``, such a test would itself fail
the day torch fixes the fault. These helpers state the fault instead: while
torch still shows it the test passes (and the fault is documented by the code
that shows it); once torch no longer does, the test is skipped with a message
naming the torch version and the fault, so the README's "torch fails here"
line can be revisited -- while prunekit's own test keeps running.
"""

import re
from contextlib import contextmanager

import pytest
import torch


def _fixed(what: str) -> None:
    pytest.skip(f"torch {torch.__version__} no longer shows this fault ({what}); "
                "update the README's comparison with torch.nn.utils.prune")


@contextmanager
def torch_fault(exc, match: str, what: str):
    """The block must raise ``exc`` with a message matching ``match`` (torch's fault), else skip.

    An exception of another type or message is not this fault and fails the test.
    """
    try:
        yield
    except exc as e:
        if re.search(match, str(e)):
            return
        raise
    _fixed(what)


def torch_still(shows_fault: bool, what: str) -> None:
    """Pass while ``shows_fault`` (torch's documented behaviour) holds, else skip with a message."""
    if not shows_fault:
        _fixed(what)
