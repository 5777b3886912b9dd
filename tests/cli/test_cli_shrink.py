"""``prunekit shrink``: a Hugging Face folder in, a smaller one out that plain transformers loads and that equals
the in-process ``prunekit.shrink``; JSON and tables, explicit sizes and axes, distillation, bad arguments, and an
output folder that is never half-written."""

from __future__ import annotations

import json
import math
import os
import sys

import pytest
import torch

import prunekit
from prunekit.cli import main

pytestmark = pytest.mark.usefixtures("one_thread")
transformers = pytest.importorskip("transformers", reason="transformers is not installed")
tokenizers = pytest.importorskip("tokenizers", reason="tokenizers is not installed")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from helpers import shrink_models  # noqa: E402

SENTENCES = ["the cat sat on the mat", "a dog ran in the park and sat down", "pruning makes a model small",
             "the model is dense and small", "calibration text is typical text", "a small model runs fast",
             "the park is green", "a cat and a dog", "text in and text out", "the mat is small and green",
             "dense models run on every engine", "the dog ran fast"]


def tokenizer():
    """A word-level tokenizer trained on the sentences above (no download)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(SENTENCES, trainers.WordLevelTrainer(special_tokens=["[PAD]", "[UNK]", "[EOS]"]))
    assert tok.get_vocab_size() <= shrink_models.VOCAB
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]",
                                                eos_token="[EOS]")


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """A saved tiny Llama with its tokenizer, and a calibration file (read only: tests write elsewhere)."""
    root = tmp_path_factory.mktemp("shrink-cli")
    model_dir = root / "llama"
    shrink_models.build("llama").save_pretrained(model_dir)
    tokenizer().save_pretrained(model_dir)
    cal = root / "cal.txt"
    cal.write_text("\n".join(SENTENCES) + "\n\n")
    return model_dir, cal


def run(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def shrink_args(inputs, out, *extra):
    model_dir, cal = inputs
    return ["shrink", "--model", model_dir, "--calibration", cal, "--target", "0.5", "--out", out, *extra]


def in_process(model_dir, **kwargs):
    """What the command should compute: the folder's model shrunk on its tokenizer's batches of eight samples."""
    model = transformers.LlamaForCausalLM.from_pretrained(model_dir).eval()
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    batches = [dict(tok(SENTENCES[i:i + 8], return_tensors="pt", padding=True, truncation=True, max_length=128))
               for i in range(0, len(SENTENCES), 8)]
    assert all(bool((b["attention_mask"] == 0).any()) for b in batches)  # padding the shrink must leave out
    return model, prunekit.shrink(model, batches, **kwargs), batches


def candidate(c):
    return {"sizes": c.sizes, "params": c.params, "macs": c.macs, "score": c.score}


def config(model):
    return {k: v for k, v in model.config.to_dict().items() if k != "_name_or_path"}


def error_line(err):
    """The one error line, after whatever progress bars transformers drew while loading (each ends in \\r)."""
    lines = [line for line in err.replace("\r", "\n").splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("prunekit:")]
    assert len(errors) == 1 and lines[-1] == errors[0], err
    return errors[0]


def same_weights(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def entries(folder):
    return sorted(os.listdir(folder))


# ------------------------------------------------------------------ the output
def test_the_folder_loads_with_plain_transformers_and_equals_the_in_process_shrink(capsys, tmp_path, inputs):
    out = tmp_path / "small"
    code, stdout, err = run(capsys, *shrink_args(inputs, out), "--json")
    assert code == 0, err
    data = json.loads(stdout)
    loaded = transformers.LlamaForCausalLM.from_pretrained(out).eval()
    model, report, batches = in_process(inputs[0], target=0.5)
    assert same_weights(loaded, model) and config(loaded) == config(model)
    for batch in batches:
        assert torch.equal(shrink_models.output(loaded, batch), shrink_models.output(model, batch))
    assert {k: data[k] for k in ("command", "model", "output", "model_type", "objective", "distill")} == {
        "command": "shrink", "model": str(inputs[0]), "output": str(out), "model_type": "llama", "objective": "loss",
        "distill": None}
    assert data["dense"] == candidate(report.dense) and data["chosen"] == candidate(report.chosen)
    assert data["candidates"] == [candidate(c) for c in report.candidates] and len(data["candidates"]) > 1
    assert (data["params"], data["score"], data["removed_layers"]) == (report.params, report.score,
                                                                        report.removed_layers)
    assert data["params"] <= 0.5 * data["dense"]["params"] and data["seconds"] > 0
    assert sum(p.numel() for p in loaded.parameters()) == data["params"]
    saved = transformers.AutoTokenizer.from_pretrained(out)  # the tokenizer travels with the model
    assert saved(SENTENCES)["input_ids"] == transformers.AutoTokenizer.from_pretrained(inputs[0])(SENTENCES)["input_ids"]
    assert not [e for e in entries(tmp_path) if e != "small"]  # no temporary folder left


def test_tables_and_the_report_file(capsys, tmp_path, inputs):
    out, report_file = tmp_path / "small", tmp_path / "report.json"
    code, stdout, err = run(capsys, *shrink_args(inputs, out), "--report", report_file)
    assert code == 0, err
    data = json.loads(report_file.read_text())
    assert "candidates (best first; loss)" in stdout and f"wrote {out}" in stdout
    assert f"35,104 -> {data['params']:,} parameters" in stdout
    assert data["command"] == "shrink" and data["chosen"] == data["candidates"][0]


def test_explicit_sizes(capsys, tmp_path, inputs):
    out = tmp_path / "small"
    code, stdout, err = run(capsys, *shrink_args(inputs, out), "--sizes", "ffn=24,layers=3", "--json")
    assert code == 0, err
    data = json.loads(stdout)
    config = transformers.AutoConfig.from_pretrained(out)
    assert (config.intermediate_size, config.num_hidden_layers, config.hidden_size, config.num_key_value_heads) == (
        24, 3, 32, 2)
    assert data["chosen"]["sizes"] == {"hidden": 32, "heads": 2, "ffn": 24, "layers": 3}
    assert len(data["candidates"]) == 1
    model, report, _ = in_process(inputs[0], target=0.5, sizes={"ffn": 24, "layers": 3})
    assert same_weights(transformers.LlamaForCausalLM.from_pretrained(out), model)


def test_axes(capsys, tmp_path, inputs):
    out = tmp_path / "small"
    code, stdout, err = run(capsys, *shrink_args(inputs, out), "--axes", "ffn, layers", "--json")
    assert code == 0, err
    data = json.loads(stdout)
    assert all(c["sizes"]["hidden"] == 32 and c["sizes"]["heads"] == 2 for c in data["candidates"])
    config = transformers.AutoConfig.from_pretrained(out)
    assert (config.hidden_size, config.num_key_value_heads, config.num_attention_heads) == (32, 2, 4)
    assert (config.intermediate_size, config.num_hidden_layers) == (data["chosen"]["sizes"]["ffn"],
                                                                    data["chosen"]["sizes"]["layers"])


def test_distillation_runs_and_reports_its_losses(capsys, tmp_path, inputs):
    plain, distilled = tmp_path / "plain", tmp_path / "distilled"
    assert run(capsys, *shrink_args(inputs, plain), "--json")[0] == 0
    code, stdout, err = run(capsys, *shrink_args(inputs, distilled), "--distill", inputs[1], "--distill-steps", "3",
                            "--json")
    assert code == 0, err
    report = json.loads(stdout)["distill"]
    assert report["steps"] == 3
    assert math.isfinite(report["initial_loss"]) and math.isfinite(report["final_loss"])
    a = transformers.LlamaForCausalLM.from_pretrained(plain)
    b = transformers.LlamaForCausalLM.from_pretrained(distilled)
    assert config(a) == config(b)  # the same shrunk shapes ...
    assert not same_weights(a, b)  # ... trained for three steps


# ------------------------------------------------------------------ bad arguments
BAD = [  # (option, value, message): each exits 2 with one line, before any work
    ("--target", "abc", "--target 'abc' is not a number"),
    ("--target", "1.5", "--target 1.5 is out of range"),
    ("--target", "0", "--target 0 is out of range"),
    ("--target", "nan", "--target nan is out of range"),
    ("--sizes", "ffn", "--sizes 'ffn': write axis=count"),
    ("--sizes", "neurons=3", "--sizes 'neurons=3'"),
    ("--sizes", "layers=0", "a count of at least 1"),
    ("--axes", "ffn,neurons", "--axes 'neurons' is not an axis"),
    ("--measure", "flops", "invalid choice: 'flops'"),
    ("--samples", "0", "must be an integer >= 1"),
    ("--model", "no-such-folder", "--model no-such-folder: not a folder"),
    ("--calibration", "missing.txt", "missing.txt"),
    ("--out", "no-such-parent/small", "does not exist; create it first"),
    ("--out", "a-file", "exists and is not a folder"),
]


@pytest.mark.parametrize("option, value, message", BAD, ids=[f"{o}={v}" for o, v, _ in BAD])
def test_bad_arguments_exit_2_with_one_line(capsys, tmp_path, inputs, option, value, message, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a-file").write_text("not a folder")
    argv = shrink_args(inputs, "small")
    if option in argv:
        argv[argv.index(option) + 1] = value
    else:
        argv += [option, value]
    code, stdout, err = run(capsys, *argv)
    assert code == 2 and stdout == "" and message in err
    assert len(err.strip().splitlines()) == 1
    assert entries(tmp_path) == ["a-file"]


@pytest.mark.parametrize("option, value, message", [
    ("--target", "1", "no mix of ['hidden', 'heads', 'ffn', 'layers'] brings llama to 1 params"),
    ("--sizes", "layers=9", "sizes['layers']=9; keep an int between 1 and 4"),
])
def test_arguments_only_the_model_can_judge_fail_with_one_line(capsys, tmp_path, inputs, option, value, message):
    out = tmp_path / "small"
    code, stdout, err = run(capsys, *shrink_args(inputs, out), option, value)
    assert code == 1 and stdout == "" and message in error_line(err)
    assert not out.exists()


# ------------------------------------------------------------------ never half-written
def _old_folder(tmp_path):
    out = tmp_path / "small"
    out.mkdir()
    (out / "old.txt").write_text("the previous output")
    return out


def test_a_failed_save_leaves_the_old_folder(capsys, tmp_path, inputs, monkeypatch):
    out = _old_folder(tmp_path)

    def full_disk(self, *args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(transformers.PreTrainedTokenizerBase, "save_pretrained", full_disk)  # after the weights
    code, stdout, err = run(capsys, *shrink_args(inputs, out))
    assert code == 1 and "OSError: [Errno 28] No space left on device" in error_line(err)
    assert entries(out) == ["old.txt"] and (out / "old.txt").read_text() == "the previous output"
    assert entries(tmp_path) == ["small"]


@pytest.mark.parametrize("existing", [False, True])
def test_an_interrupt_after_the_weights_are_written_leaves_no_half_folder(capsys, tmp_path, inputs, monkeypatch,
                                                                           existing):
    out = _old_folder(tmp_path) if existing else tmp_path / "small"
    real = transformers.PreTrainedModel.save_pretrained
    written = []

    def interrupted(self, folder, *args, **kwargs):
        real(self, folder, *args, **kwargs)
        written.append(entries(folder))
        raise KeyboardInterrupt

    monkeypatch.setattr(transformers.PreTrainedModel, "save_pretrained", interrupted)
    code, _, err = run(capsys, *shrink_args(inputs, out))
    assert code == 130 and error_line(err) == "prunekit: interrupted"
    assert "model.safetensors" in written[0]  # the weights were on disk, in the temporary folder
    assert entries(tmp_path) == (["small"] if existing else [])
    if existing:
        assert entries(out) == ["old.txt"]
