"""prunekit.container: a deprecated import path of PruningContainer and combine_masks."""

import subprocess
import sys
import warnings

import pytest

import prunekit
import prunekit.base


@pytest.mark.parametrize("name, home", [("PruningContainer", "prunekit"), ("combine_masks", "prunekit.base")])
def test_importing_from_the_old_path_warns_and_names_the_new_one(name, home):
    with pytest.warns(DeprecationWarning) as caught:
        exec(compile(f"from prunekit.container import {name} as found", __file__, "exec"), namespace := {})
    assert [str(w.message) for w in caught] == [
        f"prunekit.container is deprecated; import {name} from {home} instead"
    ]
    assert namespace["found"] is getattr(prunekit.base, name)
    assert caught[0].filename == __file__  # the warning points at the importing line


def test_the_new_paths_do_not_warn():
    code = ("import warnings; warnings.simplefilter('error')\n"
            "import prunekit, prunekit.base, prunekit.global_\n"
            "from prunekit import PruningContainer\n"
            "from prunekit.base import combine_masks\n"
            "import prunekit.container  # importing the module alone does not warn; using a name does\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_star_import_warns_once_per_name_and_unknown_names_raise():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        exec("from prunekit.container import *", namespace := {})
    assert sorted(str(w.message).split()[4] for w in caught) == ["PruningContainer", "combine_masks"]
    assert namespace["PruningContainer"] is prunekit.PruningContainer
    import prunekit.container as old

    with pytest.raises(AttributeError, match="'prunekit.container' has no attribute 'apply'"):
        old.apply
    assert {"PruningContainer", "combine_masks"} <= set(dir(old))
