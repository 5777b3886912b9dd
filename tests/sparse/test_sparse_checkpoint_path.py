"""prunekit.sparse.checkpoint: a deprecated import path of the compressed-checkpoint names (now prunekit.io)."""

import subprocess
import sys

import pytest

import prunekit.io
import prunekit.io.compressed

HOMES = {
    "save_compressed": prunekit.io,
    "load_compressed": prunekit.io,
    "CorruptCheckpointError": prunekit.io,
    "CheckpointSignatureError": prunekit.io,
    "FORMAT_NAME": prunekit.io.compressed,
}


@pytest.mark.parametrize("name", sorted(HOMES))
def test_importing_from_the_old_path_warns_and_names_the_new_one(name):
    home = HOMES[name]
    with pytest.warns(DeprecationWarning) as caught:
        exec(compile(f"from prunekit.sparse.checkpoint import {name} as found", __file__, "exec"), namespace := {})
    assert [str(w.message) for w in caught] == [
        f"prunekit.sparse.checkpoint is deprecated; import {name} from {home.__name__} instead"
    ]
    assert namespace["found"] is getattr(home, name)
    assert caught[0].filename == __file__


def test_prunekit_sparse_reexports_without_a_warning():
    code = ("import warnings; warnings.simplefilter('error')\n"
            "import prunekit.io\n"
            "from prunekit.sparse import CorruptCheckpointError, load_compressed, save_compressed\n"
            "assert save_compressed is prunekit.io.save_compressed and load_compressed is prunekit.io.load_compressed\n"
            "assert CorruptCheckpointError is prunekit.io.CorruptCheckpointError\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_unknown_names_raise_attribute_error():
    import prunekit.sparse.checkpoint as old

    with pytest.raises(AttributeError, match="'prunekit.sparse.checkpoint' has no attribute 'write_compressed'"):
        old.write_compressed
