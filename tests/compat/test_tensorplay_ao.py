"""``import tensorplay.ao.pruning`` gives prunekit's pruning API.

Every check that depends on interpreter start-up runs in a fresh interpreter
(subprocess) of the project's environment, where prunekit's editable install
put ``prunekit-tensorplay-ao.pth`` into site-packages. The full install /
uninstall round trip in a new virtual environment takes about a minute (marked
``slow``: ``make test`` runs it, ``make test-fast`` does not); the fast structural test checks what
it relies on (the files pip records for prunekit).
"""

import importlib.metadata
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("tensorplay")

import prunekit  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
PTH = "prunekit-tensorplay-ao.pth"

# The names TensorPlay's documentation lists for tensorplay.ao.pruning.
DOCUMENTED = sorted([
    "l1_unstructured", "random_unstructured", "custom_from_mask", "global_unstructured", "identity",
    "L1Unstructured", "RandomUnstructured", "CustomFromMask", "Identity", "ln_structured",
    "random_structured", "LnStructured", "RandomStructured", "remove", "is_pruned",
    "validate_pruning_amount", "compute_nparams_to_prune", "BasePruningMethod", "PruningContainer",
])

# TensorPlay's documented example (its page "Pruning - tensorplay.ao.pruning"), statement for statement.
DOCUMENTED_EXAMPLE = """\
import tensorplay as tp
from tensorplay.ao.pruning import l1_unstructured, ln_structured, is_pruned

model = tp.nn.Linear(64, 32, bias=False)

l1_unstructured(model, name="weight", amount=0.3)

ln_structured(model, name="weight", amount=0.1, n=2, dim=0)

print(is_pruned(model))
print(model.weight_mask)
"""


def run_python(code, env=None, cwd=None, python=sys.executable):
    """Run ``code`` in a fresh interpreter; returns the CompletedProcess (text)."""
    full_env = {k: v for k, v in os.environ.items() if k != "PRUNEKIT_TENSORPLAY_AO"}
    full_env.update(env or {})
    return subprocess.run([python, "-c", code], capture_output=True, text=True, env=full_env,
                          cwd=cwd or ROOT, timeout=300)


def test_documented_example_runs_verbatim_in_a_fresh_interpreter():
    code = DOCUMENTED_EXAMPLE + textwrap.dedent("""
        import prunekit
        rows_zero = int(((model.weight_mask == 0).sum(dim=1) == 64).sum())
        print("zeros", int((model.weight_mask == 0).sum()), "rows", rows_zero,
              "prunekit's", l1_unstructured is prunekit.l1_unstructured)
        print(type(model.weight_mask).__module__.split(".")[0])
    """)
    r = run_python(code)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == "True"
    assert lines[1].startswith("tensor([[")
    # 614 smallest of 2048 (30%), then 3 whole rows of 32 (10%, rounded) on top
    zeros, rows, ours = lines[-2].split()[1], lines[-2].split()[3], lines[-2].split()[5]
    assert int(rows) == 3 and 614 <= int(zeros) <= 614 + 3 * 64 and ours == "True"
    assert lines[-1] == "tensorplay"  # the mask is a TensorPlay tensor: nothing left TensorPlay
    assert r.stderr == ""


def test_start_up_imports_neither_torch_nor_prunekit():
    code = ("import sys; print(sorted(m for m in sys.modules "
            "if m.split('.')[0] in ('torch', 'prunekit', 'tensorplay', 'numpy', '_prunekit_tensorplay_ao')))")
    r = run_python(code)
    assert r.returncode == 0, r.stderr
    # only the finder's own small module (os and sys only) is loaded at start-up: the .pth is active
    assert r.stdout.strip() == "['_prunekit_tensorplay_ao']"
    off = run_python(code, env={"PRUNEKIT_TENSORPLAY_AO": "0"})
    assert off.stdout.strip() == "[]"
    import _prunekit_tensorplay_ao as boot
    source = Path(boot.__file__).read_text()
    imports = sorted({line.split()[1] for line in source.splitlines() if line.startswith(("import ", "from "))})
    assert imports == ["os", "sys"]  # at module level; importlib.util only when tensorplay.ao is imported


def test_all_and_objects_are_prunekits_and_help_says_so():
    import pydoc

    import tensorplay.ao.pruning as pruning

    assert sorted(pruning.__all__) == DOCUMENTED
    for name in DOCUMENTED:
        assert getattr(pruning, name) is getattr(prunekit, name), name
    assert pruning.provided_by == f"prunekit {prunekit.__version__}"
    text = pydoc.render_doc(pruning, renderer=pydoc.plaintext)
    assert "provided by prunekit -- not part of TensorPlay" in text
    assert "prunekit's README" in text and "PRUNEKIT_TENSORPLAY_AO=0" in text
    assert str(Path(prunekit.__file__).parent / "compat" / "tensorplay_ao" / "pruning.py") in text  # FILE
    for name in DOCUMENTED:
        assert name in text
    with pytest.raises(ModuleNotFoundError, match="tensorplay.ao.quantization"):
        import tensorplay.ao.quantization  # noqa: F401  (only pruning is served)


def test_switched_off_by_the_environment_variable():
    r = run_python(DOCUMENTED_EXAMPLE, env={"PRUNEKIT_TENSORPLAY_AO": "0"})
    assert r.returncode == 1 and "ModuleNotFoundError: No module named 'tensorplay.ao'" in r.stderr
    # also when set after start-up, before the first import
    later = run_python("import os; os.environ['PRUNEKIT_TENSORPLAY_AO'] = '0'\n" + DOCUMENTED_EXAMPLE)
    assert later.returncode == 1 and "No module named 'tensorplay.ao'" in later.stderr


def test_a_real_tensorplay_ao_pruning_wins_silently(tmp_path):
    # a future TensorPlay that ships the module: a stand-in package earlier on sys.path
    pkg = tmp_path / "tensorplay" / "ao"
    pkg.mkdir(parents=True)
    (tmp_path / "tensorplay" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "pruning.py").write_text("ORIGIN = 'tensorplay itself'\n")
    r = run_python("import tensorplay.ao.pruning as p; print(p.ORIGIN, p.__file__)",
                   env={"PYTHONPATH": str(tmp_path)})
    assert r.returncode == 0 and r.stderr == ""
    assert r.stdout.strip() == f"tensorplay itself {pkg / 'pruning.py'}"
    # a TensorPlay with tensorplay.ao but no pruning: prunekit fills in only the missing module
    (pkg / "pruning.py").unlink()
    r = run_python("import tensorplay.ao as ao, tensorplay.ao.pruning as p, prunekit; "
                   "print(ao.__file__, p.l1_unstructured is prunekit.l1_unstructured)",
                   env={"PYTHONPATH": str(tmp_path)})
    assert r.returncode == 0 and r.stdout.strip() == f"{pkg / '__init__.py'} True"


def test_a_finder_registered_after_ours_wins():
    code = textwrap.dedent("""
        import sys, types, importlib.machinery
        class Real:
            @classmethod
            def find_spec(cls, name, path=None, target=None):
                if name in ("tensorplay.ao", "tensorplay.ao.pruning"):
                    return importlib.machinery.ModuleSpec(name, cls, is_package=name == "tensorplay.ao")
            @staticmethod
            def create_module(spec):
                return None
            @staticmethod
            def exec_module(module):
                module.ORIGIN = "another finder"
        sys.meta_path.append(Real)  # after prunekit's
        import tensorplay.ao.pruning as p
        print(p.ORIGIN)
    """)
    r = run_python(code)
    assert r.returncode == 0 and r.stdout.strip() == "another finder", r.stderr


def test_pip_owns_the_files_and_none_is_inside_tensorplay():
    """What uninstalling relies on: every file prunekit adds is in prunekit's RECORD, none under tensorplay/."""
    import _prunekit_tensorplay_ao

    files = [str(f) for f in importlib.metadata.files("prunekit")]
    assert PTH in files
    # a regular install records the finder's module; an editable one finds it beside the package sources
    assert "_prunekit_tensorplay_ao.py" in files or (
        Path(_prunekit_tensorplay_ao.__file__).parent == Path(prunekit.__file__).parent.parent
        and any(f.startswith("__editable__.prunekit") for f in files))
    assert not [f for f in files if f.split("/")[0] == "tensorplay"]
    dist = importlib.metadata.distribution("prunekit")
    pth = Path(dist.locate_file(PTH))
    assert pth.read_text() == ('import os; os.environ.get("PRUNEKIT_TENSORPLAY_AO", "1") == "0" '
                               'or __import__("_prunekit_tensorplay_ao").install()\n')
    tensorplay_files = {str(f) for f in importlib.metadata.files("tensorplay")}
    assert not [f for f in tensorplay_files if f.startswith("tensorplay/ao/")]
    assert not (Path(importlib.metadata.distribution("tensorplay").locate_file("tensorplay")) / "ao").exists()


def _tree(folder: Path):
    import hashlib

    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file() and "__pycache__" not in p.parts}


@pytest.mark.slow
@pytest.mark.parametrize("editable", [False, True])
def test_install_and_uninstall_in_a_fresh_venv_leave_tensorplay_as_it_was(tmp_path, editable):
    import shutil

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = str(venv / "bin" / "python")
    pip = [py, "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    subprocess.run(pip + ["torch==2.13.0", "tensorplay==1.0.0", "numpy", "setuptools>=64"], check=True)
    site = Path(subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    before = _tree(site / "tensorplay")
    src = tmp_path / "src"  # a copy, so the build writes nothing into the working tree
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".venv", ".git", "build", "*.egg-info", "__pycache__",
                                                             ".hypothesis", ".pytest_cache", "demo-out"))
    subprocess.run(pip + ["--no-deps", "--no-build-isolation"] + (["-e"] if editable else []) + [str(src)],
                   check=True)
    assert (site / PTH).is_file()
    r = run_python(DOCUMENTED_EXAMPLE, python=py, cwd=tmp_path)
    assert r.returncode == 0 and r.stdout.splitlines()[0] == "True", r.stderr
    assert _tree(site / "tensorplay") == before
    subprocess.run([py, "-m", "pip", "uninstall", "-y", "-q", "prunekit"], check=True)
    assert _tree(site / "tensorplay") == before
    assert not (site / PTH).exists() and not (site / "_prunekit_tensorplay_ao.py").exists()
    r = run_python(DOCUMENTED_EXAMPLE, python=py, cwd=tmp_path)
    assert r.returncode == 1 and "No module named 'tensorplay.ao'" in r.stderr
