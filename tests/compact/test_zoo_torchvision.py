"""Every torchvision classifier (random weights, 10 classes, a small input), pruned and compacted.

30% of every prunable group by L2 magnitude, the classifier's outputs kept; the compacted model's
output must equal the masked model's (relative error at most ``vision_models.RTOL``), and a group
that cannot be pruned must say why. A test id names the model and its outcome: ``-exact``, or
``-blocked`` for a model without any prunable group (``vision_models.BLOCKED`` says why).
Needs torchvision (``make test-zoo`` installs it beside the environment).
"""

from __future__ import annotations

import pytest

from helpers import vision_models as V

pytest.importorskip("torchvision")

pytestmark = [pytest.mark.slow, pytest.mark.zoo, pytest.mark.usefixtures("one_thread")]


@pytest.mark.parametrize("name, expected", V.cases(V.torchvision_names()))
def test_torchvision_classifier_compacts_to_the_masked_models_output(name, expected, record_property):
    model, x = V.build_torchvision(name)
    outcome = V.prune_and_compact(model, x)
    V.record(name, outcome, record_property)
    V.check(outcome, expected)
