"""Build hooks: install ``prunekit-tensorplay-ao.pth`` at the root of site-packages.

All metadata lives in pyproject.toml; this file only makes sure the one-line
``.pth`` that registers the ``tensorplay.ao.pruning`` finder (see
``src/_prunekit_tensorplay_ao.py`` for the mechanism and why) is part of every
wheel prunekit builds:

* regular wheels (``pip install .``, ``python -m build``): ``build_py`` writes it
  into the build folder's root, which becomes the wheel's root, which pip
  installs into site-packages and records for uninstall;
* editable wheels (``pip install -e .``, what ``make`` uses): setuptools'
  ``editable_wheel`` ignores the build folder, so the command below adds the
  file to the editable wheel it built, with its RECORD line, and pip installs
  and uninstalls it like any other file of the wheel.

Data files (``data_files``) cannot do this: they install under the ``data``
scheme (``sys.prefix``), not into site-packages, where ``.pth`` files must be.
"""

import base64
import hashlib
import os
import zipfile

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel

PTH_NAME = "prunekit-tensorplay-ao.pth"
PTH_LINE = (
    'import os; os.environ.get("PRUNEKIT_TENSORPLAY_AO", "1") == "0" '
    'or __import__("_prunekit_tensorplay_ao").install()\n'
)


class BuildPyWithPth(build_py):
    """``build_py`` that also writes the ``.pth`` file at the root of the build folder."""

    def run(self):
        super().run()
        target = os.path.join(self.build_lib, PTH_NAME)
        self.mkpath(self.build_lib)
        with open(target, "w", encoding="utf-8") as f:
            f.write(PTH_LINE)

    def get_outputs(self, include_bytecode=True):
        return super().get_outputs(include_bytecode) + [os.path.join(self.build_lib, PTH_NAME)]


class EditableWheelWithPth(editable_wheel):
    """``editable_wheel`` that adds the ``.pth`` file (and its RECORD line) to the wheel it built."""

    def run(self):
        super().run()
        wheels = [f for f in os.listdir(self.dist_dir) if f.endswith(".whl") and ".editable" in f]
        if not wheels:
            raise RuntimeError(f"no editable wheel found in {self.dist_dir} to add {PTH_NAME} to")
        for name in wheels:
            _add_to_wheel(os.path.join(self.dist_dir, name), PTH_NAME, PTH_LINE.encode("utf-8"))


def _add_to_wheel(path, arcname, data):
    """Rewrite wheel ``path`` with ``arcname`` added at its root and listed in its RECORD."""
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode("ascii")
    tmp = path + ".tmp"
    with zipfile.ZipFile(path) as src, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as dst:
        names = src.namelist()
        if arcname in names:
            os.remove(tmp)
            return
        record = next(n for n in names if n.endswith(".dist-info/RECORD"))
        for info in src.infolist():
            body = src.read(info.filename)
            if info.filename == record:
                body = body.rstrip(b"\n") + f"\n{arcname},sha256={digest},{len(data)}\n".encode("ascii")
            dst.writestr(info, body)
        dst.writestr(arcname, data)
    os.replace(tmp, path)


setup(cmdclass={"build_py": BuildPyWithPth, "editable_wheel": EditableWheelWithPth})
