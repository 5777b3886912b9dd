"""``remove_units``: units sliced out in place; a tensor several modules share stays shared."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from prunekit.compact import build_dependency_graph
from prunekit.compact.removal import remove_units
from prunekit.compact.selection.prune import GroupDecision


class TiedLM(nn.Module):
    """An embedding, a hidden layer, and an output head that reads the embedding's own weight."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 6)
        self.mid = nn.Linear(6, 6)
        self.head = nn.Linear(6, 10, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.mid(self.embed(ids))) + self.embed(ids))


def _hidden(graph):
    return next(g for g in graph.prunable_groups() if any(m == "embed" for m, _ in g.slots))


def test_tied_weights_stay_one_tensor():
    torch.manual_seed(0)
    model = TiedLM()
    ids = torch.tensor([[1, 2, 3, 4]])
    graph = build_dependency_graph(model, ids)
    group = _hidden(graph)
    with torch.no_grad():  # channels 1 and 4 carry nothing: removing them is exact
        model.embed.weight[:, [1, 4]] = 0
    before = model(ids)
    assert remove_units(model, graph, [GroupDecision(group, [1, 4], group.n_units)]) == 2
    assert model.head.weight is model.embed.weight and model.embed.weight.shape == (10, 4)
    assert len(list(model.parameters())) == 3  # embedding (= head), mid weight and bias
    torch.testing.assert_close(model(ids), before, rtol=0, atol=1e-6)


def test_tied_weights_are_restored_on_failure(monkeypatch):
    model = TiedLM()
    ids = torch.tensor([[1, 2, 3]])
    graph = build_dependency_graph(model, ids)
    group = _hidden(graph)
    weight = model.embed.weight
    import prunekit.compact.removal as removal

    real, calls = removal.shrink_module, []

    def fail_after_two(*args, **kwargs):  # the embedding and one more module are sliced, then the call fails
        out = real(*args, **kwargs)
        calls.append(args[1])
        if len(calls) == 2:
            raise KeyboardInterrupt
        return out

    monkeypatch.setattr(removal, "shrink_module", fail_after_two)
    with pytest.raises(KeyboardInterrupt):
        remove_units(model, graph, [GroupDecision(group, [0], group.n_units)])
    assert len(calls) == 2
    assert model.embed.weight is weight and model.head.weight is weight and weight.shape == (10, 6)
    assert model.mid.in_features == 6 and model.mid.weight.shape == (6, 6)
