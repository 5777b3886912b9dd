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
