"""A model of each timm family in ``vision_models.TIMM`` (random weights), pruned and compacted.

The check of tests/compact/test_zoo_torchvision.py: 30% of every prunable group by L2 magnitude,
compacted output equal to the masked model's, every blocked group with a reason; the test id
names the family and its outcome. Needs timm (``make test-zoo``).
"""

from __future__ import annotations

import pytest

from helpers import vision_models as V

pytest.importorskip("timm")

pytestmark = [pytest.mark.slow, pytest.mark.zoo, pytest.mark.usefixtures("one_thread")]


@pytest.mark.parametrize("family, expected", V.cases(V.timm_names()))
def test_timm_family_compacts_to_the_masked_models_output(family, expected, record_property):
    model, x = V.build_timm(family)
    outcome = V.prune_and_compact(model, x)
    V.record(family, outcome, record_property)
    V.check(outcome, expected)
