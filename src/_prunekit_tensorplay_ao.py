"""Serve ``tensorplay.ao.pruning`` from prunekit when TensorPlay ships no such module.

TensorPlay documents its pruning API as ``tensorplay.ao.pruning`` (and tests it
under that name), but the released ``tensorplay`` 1.0.0 ships no ``tensorplay.ao``.
prunekit implements that API. This module lets ``import tensorplay.ao.pruning``
(and ``from tensorplay.ao.pruning import l1_unstructured, ...``) give prunekit's
pruning API, so TensorPlay's documentation and tests run unchanged.

How it is installed
-------------------
prunekit's wheel (regular and editable) puts one file next to this module in
``site-packages``, ``prunekit-tensorplay-ao.pth``, holding one line::

    import os; os.environ.get("PRUNEKIT_TENSORPLAY_AO", "1") == "0" or __import__("_prunekit_tensorplay_ao").install()

The ``site`` module runs that line at interpreter start-up. It imports only this
small module (``os`` and ``sys`` are already loaded at start-up), which appends
one finder to ``sys.meta_path``; nothing else happens until a program imports
``tensorplay.ao``. torch, TensorPlay and prunekit are not imported at start-up.

Why a finder registered by a ``.pth`` file
------------------------------------------
The alternative -- shipping ``tensorplay/ao/pruning.py`` inside prunekit's wheel
-- would put files into another distribution's package folder: pip would record
them as prunekit's, a reinstall or upgrade of ``tensorplay`` could overwrite or
delete them, and a future TensorPlay that ships its own ``tensorplay/ao`` would
clash with them file for file. A finder owns nothing on disk but its own two
files, which pip installs and uninstalls with prunekit; TensorPlay's folder is
never touched. This is the mechanism setuptools uses for its ``distutils``
shim (``distutils-precedence.pth``) and coverage-style start-up hooks use.

Rules the finder keeps
----------------------
* It never shadows a real module: it sits at the end of ``sys.meta_path`` and
  answers only for ``tensorplay.ao`` and ``tensorplay.ao.pruning``, and only
  when no other finder can find them. A TensorPlay release that ships
  ``tensorplay.ao.pruning`` wins, and prunekit says nothing.
* ``PRUNEKIT_TENSORPLAY_AO=0`` in the environment switches it off: at start-up
  (the finder is not even registered) or later in the process (it declines).
* The modules it serves are ordinary files of prunekit
  (``prunekit/compat/tensorplay_ao/``): their ``__all__`` and objects are
  prunekit's, and ``help(tensorplay.ao.pruning)`` says so.
"""

import os
import sys

__all__ = ["ENV_VAR", "TensorPlayAoFinder", "install", "uninstall"]

ENV_VAR = "PRUNEKIT_TENSORPLAY_AO"
_SERVED = {
    "tensorplay.ao": ("__init__.py", True),
    "tensorplay.ao.pruning": ("pruning.py", False),
}


def _enabled() -> bool:
    return os.environ.get(ENV_VAR, "1") != "0"


class TensorPlayAoFinder:
    """A meta-path finder for ``tensorplay.ao`` and ``tensorplay.ao.pruning`` (see the module docstring)."""

    @classmethod
    def find_spec(cls, fullname, path=None, target=None):
        if fullname not in _SERVED or not _enabled():
            return None
        if any(_other_finds(f, fullname, path, target) for f in sys.meta_path if f is not cls):
            return None  # a real module exists: it wins
        import importlib.util

        prunekit = importlib.util.find_spec("prunekit")  # locates prunekit without importing it
        if prunekit is None or not prunekit.submodule_search_locations:
            return None
        filename, is_package = _SERVED[fullname]
        folder = os.path.join(list(prunekit.submodule_search_locations)[0], "compat", "tensorplay_ao")
        location = os.path.join(folder, filename)
        if not os.path.isfile(location):
            return None
        return importlib.util.spec_from_file_location(
            fullname, location, submodule_search_locations=[] if is_package else None
        )

    @classmethod
    def invalidate_caches(cls):
        pass


def _other_finds(finder, fullname, path, target) -> bool:
    find_spec = getattr(finder, "find_spec", None)
    if find_spec is None:
        return False
    try:
        return find_spec(fullname, path, target) is not None
    except Exception:  # a broken third-party finder must not break this import
        return False


def install() -> None:
    """Append the finder to ``sys.meta_path`` (once). Called by the ``.pth`` file at start-up."""
    if TensorPlayAoFinder not in sys.meta_path:
        sys.meta_path.append(TensorPlayAoFinder)


def uninstall() -> None:
    """Remove the finder from ``sys.meta_path`` (modules already imported stay in ``sys.modules``)."""
    while TensorPlayAoFinder in sys.meta_path:
        sys.meta_path.remove(TensorPlayAoFinder)
