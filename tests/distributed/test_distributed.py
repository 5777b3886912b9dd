"""prunekit on sharded models: 2 (and 4) processes on CPU with gloo, launched from pytest.

The scenarios (tests/helpers/dist_scenarios.py) compare every sharded result with the
single-process result of the same call; tests/helpers/dist_harness.py runs them. All
scenarios of one world size run in one launch (processes start once), and
each test reports one scenario on every rank.
"""

import pytest
import torch.distributed as dist

from helpers.dist_harness import run_world

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")

SCENARIOS_2 = ["api_methods", "api_errors", "global_pruning", "fsdp_training", "prune_before_shard",
               "training_oneshot_equal", "training_run", "ddp_training", "dcp_round_trip", "training_resume",
               "prune_while_gathered", "reports", "prune_mid_training",
               "pattern_misaligned", "save_compressed_sharded"]
SCENARIOS_4 = ["api_methods", "global_pruning", "fsdp_training", "training_oneshot_equal", "training_run",
               "dcp_round_trip", "save_compressed_sharded"]

_RESULTS = {}


def _results(world, scenarios):
    if world not in _RESULTS:
        _RESULTS[world] = run_world(world, scenarios)
    return _RESULTS[world]


def _check(per_rank):
    failed = {r: v for r, v in per_rank.items() if v != "ok"}
    assert not failed, "\n".join(f"--- rank {r} ---\n{v}" for r, v in sorted(failed.items()))


@pytest.mark.parametrize("scenario", SCENARIOS_2)
def test_two_ranks(scenario):
    _check(_results(2, SCENARIOS_2)[scenario])


@pytest.mark.parametrize("scenario", SCENARIOS_4)
def test_four_ranks(scenario):
    _check(_results(4, SCENARIOS_4)[scenario])
