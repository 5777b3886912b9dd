"""prunekit.oneshot(..., group=...) on 2 and 4 processes (gloo, CPU): the masks and weights of one process.

The scenarios live in tests/helpers/dist_oneshot_scenarios.py; tests/helpers/dist_harness.py starts the processes (one
launch per world size) and each test reports one scenario on every rank.
"""

import pytest
import torch.distributed as dist

from helpers.dist_harness import run_world

pytest.importorskip("transformers", reason="transformers is not installed")
pytestmark = [pytest.mark.distributed, pytest.mark.hf,
              pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                 reason="torch.distributed with gloo is not available")]

SCENARIOS = ["oneshot_sparsegpt", "oneshot_wanda_and_magnitude", "oneshot_prunekit", "oneshot_refusals",
             "oneshot_folder_shared", "oneshot_moe_unseen_experts"]
_RESULTS = {}


def _results(world):
    if world not in _RESULTS:
        _RESULTS[world] = run_world(world, [f"helpers.dist_oneshot_scenarios:{s}" for s in SCENARIOS], timeout_s=600)
    return _RESULTS[world]


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_ranks_give_the_result_of_one_process(world, scenario):
    per_rank = _results(world)[f"helpers.dist_oneshot_scenarios:{scenario}"]
    failed = {r: v for r, v in per_rank.items() if v != "ok"}
    assert not failed, "\n".join(f"--- rank {r} ---\n{v}" for r, v in sorted(failed.items()))
