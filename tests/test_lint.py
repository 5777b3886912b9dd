"""The layering contracts and the private-name check catch what they are for.

``make lint`` runs them on the tree (and ``make test`` runs ``make lint``); here
each is run on a copy of the package with one deliberate violation, to show it
fails then -- a contract that cannot fail would prove nothing.
"""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"


def copy_package(tmp_path):
    dst = tmp_path / "src" / "prunekit"
    shutil.copytree(ROOT / "src" / "prunekit", dst, ignore=shutil.ignore_patterns("__pycache__"))
    return dst


def lint_imports(tmp_path):
    env = {"PYTHONPATH": str(tmp_path / "src"), "PATH": str(Path(sys.executable).parent)}
    return subprocess.run([str(LINT_IMPORTS), "--config", str(ROOT / ".importlinter"), "--no-cache"],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)


@pytest.mark.skipif(not LINT_IMPORTS.exists(), reason="import-linter is not installed (the test extra pins it)")
def test_an_upward_import_breaks_the_layering_contract(tmp_path):
    pkg = copy_package(tmp_path)
    ok = lint_imports(tmp_path)
    assert ok.returncode == 0, ok.stdout + ok.stderr  # the copy as it is keeps every contract
    amount = pkg / "kernels" / "amount.py"
    amount.write_text(amount.read_text() + "\nfrom ..training import schedules  # deliberate upward import\n")
    broken = lint_imports(tmp_path)
    assert broken.returncode == 1
    assert "Layers import only downward (docs/architecture.md) BROKEN" in broken.stdout
    assert "prunekit.kernels is not allowed to import prunekit.training" in broken.stdout
    assert "prunekit.kernels.amount -> prunekit.training.schedules" in broken.stdout


def test_a_private_name_imported_across_packages_is_refused(tmp_path):
    pkg = copy_package(tmp_path)
    check = [sys.executable, str(ROOT / "tools" / "check_private_imports.py"), str(pkg)]
    ok = subprocess.run(check, capture_output=True, text=True)
    assert ok.returncode == 0 and ok.stdout.strip() == "private names: none imported across packages"
    (pkg / "compact" / "leak.py").write_text("from ..training.config import _as_ratio\nfrom . import _masks\n")
    bad = subprocess.run(check, capture_output=True, text=True)
    assert bad.returncode == 1
    lines = bad.stdout.splitlines()
    assert lines[0].endswith("leak.py:1: prunekit.compact.leak imports the private name _as_ratio "
                             "from prunekit.training.config")
    assert len(lines) == 2  # the private module _masks of its own package is fine
    (pkg / "compact" / "leak.py").write_text("from ..training._undo import UndoLog\nfrom ..reparam._internal import Snapshot\n")
    bad = subprocess.run(check, capture_output=True, text=True)
    assert bad.returncode == 1
    lines = bad.stdout.splitlines()
    assert lines[0].endswith("leak.py:1: prunekit.compact.leak imports from the private module prunekit.training._undo "
                             "of another package")
    assert len(lines) == 2  # reparam's internal tier is meant for other packages


def test_torch_fault_companions_skip_once_torch_is_fixed():
    from helpers.torch_faults import torch_fault, torch_still

    with torch_fault(RuntimeError, "view size", "a fault"):  # torch still fails: passes
        raise RuntimeError("view size is not compatible")
    with pytest.raises(pytest.skip.Exception, match=r"no longer shows this fault \(a fault\)"):
        with torch_fault(RuntimeError, "view size", "a fault"):
            pass  # torch fixed it: skipped with the message
    with pytest.raises(RuntimeError, match="something else"):
        with torch_fault(RuntimeError, "view size", "a fault"):
            raise RuntimeError("something else")  # another failure is not the documented fault
    torch_still(True, "a fault")
    with pytest.raises(pytest.skip.Exception, match="a fault"):
        torch_still(False, "a fault")


def test_the_size_check_refuses_a_new_long_function_and_a_grown_module(tmp_path):
    pkg = copy_package(tmp_path)
    check = [sys.executable, str(ROOT / "tools" / "check_sizes.py"), str(pkg),
             "--baseline", str(ROOT / "tools" / "size_baseline.txt")]
    ok = subprocess.run(check, capture_output=True, text=True)
    assert ok.returncode == 0, ok.stdout
    body = "\n".join(f"    x{i} = {i}" for i in range(101))
    (pkg / "kernels" / "long.py").write_text(f"def too_long():\n{body}\n")
    baseline = (ROOT / "tools" / "size_baseline.txt").read_text().splitlines()
    grown = next(line.rpartition(":")[0] for line in baseline if line.endswith(tuple("0123456789")) and "::" not in line)
    module = pkg.parent / grown
    module.write_text(module.read_text() + "\n# one more line\n")
    bad = subprocess.run(check, capture_output=True, text=True)
    assert bad.returncode == 1
    assert "prunekit/kernels/long.py::too_long: function of 102 lines (limit 100): split it" in bad.stdout
    assert f"{grown}: module grew from" in bad.stdout


@pytest.mark.slow
def test_the_wheel_ships_py_typed_and_the_license(tmp_path):
    import zipfile

    # the environment's setuptools builds it (no download); the copy keeps build/ and egg-info out of the tree
    src = tmp_path / "src_tree"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(
        ".git", ".venv", ".zoo", "build", "*.egg-info", "__pycache__", "tests", "docs", "benchmarks", "examples"))
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                            str(src), "-w", str(tmp_path / "dist")], capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stdout + build.stderr
    wheels = list((tmp_path / "dist").glob("prunekit-*.whl"))
    assert len(wheels) == 1
    names = zipfile.ZipFile(wheels[0]).namelist()
    assert "prunekit/py.typed" in names
    licenses = [n for n in names if n.endswith(".dist-info/licenses/LICENSE")]
    assert len(licenses) == 1
    assert zipfile.ZipFile(wheels[0]).read(licenses[0]) == (ROOT / "LICENSE").read_bytes()
