"""The README's code blocks run (with the few names they assume defined first)."""

import re
from pathlib import Path

import pytest
import torch
from torch import nn

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()
BLOCKS = re.findall(r"```python\n(.*?)```", README, flags=re.S)


def prelude(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 4))
    x_img = torch.randn(2, 3, 16, 16)
    loader = [(x_img, torch.tensor([0, 1]))] * 3
    return {
        "model": model,
        "optimizer": torch.optim.SGD(model.parameters(), lr=0.01),
        "loader": loader,
        "loss_fn": nn.CrossEntropyLoss(),
        "x": x_img,
        "torch": torch,
    }


def test_readme_has_examples():
    assert len(BLOCKS) >= 4


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_block_runs(index, tmp_path, monkeypatch):
    code = BLOCKS[index]
    if "tensorplay" in code:
        pytest.importorskip("tensorplay")
    if "compressed" in code:
        pytest.importorskip("safetensors")
    if "init_process_group" in code:
        pytest.skip("a torchrun script: tests/test_distributed.py runs it on 2 processes (readme_example)")
    monkeypatch.chdir(tmp_path)
    namespace = prelude(tmp_path)
    # the compaction block uses a 224x224 input for illustration: keep the test small
    code = code.replace("torch.randn(1, 3, 224, 224)", "torch.randn(1, 3, 16, 16)")
    exec(compile(code, f"README block {index}", "exec"), namespace)


# ------------------------------------------------------------ what the blocks say they print
CLAIM_LITERAL = re.compile(r"#\s*(True|False|-?\d+(?:\.\d+)?)\s*$")
CLAIM_WEIGHTS = re.compile(r"#\s*(\d+) of (\d+) weights")
CLAIM_ROWS = re.compile(r"#\s*(\d+) of (\d+) rows")


def claims(code):
    """``(statement, kind, numbers)`` for every statement of ``code`` whose line comment states a result."""
    import ast

    lines = code.splitlines()
    for stmt in ast.parse(code).body:
        line = lines[stmt.end_lineno - 1]
        for kind, pattern in (("literal", CLAIM_LITERAL), ("weights", CLAIM_WEIGHTS), ("rows", CLAIM_ROWS)):
            m = pattern.search(line)
            if m:
                yield stmt, kind, m.groups()
                break
        else:
            yield stmt, None, ()


@pytest.mark.parametrize("index", [i for i, b in enumerate(BLOCKS) if "init_process_group" not in b and any(
    p.search(line) for line in b.splitlines() for p in (CLAIM_LITERAL, CLAIM_WEIGHTS, CLAIM_ROWS))])
def test_readme_block_prints_what_its_comments_say(index, tmp_path, monkeypatch):
    """``x  # True``, ``prune...(model, ...)  # 614 of 2048 weights``: each stated result is checked."""
    import ast

    monkeypatch.chdir(tmp_path)
    namespace = prelude(tmp_path)
    checked = 0
    for stmt, kind, numbers in claims(BLOCKS[index]):
        module = ast.Module(body=[stmt], type_ignores=[])
        if kind == "literal":
            assert isinstance(stmt, ast.Expr), ast.unparse(stmt)
            value = eval(compile(ast.Expression(stmt.value), f"README block {index}", "eval"), namespace)
            assert value == ast.literal_eval(numbers[0]), ast.unparse(stmt)
            checked += 1
            continue
        exec(compile(module, f"README block {index}", "exec"), namespace)
        if kind is None:
            continue
        target = namespace[stmt.value.args[0].id]  # the module the call pruned
        mask = target.weight_mask
        n, total = int(numbers[0]), int(numbers[1])
        if kind == "weights":
            assert (int((mask == 0).sum()), mask.numel()) == (n, total), ast.unparse(stmt)
        else:
            rows = mask.reshape(mask.shape[0], -1)
            assert (int((rows.sum(dim=1) == 0).sum()), rows.shape[0]) == (n, total), ast.unparse(stmt)
        checked += 1
    assert checked >= 1, "no stated result was checked"
