"""The ``prunekit`` command: every subcommand on small models, JSON output, exit codes, bad arguments."""

import json
import os
import re
import subprocess
import sys

import pytest
import torch
import torch.nn.utils.prune as torch_prune
import yaml
from safetensors.torch import save_file

import prunekit
from prunekit.cli import main
from prunekit.sparse import load_compressed, native, save_compressed

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/
from helpers import cli_models  # noqa: E402

CNN = os.path.join(HERE, "helpers", "cli_models.py") + ":make_cnn"
MLP = os.path.join(HERE, "helpers", "cli_models.py") + ":make_mlp"


def run(capsys, *argv):
    """(exit code, stdout, stderr) of ``prunekit argv`` run in this process."""
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def run_json(capsys, *argv):
    code, out, err = run(capsys, *argv, "--json")
    assert code == 0, err
    return json.loads(out)


def assert_one_line_error(code, err, expected_code=2, match=None):
    assert code == expected_code
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("prunekit: error: ")
    assert "Traceback" not in err
    if match:
        assert match in lines[0], lines[0]


@pytest.fixture
def cnn_weights(tmp_path):
    path = tmp_path / "cnn.pt"
    torch.save(cli_models.make_cnn().state_dict(), path)
    return path


# --------------------------------------------------------------------- help
@pytest.mark.parametrize("cmd", [[], ["demo"], ["inspect"], ["prune"], ["compact"], ["sparsify"]])
def test_help_has_examples(capsys, cmd):
    code, out, _ = run(capsys, *cmd, "--help")
    assert code == 0
    assert "examples:" in out and "prunekit" in out


def test_no_subcommand_prints_help_and_fails(capsys):
    code, out, _ = run(capsys)
    assert code == 2 and "COMMAND" in out


# --------------------------------------------------------------------- inspect
def test_inspect_plain_state_dict(capsys, tmp_path):
    m = cli_models.make_cnn()
    with torch.no_grad():
        m[0].weight[:4] = 0  # 4 whole output channels of the first conv
    torch.save(m.state_dict(), tmp_path / "m.pt")
    d = run_json(capsys, "inspect", tmp_path / "m.pt")
    assert d["command"] == "inspect" and d["format"] == "torch"
    assert d["bytes"] == os.path.getsize(tmp_path / "m.pt")
    layers = {e["name"]: e for e in d["report"]["layers"]}
    assert list(layers) == ["0.weight", "3.weight", "8.weight"]
    assert layers["0.weight"]["shape"] == [16, 3, 3, 3]
    assert layers["0.weight"]["zero_channels"] == 4
    assert layers["0.weight"]["sparsity"] == pytest.approx(4 / 16)
    assert layers["0.weight"]["fits_2_4"] is None  # 3 input channels
    assert layers["3.weight"]["sparsity"] == 0.0 and not layers["3.weight"]["masked"]
    total = sum(e["numel"] for e in layers.values())
    assert d["report"]["numel_layers"] == total
    assert d["report"]["nonzero_layers"] == total - 4 * 27


def test_inspect_torch_prune_state_dict_and_table(capsys, tmp_path):
    m = cli_models.make_cnn()
    torch_prune.l1_unstructured(m[3], "weight", amount=0.75)
    torch.save(m.state_dict(), tmp_path / "tp.pt")
    d = run_json(capsys, "inspect", tmp_path / "tp.pt")
    e = {x["name"]: x for x in d["report"]["layers"]}["3.weight"]
    assert e["masked"] and e["sparsity"] == pytest.approx(round(0.75 * e["numel"]) / e["numel"])
    code, out, err = run(capsys, "inspect", tmp_path / "tp.pt")
    assert code == 0 and err == ""
    assert "3.weight" in out and "32x16x3x3" in out and "75.0%" in out and "total" in out


def test_inspect_compressed_and_plain_safetensors(capsys, tmp_path):
    m = cli_models.make_mlp()
    prunekit.l1_unstructured(m[2], "weight", amount=0.9)
    save_compressed(m, tmp_path / "c.safetensors")
    d = run_json(capsys, "inspect", tmp_path / "c.safetensors")
    assert d["format"] == "prunekit-compressed"
    e = {x["name"]: x for x in d["report"]["layers"]}["2.weight"]
    assert e["masked"] and e["nonzero"] == 128 * 128 - round(0.9 * 128 * 128)
    save_file(prunekit.dense_state_dict(m), str(tmp_path / "plain.safetensors"))
    d2 = run_json(capsys, "inspect", tmp_path / "plain.safetensors")
    assert d2["format"] == "safetensors"
    assert d2["report"]["nonzero_layers"] == d["report"]["nonzero_layers"]


def test_inspect_pickle_needs_trust(capsys, tmp_path):
    torch.save(cli_models.make_mlp(), tmp_path / "whole.pt")  # a pickled nn.Module
    code, _, err = run(capsys, "inspect", tmp_path / "whole.pt")
    assert_one_line_error(code, err, 2, "--trust-pickle")
    d = run_json(capsys, "inspect", tmp_path / "whole.pt", "--trust-pickle")
    assert [e["name"] for e in d["report"]["layers"]] == ["0.weight", "2.weight", "4.weight"]


def test_inspect_missing_and_garbage(capsys, tmp_path):
    code, _, err = run(capsys, "inspect", tmp_path / "nope.pt")
    assert_one_line_error(code, err, 2, "not found")
    (tmp_path / "junk.bin").write_bytes(b"hello, not a checkpoint")
    code, _, err = run(capsys, "inspect", tmp_path / "junk.bin")
    assert_one_line_error(code, err, 2, "not a torch checkpoint")


def _no_hang(fn, *args):
    """fn(*args) in a thread: its result, or the test fails (instead of hanging) if it blocks on a file."""
    import threading

    box = {}

    def target():
        try:
            box["value"] = fn(*args)
        except BaseException as e:  # noqa: BLE001 - handed to the test
            box["error"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(20)
    assert not t.is_alive(), f"{args} blocked on a non-regular file"
    if "error" in box:
        raise box["error"]
    return box["value"]


def test_inspect_reads_a_compressed_tensors_folder(capsys, tmp_path):
    pytest.importorskip("compressed_tensors")
    m = cli_models.make_mlp()
    prunekit.l1_unstructured(m[2], "weight", amount=0.75)
    folder = tmp_path / "out"
    save_compressed(m, str(folder), format="compressed-tensors", config={"model_type": "mlp"})
    d = run_json(capsys, "inspect", folder)
    assert d["format"] == "compressed-tensors" and d["signature"] == "none"
    assert d["bytes"] == sum(f.stat().st_size for f in folder.iterdir())
    expected = prunekit.report.model_report(prunekit.dense_state_dict(m)).to_dict()
    by_name = lambda r: sorted(r["layers"], key=lambda e: e["name"])  # noqa: E731 - the folder keeps its own order
    assert by_name(d["report"]) == by_name(expected)
    assert {k: v for k, v in d["report"].items() if k != "layers"} == {k: v for k, v in expected.items() if k != "layers"}
    e = {x["name"]: x for x in d["report"]["layers"]}["2.weight"]
    assert e["nonzero"] == 128 * 128 // 4
    code, out, err = run(capsys, "inspect", folder)
    assert code == 0 and "(compressed-tensors" in out and "2.weight" in out
    # a key: the folder carries no signature, refused before it is read
    (tmp_path / "k").write_bytes(b"secret")
    code, _, err = run(capsys, "inspect", folder, "--key-file", tmp_path / "k")
    assert_one_line_error(code, err, 2, "compressed-tensors file carries no signature")
    # a folder that is no model, and a folder whose weights are a FIFO: one line, exit 2, no hang
    (tmp_path / "empty").mkdir()
    code, _, err = run(capsys, "inspect", tmp_path / "empty")
    assert_one_line_error(code, err, 2, "is a directory")
    os.unlink(folder / "model.safetensors")
    os.mkfifo(folder / "model.safetensors")
    code = _no_hang(main, ["inspect", str(folder)])
    assert_one_line_error(code, capsys.readouterr().err, 2, "not a regular file (a FIFO (named pipe))")


def test_key_file_goes_through_the_hostile_reader(capsys, tmp_path, monkeypatch):
    monkeypatch.delenv("PRUNEKIT_KEY", raising=False)
    signed = tmp_path / "s.safetensors"
    big_key = b"k" * 70_000
    save_compressed(cli_models.make_mlp(), str(signed), key=big_key)
    fifo = tmp_path / "key.fifo"
    os.mkfifo(fifo)
    code = _no_hang(main, ["inspect", str(signed), "--key-file", str(fifo)])
    assert_one_line_error(code, capsys.readouterr().err, 2, f"{fifo}: not a regular file (a FIFO (named pipe))")
    for dev in ("/dev/zero", "/dev/null"):
        code = _no_hang(main, ["inspect", str(signed), "--key-file", dev])
        assert_one_line_error(code, capsys.readouterr().err, 2, f"{dev}: not a regular file (a character device)")
    # a key file over 64 KiB is refused, never cut short to what fits
    (tmp_path / "big.key").write_bytes(big_key)
    code, out, err = run(capsys, "inspect", signed, "--key-file", tmp_path / "big.key")
    assert_one_line_error(code, err, 2, "big.key: larger than 65536 bytes (70000 bytes); a key file is never that large")
    assert out == ""


def test_a_key_in_the_environment_that_is_not_utf8_is_used_as_its_bytes(capsys, tmp_path, monkeypatch):
    signed = tmp_path / "s.safetensors"
    save_compressed(cli_models.make_mlp(), str(signed), key=b"k\xff")
    monkeypatch.setenv("PRUNEKIT_KEY", os.fsdecode(b"k\xff"))  # as a shell would pass the raw byte
    d = run_json(capsys, "inspect", signed)
    assert d["signature"] == "verified"
    monkeypatch.setenv("PRUNEKIT_KEY", os.fsdecode(b"\xfe"))
    code, _, err = run(capsys, "inspect", signed)
    assert_one_line_error(code, err, 2, "signature does not verify")


def test_inspect_with_a_key_never_unpickles_even_with_trust_pickle(capsys, tmp_path):
    marker = tmp_path / "the-pickle-ran"

    class Payload:
        def __reduce__(self):
            return (os.mkdir, (str(marker),))

    torch.save({"w": torch.ones(2), "x": Payload()}, tmp_path / "evil.pt")
    (tmp_path / "k").write_bytes(b"secret")
    code, out, err = run(capsys, "inspect", tmp_path / "evil.pt", "--key-file", tmp_path / "k", "--trust-pickle")
    assert_one_line_error(code, err, 2, "torch file carries no signature")
    assert out == "" and not marker.exists()


def test_a_file_refused_by_the_file_layer_exits_2_wherever_it_surfaces(capsys, tmp_path, monkeypatch):
    from prunekit.cli import _inspect
    from prunekit.io import CorruptCheckpointError, UnreadableFileError, UnsafeCheckpointError

    (tmp_path / "m.pt").write_bytes(b"x")
    for exc in (UnreadableFileError("/x/a.yaml: not valid YAML (found undefined alias, line 1 column 4)"),
                CorruptCheckpointError("/x/b.safetensors: damaged"), UnsafeCheckpointError("/x/c.pt: needs unpickling")):
        def boom(args, exc=exc):
            raise exc

        monkeypatch.setattr(_inspect, "run", boom)
        code, out, err = run(capsys, "inspect", tmp_path / "m.pt")
        assert_one_line_error(code, err, 2, str(exc))
    monkeypatch.setattr(_inspect, "run", lambda args: (_ for _ in ()).throw(ValueError("a bug")))
    code, out, err = run(capsys, "inspect", tmp_path / "m.pt")
    assert_one_line_error(code, err, 1, "ValueError: a bug")
    # a message quoting a huge value stays one bounded line
    monkeypatch.setattr(_inspect, "run", lambda args: (_ for _ in ()).throw(UnreadableFileError("/x: " + "y" * 10**6)))
    code, out, err = run(capsys, "inspect", tmp_path / "m.pt")
    assert_one_line_error(code, err, 2, "... (1000004 characters)")
    assert len(err) < 2100


def test_prune_config_goes_through_the_hostile_reader(capsys, tmp_path):
    bomb = "names: [" + ", ".join(["&a [x, x, x, x, x, x, x, x, x]"] + [
        f"&{c} [" + ", ".join(["*" + p] * 9) + "]" for p, c in zip("abcde", "bcdef")]) + "]\n"
    (tmp_path / "bomb.yaml").write_text("prune_type: magnitude\ntarget_sparsity: 0.5\n" + bomb)
    (tmp_path / "dup.yaml").write_text("prune_type: magnitude\ntarget_sparsity: 0.5\ntarget_sparsity: 0.9\n")
    (tmp_path / "big.yaml").write_text("prune_type: magnitude\nnames: [" + ", ".join(["'^0$'"] * 200_000) + "]\n")
    (tmp_path / "deep.yaml").write_text("names: " + "[" * 200 + "]" * 200 + "\n")
    (tmp_path / "binary.yaml").write_bytes(b"prune_type: \xff\xfe\x00magnitude\n")
    os.mkfifo(tmp_path / "fifo.yaml")
    for name, match in (("bomb.yaml", "expands to more than 100000 values through aliases"),
                        ("dup.yaml", "not valid YAML (duplicate key 'target_sparsity', line 3); keep one"),
                        ("big.yaml", "larger than 1048576 bytes"),
                        ("deep.yaml", "nested deeper than 64 levels"),
                        ("binary.yaml", "not UTF-8 text (byte 12)"),
                        ("fifo.yaml", "not a regular file (a FIFO (named pipe))")):
        code = _no_hang(main, ["prune", "--model", MLP, "--config", str(tmp_path / name),
                               "--out", str(tmp_path / "o.safetensors")])
        err = capsys.readouterr().err
        assert_one_line_error(code, err, 2, match)
        assert str(tmp_path / name) in err
        assert not (tmp_path / "o.safetensors").exists()


# --------------------------------------------------------------------- prune
def test_prune_global_magnitude_matches_the_library(capsys, tmp_path, cnn_weights):
    out = tmp_path / "p.safetensors"
    d = run_json(capsys, "prune", "--model", CNN, "--weights", cnn_weights, "--amount", "0.75", "--out", out,
                 "--report", tmp_path / "r.json")
    assert d["command"] == "prune" and d["pruning"]["method"] == "global_magnitude"
    assert d["pruning"]["layers"] == ["0", "3", "8"]
    assert d["bytes"] == os.path.getsize(out) and d["weights_format"] == "torch"
    rep = d["report"]
    assert rep["nonzero_layers"] == rep["numel_layers"] - round(0.75 * rep["numel_layers"])
    assert json.loads((tmp_path / "r.json").read_text())["report"] == rep
    # the file restores the same pruned model as pruning by hand
    ref = cli_models.make_cnn()
    ref.load_state_dict(torch.load(cnn_weights, weights_only=True))
    prunekit.global_unstructured([(ref[i], "weight") for i in (0, 3, 8)], prunekit.L1Unstructured, amount=0.75)
    again = cli_models.make_cnn()
    prunekit.load_state_dict(again, load_compressed(out))
    for i in (0, 3, 8):
        assert torch.equal(again[i].weight_mask, ref[i].weight_mask)
        assert torch.equal(again[i].weight, ref[i].weight)


def test_prune_table_output_and_bake(capsys, tmp_path, cnn_weights):
    out = tmp_path / "b.safetensors"
    code, text, err = run(capsys, "prune", "--model", CNN, "--weights", cnn_weights, "--method", "l1_unstructured",
                          "--amount", "0.5", "--out", out, "--bake")
    assert code == 0, err
    assert "wrote" in text and "50.0%" in text
    sd = load_compressed(out)
    assert not any(k.endswith(("_orig", "_mask")) for k in sd)
    for k in ("0.weight", "3.weight", "8.weight"):
        assert int((sd[k] == 0).sum()) == round(0.5 * sd[k].numel())
    cli_models.make_cnn().load_state_dict(sd)  # loads into the dense model directly


def test_prune_structured_and_layers_filter(capsys, tmp_path, cnn_weights):
    d = run_json(capsys, "prune", "--model", CNN, "--weights", cnn_weights, "--method", "ln_structured",
                 "--amount", "0.5", "--layers", "^3$", "--out", tmp_path / "s.safetensors")
    layers = {e["name"]: e for e in d["report"]["layers"]}
    assert layers["3.weight"]["zero_channels"] == 16 and layers["3.weight"]["masked"]
    assert layers["0.weight"]["sparsity"] == 0.0 and not layers["0.weight"]["masked"]


def test_prune_pattern_2_4(capsys, tmp_path):
    d = run_json(capsys, "prune", "--model", MLP, "--pattern", "2:4", "--out", tmp_path / "nm.safetensors")
    for e in d["report"]["layers"]:
        assert e["fits_2_4"] == 1.0 and e["sparsity"] == pytest.approx(0.5)


def test_prune_config_file(capsys, tmp_path):
    cfg = {"prune_type": "magnitude", "pattern": "4x1", "target_sparsity": 0.5, "end_step": 3,
           "prune_domain": "local", "names": ["^[02]$"]}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    d = run_json(capsys, "prune", "--model", MLP, "--config", tmp_path / "c.yaml", "--out", tmp_path / "y.safetensors")
    layers = {e["name"]: e for e in d["report"]["layers"]}
    assert layers["0.weight"]["block_4x1_sparsity"] == pytest.approx(0.5)
    assert layers["2.weight"]["block_4x1_sparsity"] == pytest.approx(0.5)
    assert layers["4.weight"]["sparsity"] == 0.0
    (tmp_path / "c.json").write_text(json.dumps(cfg))
    d2 = run_json(capsys, "prune", "--model", MLP, "--config", tmp_path / "c.json", "--out", tmp_path / "j.safetensors")
    assert d2["report"] == d["report"]


@pytest.mark.parametrize("argv, match", [
    (["--method", "magic", "--amount", "0.5"], "invalid choice: 'magic'"),
    (["--amount", "1.5"], "amount 1.5 is out of range"),
    (["--amount", "-0.1"], "out of range"),
    (["--amount", "half"], "not a number"),
    (["--method", "l1_unstructured"], "needs --amount"),
    (["--pattern", "3y3", "--amount", "0.5"], "is not a pattern"),
    (["--pattern", "4x1"], "needs --amount"),
    (["--amount", "0.5", "--layers", "nothing-matches"], "no Linear/Conv layer"),
])
def test_prune_bad_arguments(capsys, tmp_path, argv, match):
    code, _, err = run(capsys, "prune", "--model", MLP, *argv, "--out", tmp_path / "x.safetensors")
    assert_one_line_error(code, err, 2, match)
    assert not (tmp_path / "x.safetensors").exists()


def test_prune_bad_model_and_weights(capsys, tmp_path, cnn_weights):
    out = tmp_path / "x.safetensors"
    for model, match in [("no_such_module_xyz:f", "cannot import"), ("helpers.cli_models", "package.module:function"),
                         (os.path.join(HERE, "helpers", "cli_models.py") + ":missing", "no attribute 'missing'"),
                         (os.path.join(HERE, "helpers", "cli_models.py") + ":not_a_model", "not a torch.nn.Module")]:
        code, _, err = run(capsys, "prune", "--model", model, "--amount", "0.5", "--out", out)
        assert_one_line_error(code, err, 2, match)
    code, _, err = run(capsys, "prune", "--model", CNN, "--weights", tmp_path / "missing.pt", "--amount", "0.5",
                       "--out", out)
    assert_one_line_error(code, err, 2, "weights file not found")
    torch.save(cli_models.make_mlp().state_dict(), tmp_path / "mlp.pt")
    code, _, err = run(capsys, "prune", "--model", CNN, "--weights", tmp_path / "mlp.pt", "--amount", "0.5",
                       "--out", out)
    assert_one_line_error(code, err, 2, "do not fit the model")
    torch.save(cli_models.make_cnn(), tmp_path / "pickled.pt")
    code, _, err = run(capsys, "prune", "--model", CNN, "--weights", tmp_path / "pickled.pt", "--amount", "0.5",
                       "--out", out)
    assert_one_line_error(code, err, 2, "--trust-pickle")
    d = run_json(capsys, "prune", "--model", CNN, "--weights", tmp_path / "pickled.pt", "--trust-pickle",
                 "--amount", "0.5", "--out", out)
    assert d["report"]["sparsity_layers"] == pytest.approx(0.5, abs=1e-3)
    code, _, err = run(capsys, "prune", "--model", CNN, "--amount", "0.5", "--out", tmp_path / "no" / "x.safetensors")
    assert_one_line_error(code, err, 2, "folder does not exist")


@pytest.mark.parametrize("how", [["--amount", "0.5"], ["--method", "ln_structured", "--amount", "0.5"],
                                 ["--pattern", "2:4"], ["--pattern", "4x1", "--amount", "0.5"], ["--config"]])
def test_prune_layers_matching_nothing_is_the_same_error_for_every_option(capsys, tmp_path, how):
    if how == ["--config"]:
        (tmp_path / "c.yaml").write_text(yaml.safe_dump({"prune_type": "magnitude", "pattern": "1x1",
                                                          "target_sparsity": 0.5}))
        how = ["--config", tmp_path / "c.yaml"]
    code, out, err = run(capsys, "prune", "--model", MLP, *how, "--layers", "nomatch", "--out", tmp_path / "x.st",
                         "--report", tmp_path / "r.json")
    assert_one_line_error(code, err, 2, "--layers 'nomatch' matches no Linear/Conv layer; the model's layers are: 0, 2, 4")
    assert out == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == (["c.yaml"] if "--config" in how else [])


@pytest.mark.parametrize("how", [["--amount", "0.5"], ["--method", "l1_unstructured", "--amount", "0.5"],
                                 ["--pattern", "1x1", "--amount", "0.5"], ["--config"]])
def test_prune_layers_selects_the_same_layers_for_every_option(capsys, tmp_path, how):
    if how == ["--config"]:
        # the config selects 0 and 2; --layers narrows that to 2
        (tmp_path / "c.yaml").write_text(yaml.safe_dump({"prune_type": "magnitude", "pattern": "1x1",
                                                          "target_sparsity": 0.5, "names": ["^[02]$"]}))
        how = ["--config", tmp_path / "c.yaml"]
    d = run_json(capsys, "prune", "--model", MLP, *how, "--layers", "^[24]$", "--out", tmp_path / "x.st")
    layers = {e["name"]: e for e in d["report"]["layers"]}
    assert not layers["0.weight"]["masked"] and layers["0.weight"]["sparsity"] == 0.0
    assert layers["2.weight"]["masked"]
    pruned = ["2.weight"] if "--config" in how else ["2.weight", "4.weight"]
    assert [n for n, e in layers.items() if e["masked"]] == pruned
    numel = sum(layers[n]["numel"] for n in pruned)
    zeros = sum(round(layers[n]["sparsity"] * layers[n]["numel"]) for n in pruned)
    assert zeros == numel // 2
    if "--config" in how:
        assert d["pruning"]["config"]["pruners"][0]["names"] == ["^2$"]


def test_prune_config_selecting_nothing_is_an_error(capsys, tmp_path):
    (tmp_path / "c.yaml").write_text(yaml.safe_dump({"prune_type": "magnitude", "prune_layer_type": ["Conv2d"]}))
    code, out, err = run(capsys, "prune", "--model", MLP, "--config", tmp_path / "c.yaml", "--out", tmp_path / "x.st")
    assert_one_line_error(code, err, 2, "prune_layer_type=['Conv2d'] matches no layer of Sequential")
    assert not (tmp_path / "x.st").exists()


def test_prune_gradient_config_is_refused(capsys, tmp_path):
    (tmp_path / "s.yaml").write_text(yaml.safe_dump({"prune_type": "snip_momentum", "target_sparsity": 0.5}))
    code, _, err = run(capsys, "prune", "--model", MLP, "--config", tmp_path / "s.yaml", "--out", tmp_path / "o.st")
    assert_one_line_error(code, err, 2, "need training data")
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump({"prune_type": "magnitude", "traget_sparsity": 0.5}))
    code, _, err = run(capsys, "prune", "--model", MLP, "--config", tmp_path / "bad.yaml", "--out", tmp_path / "o.st")
    assert_one_line_error(code, err, 2, "Did you mean 'target_sparsity'")


# --------------------------------------------------------------------- compact
def test_compact_with_amount(capsys, tmp_path, cnn_weights):
    from prunekit.compact import load_compacted

    out = tmp_path / "small.pt"
    d = run_json(capsys, "compact", "--model", CNN, "--weights", cnn_weights, "--input-shape", "2,3,8,8",
                 "--amount", "0.5", "--out", out)
    assert d["command"] == "compact"
    assert d["params_after"] < d["params_before"] and d["macs_after"] < d["macs_before"]
    assert d["max_abs_diff"] < 1e-4
    shapes = {l["name"]: (l["before"], l["after"]) for l in d["layers"]}
    assert shapes["0"] == ([16, 3, 3, 3], [8, 3, 3, 3])
    assert shapes["3"] == ([32, 16, 3, 3], [16, 8, 3, 3])
    saved = torch.load(out, weights_only=True)
    again = load_compacted(cli_models.make_cnn(), saved["state_dict"], saved["description"])
    assert sum(p.numel() for p in again.parameters()) == d["params_after"]
    code, text, _ = run(capsys, "compact", "--model", CNN, "--weights", cnn_weights, "--input-shape", "2,3,8,8",
                        "--amount", "0.5", "--out", out)
    assert code == 0 and "parameters" in text and "16x3x3x3" in text


def test_compact_failures(capsys, tmp_path, cnn_weights):
    out = tmp_path / "small.pt"
    # no masked channel and no --amount: a failure while working (1), one line
    code, _, err = run(capsys, "compact", "--model", CNN, "--weights", cnn_weights, "--input-shape", "2,3,8,8",
                       "--out", out)
    assert_one_line_error(code, err, 1, "0 whole channels")
    code, _, err = run(capsys, "compact", "--model", CNN, "--input-shape", "2,5,8,8", "--amount", "0.5", "--out", out)
    assert_one_line_error(code, err, 2, "does not run on an input of shape [2, 5, 8, 8]")
    code, _, err = run(capsys, "compact", "--model", CNN, "--input-shape", "2,a", "--out", out)
    assert_one_line_error(code, err, 2, "input shape")
    code, _, err = run(capsys, "compact", "--model", CNN, "--input-shape", "2,3,8,8", "--amount", "1.5", "--out", out)
    assert_one_line_error(code, err, 2, "out of range")


# --------------------------------------------------------------------- sparsify
def test_sparsify_converts_a_very_sparse_layer(capsys, tmp_path):
    m = cli_models.make_mlp()
    prunekit.l1_unstructured(m[2], "weight", amount=0.95)
    save_compressed(m, tmp_path / "s.safetensors")
    d = run_json(capsys, "sparsify", "--model", MLP, "--weights", tmp_path / "s.safetensors",
                 "--input-shape", "4,64", "--no-measure", "--report", tmp_path / "r.json")
    assert d["command"] == "sparsify" and d["candidates"] == 3
    by = {l["name"]: l for l in d["layers"]}
    assert by["2"]["converted"] and by["2"]["format"] == "csr"
    assert by["2"]["policy"] == ("csr" if native.available() else "csr-torch-1t")  # first that runs, unmeasured
    assert by["2"]["timings_ms"] == {} and by["2"]["not_tried"]["bsr4x1"].startswith("only ")
    assert not by["0"]["converted"]  # dense layer: below --min-sparsity
    assert d["converted"] == 1 and d["max_abs_diff"] < 1e-4
    assert json.loads((tmp_path / "r.json").read_text())["layers"] == d["layers"]
    code, text, _ = run(capsys, "sparsify", "--model", MLP, "--weights", tmp_path / "s.safetensors",
                        "--input-shape", "4,64", "--no-measure")
    assert code == 0 and "1 of 3 layers converted" in text


def test_sparsify_needs_weights(capsys):
    code, _, err = run(capsys, "sparsify", "--model", MLP, "--input-shape", "4,64")
    assert_one_line_error(code, err, 2, "--weights")


# --------------------------------------------------------------------- bad arguments, every subcommand
# (subcommand arguments, expected one-line message); {missing} and {pickle} are filled in per test
_SHAPES = {"compact": ["--input-shape", "2,3,8,8"], "sparsify": ["--input-shape", "2,3,8,8"]}
BAD_ARGUMENTS = [
    # a missing file
    (["inspect", "{missing}"], "checkpoint not found: {missing}"),
    (["prune", "--model", CNN, "--weights", "{missing}", "--amount", "0.5"], "weights file not found: {missing}"),
    (["prune", "--model", CNN, "--config", "{missing}"], "config file not found: {missing}"),
    (["compact", "--model", CNN, "--weights", "{missing}", "--amount", "0.5"], "weights file not found: {missing}"),
    (["sparsify", "--model", CNN, "--weights", "{missing}"], "weights file not found: {missing}"),
    # an unknown method
    (["prune", "--model", CNN, "--method", "magic", "--amount", "0.5"], "invalid choice: 'magic'"),
    (["compact", "--model", CNN, "--importance", "magic", "--amount", "0.5"], "invalid choice: 'magic'"),
    (["sparsify", "--model", CNN, "--weights", "{pickle}", "--format", "magic"], "invalid choice: 'magic'"),
    # amount 1.5
    (["prune", "--model", CNN, "--amount", "1.5"], "amount 1.5 is out of range"),
    (["compact", "--model", CNN, "--amount", "1.5"], "--amount 1.5 is out of range"),
    # a pickle without --trust-pickle
    (["inspect", "{pickle}"], "pass --trust-pickle"),
    (["prune", "--model", CNN, "--weights", "{pickle}", "--amount", "0.5"], "pass --trust-pickle"),
    (["compact", "--model", CNN, "--weights", "{pickle}", "--amount", "0.5"], "pass --trust-pickle"),
    (["sparsify", "--model", CNN, "--weights", "{pickle}"], "pass --trust-pickle"),
]


@pytest.mark.parametrize("argv, match", BAD_ARGUMENTS)
def test_bad_arguments_are_one_line_and_exit_2_in_every_subcommand(capsys, tmp_path, argv, match):
    pickled = tmp_path / "pickled.pt"
    torch.save(cli_models.make_cnn(), pickled)  # a whole pickled module: torch.load(weights_only=True) refuses it
    fill = {"missing": str(tmp_path / "missing.pt"), "pickle": str(pickled)}
    argv = [a.format(**fill) for a in argv] + _SHAPES.get(argv[0], [])
    out = tmp_path / "out.file"
    if argv[0] in ("prune", "compact"):
        argv += ["--out", str(out)]
    code, stdout, err = run(capsys, *argv)
    assert_one_line_error(code, err, 2, match.format(**fill))
    assert stdout == "" and not out.exists()


# --------------------------------------------------------------------- demo (quick)
def _env():
    src = os.path.join(os.path.dirname(HERE), "src")
    return dict(os.environ, PYTHONPATH=os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]))


@pytest.fixture(scope="module")
def quick_demo(tmp_path_factory):
    # in a subprocess: the demo imports scikit-learn (and so scipy), which must not leak into this
    # process (TensorPlay cannot find LAPACK once scipy's OpenBLAS is loaded)
    out = tmp_path_factory.mktemp("demo")
    # the pretrained (MiniLM-L6) part is tested on its own in tests/test_demo.py: left out here to save ~12 s
    p = subprocess.run([sys.executable, "-m", "prunekit", "demo", "--quick", "--no-pretrained", "--out", str(out),
                        "--json"],
                       capture_output=True, text=True, env=_env(), timeout=600)
    return p.returncode, p.stdout, p.stderr, out


@pytest.mark.slow
def test_demo_quick_json(quick_demo):
    code, stdout, err, out = quick_demo
    assert code == 0, err
    d = json.loads(stdout)
    assert d == json.loads((out / "results.json").read_text())
    assert d["errors"] == []
    assert d["pretrained"]["rows"] == [] and d["pretrained"]["skipped"].startswith("turned off (--no-pretrained")
    assert d["settings"]["pretrained"] is False
    keys = [r["key"] for r in d["results"]]
    assert keys == ["oneshot_magnitude_50", "oneshot_magnitude_90", "gradual_magnitude_50", "gradual_magnitude_90",
                    "gradual_snip_momentum_50", "gradual_snip_momentum_90", "nm_2_4", "channels_50_compacted"]
    fields = {"key", "method", "target", "sparsity", "accuracy", "params", "nonzero_params", "macs",
              "effective_macs", "size_bytes", "size_ratio", "latency_ms", "speedup", "note"}
    dense = d["dense"]
    assert fields <= set(dense)
    by = {r["key"]: r for r in d["results"]}
    for r in d["results"]:
        assert fields <= set(r)
        assert 0.0 <= r["accuracy"] <= 1.0 and r["latency_ms"] > 0
        assert os.path.getsize(out / "checkpoints" / f"{r['key']}.safetensors") == r["size_bytes"]
    for k in ("oneshot_magnitude_90", "gradual_magnitude_90", "gradual_snip_momentum_90"):
        assert by[k]["sparsity"] == pytest.approx(0.9, abs=1e-3)
        assert by[k]["params"] == dense["params"] and by[k]["macs"] == dense["macs"]
        assert by[k]["size_ratio"] < 0.2
    assert by["nm_2_4"]["sparsity"] == pytest.approx(0.5, abs=0.01)  # the first conv (1 input channel) is skipped
    c = by["channels_50_compacted"]
    assert c["params"] < dense["params"] / 2 and c["macs"] < dense["macs"] / 2
    assert dense["accuracy"] > 0.9  # a working training recipe, even in the quick run
    assert d["chosen"] == "gradual_magnitude_90"
    assert d["chosen_layers"]["sparsity_layers"] == pytest.approx(0.9, abs=1e-3)
    # the figures agree with each other: ratios against the dense row, non-zero counts against the sparsity
    assert (dense["nonzero_params"], dense["effective_macs"], dense["size_ratio"], dense["speedup"]) == (
        dense["params"], dense["macs"], 1.0, 1.0)
    weights = d["chosen_layers"]["numel_layers"]  # the prunable weights (every Linear/Conv weight)
    for r in d["results"]:
        assert r["size_ratio"] == pytest.approx(r["size_bytes"] / dense["size_bytes"])
        assert r["speedup"] == pytest.approx(dense["latency_ms"] / r["latency_ms"])
        assert r["effective_macs"] <= r["macs"]
        if r["key"] != "channels_50_compacted":  # masked models: same shapes, zeros where pruned
            assert r["params"] - r["nonzero_params"] == pytest.approx(r["sparsity"] * weights, abs=0.5)
    for k in ("oneshot_magnitude_50", "gradual_magnitude_50", "gradual_snip_momentum_50"):
        assert by[k]["sparsity"] == pytest.approx(0.5, abs=1e-3) and by[k]["target"] == 0.5
    # each verdict is the target applied to the figures above
    gradual, compressed, compacted = d["checks"]
    g = by["gradual_magnitude_90"]
    assert gradual["name"].startswith("gradual magnitude at 90% within 1 point")
    assert gradual["passed"] is (dense["accuracy"] - g["accuracy"] <= 0.01 + 1e-9)
    assert compressed["name"].startswith("compressed checkpoint at 90%")
    assert compressed["passed"] is (g["size_ratio"] < 0.15)
    assert compacted["name"].startswith("compacted model measurably faster")
    assert compacted["passed"] is (c["speedup"] >= 1.2)


@pytest.mark.slow
def test_demo_quick_plots_and_checkpoints(capsys, quick_demo):
    code, _, _, out = quick_demo
    for name in ("accuracy_vs_sparsity.png", "layer_sparsity.png"):
        with open(out / name, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    code, text, err = run(capsys, "inspect", out / "checkpoints" / "gradual_magnitude_90.safetensors")
    assert code == 0 and "prunekit-compressed" in text


@pytest.mark.slow
def test_demo_table_rendering(capsys, quick_demo):
    from prunekit.cli._demo import print_result

    from prunekit.cli._demo import table_rows

    d = json.loads(quick_demo[1])
    print_result(d)
    out = capsys.readouterr().out
    lines = out.splitlines()
    # one table line per model, holding every figure of its row in column order (nothing cropped or elided)
    rows = table_rows(d)
    assert len(rows) == 1 + len(d["results"])
    for r, cells in zip([d["dense"]] + d["results"], rows):
        assert cells[0] == r["method"] and cells[3] == f"{100 * r['accuracy']:.2f}%"
        pattern = ".*".join(re.escape(c) for c in cells if c)
        assert sum(bool(re.search(pattern, ln)) for ln in lines) == 1, (r["key"], cells)
    for ch in d["checks"]:
        assert f"[{'PASS' if ch['passed'] else 'FAIL'}] {ch['name']}: {ch['detail']}" in out
    assert out.count("PASS") + out.count("FAIL") == 3


def test_demo_bad_out(capsys, tmp_path):
    (tmp_path / "file").write_text("x")
    code, _, err = run(capsys, "demo", "--quick", "--out", tmp_path / "file")
    assert_one_line_error(code, err, 2, "not a folder")
    code, _, err = run(capsys, "demo", "--threads", "0")
    assert_one_line_error(code, err, 2, "--threads")


# --------------------------------------------------------------------- the real entry points
def test_debug_adds_the_traceback_and_keeps_the_exit_code(capsys, tmp_path, cnn_weights):
    missing = tmp_path / "missing.pt"
    code, out, err = run(capsys, "--debug", "inspect", missing)
    assert code == 2 and out == ""
    assert err.startswith("Traceback") and "CliError" in err
    assert err.splitlines()[-1] == f"prunekit: error: checkpoint not found: {missing}"
    # a failure while working: the traceback, then the line without the '--debug' hint, exit code 1
    code, _, err = run(capsys, "--debug", "compact", "--model", CNN, "--weights", cnn_weights,
                       "--input-shape", "2,3,8,8", "--out", tmp_path / "small.pt")
    assert code == 1 and err.startswith("Traceback")
    last = err.splitlines()[-1]
    assert last.startswith("prunekit: error: ") and "0 whole channels" in last and "--debug" not in last
    # --debug belongs before the subcommand; after it, it is a bad argument like any other (no traceback)
    code, _, err = run(capsys, "inspect", missing, "--debug")
    assert_one_line_error(code, err, 2, "unrecognized arguments: --debug")


def test_python_dash_m_exit_codes(tmp_path):
    env = _env()
    ok = subprocess.run([sys.executable, "-m", "prunekit", "--version"], capture_output=True, text=True, env=env)
    assert ok.returncode == 0 and ok.stdout.startswith("prunekit ")
    bad = subprocess.run([sys.executable, "-m", "prunekit", "inspect", str(tmp_path / "missing.pt")],
                         capture_output=True, text=True, env=env)
    assert bad.returncode == 2
    assert bad.stderr.strip() == f"prunekit: error: checkpoint not found: {tmp_path / 'missing.pt'}"
    assert bad.stdout == ""


def test_demo_failed_stage_is_reported_and_the_rest_still_runs(capsys, tmp_path, monkeypatch):
    import prunekit.compact
    import prunekit.demo as demo

    def synthetic_digits(seed=0):  # stands in for scikit-learn's digits: this test is about the failure path
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(320, 1, 8, 8, generator=g)
        y = (x.mean(dim=(1, 2, 3)) > 0).long() + 2 * (x[:, 0, 0, 0] > 0).long()
        return x[:256], y[:256], x[256:], y[256:]

    monkeypatch.setattr(demo, "load_data", synthetic_digits)
    tiny = demo.DemoSettings(dense_epochs=1, finetune_epochs=1, levels=(0.9,), latency_repeats=3, name="tiny",
                             pretrained=False)
    monkeypatch.setattr(demo.DemoSettings, "quick", classmethod(lambda cls, **kw: tiny))

    def broken(*args, **kwargs):
        raise RuntimeError("compaction exploded\nsecond line")

    monkeypatch.setattr(prunekit.compact, "compact", broken)
    code, out, err = run(capsys, "demo", "--quick", "--out", tmp_path)
    assert code == 1
    assert err.strip().splitlines()[-1] == (
        "prunekit: error: demo stage channels_50_compacted failed: RuntimeError: compaction exploded")
    assert "Traceback" not in err
    d = json.loads((tmp_path / "results.json").read_text())
    assert [r["key"] for r in d["results"]] == ["oneshot_magnitude_90", "gradual_magnitude_90",
                                               "gradual_snip_momentum_90", "nm_2_4"]
    assert d["errors"] == [{"stage": "channels_50_compacted", "error": "RuntimeError: compaction exploded\nsecond line"}]
    compacted = d["checks"][-1]
    assert compacted["passed"] is False and "compaction exploded" in compacted["detail"]
    assert "[FAIL] compacted model" in out


@pytest.mark.parametrize("kwargs, match", [
    ({"dense_epochs": 0}, "dense_epochs=0"),
    ({"levels": (0.5, 1.0)}, "sparsity level 1.0"),
    ({"channel_amount": 0.0}, "channel_amount"),
    ({"threads": True}, "threads"),
])
def test_demo_settings_validation(kwargs, match):
    from prunekit.demo import DemoSettings

    with pytest.raises(ValueError, match=match):
        DemoSettings(**kwargs)


def test_plain_text_output_without_rich(capsys, tmp_path, monkeypatch):
    import prunekit.cli._common as common

    monkeypatch.setattr(common, "console", lambda stderr=False: None)  # as if rich were not installed
    m = cli_models.make_mlp()
    prunekit.l1_unstructured(m[2], "weight", amount=0.5)
    torch.save(m.state_dict(), tmp_path / "m.pt")
    code, out, err = run(capsys, "inspect", tmp_path / "m.pt")
    assert code == 0 and err == ""
    lines = out.splitlines()
    assert lines[0].startswith(str(tmp_path / "m.pt"))
    row = next(ln for ln in lines if ln.startswith("2.weight"))
    assert row.split()[:3] == ["2.weight", "128x128", "50.0%"]
    assert any(ln.startswith("total (3 weights)") for ln in lines)
