"""The public surface: torch's names all exist, every exported name resolves."""

import subprocess
import sys

import torch.nn.utils.prune as tprune

import prunekit


def test_every_public_torch_name_exists_in_prunekit():
    torch_names = [n for n in dir(tprune) if not n.startswith("_") and callable(getattr(tprune, n))
                   and getattr(getattr(tprune, n), "__module__", "") == tprune.__name__]
    missing = [n for n in torch_names if not hasattr(prunekit, n)]
    assert missing == []
    for private in ("_validate_pruning_amount_init", "_validate_pruning_amount", "_compute_nparams_toprune"):
        assert hasattr(prunekit, private)


def test_every_name_in_all_resolves():
    for name in prunekit.__all__:
        assert getattr(prunekit, name) is not None, name
    for sub in ("compact", "training", "sparse"):
        assert getattr(prunekit, sub).__name__ == f"prunekit.{sub}"


def test_import_needs_torch_only():
    code = ("import sys, prunekit; heavy = {'safetensors', 'yaml', 'rich', 'matplotlib', 'tensorplay', 'transformers'}; "
            "print(sorted(heavy & set(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]"
