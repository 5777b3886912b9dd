"""The sharded kernels against the single-process ones, with ranks simulated by threads.

Every rank holds a piece of each tensor (a torch.chunk shard along some
dimension, an empty one included, or a replica); the masks, positions and
norms reassembled from the ranks must equal the single-process results
exactly (norms of split channels: to rounding).
"""

import random

import pytest
import torch

from prunekit.kernels import select_sharded
from prunekit.kernels.norms import channel_norms
from prunekit.kernels.norms_sharded import channel_norms_sharded
from prunekit.kernels.select import NaNScoresError, keep_mask_smallest_multi
from prunekit.kernels.select_sharded import keep_mask_smallest_sharded
from prunekit.kernels.sharded import ShardSpec, gather_along, prefix_index
from helpers.sharded_threads import run_ranks, shard, unshard


def _select(tensors, world, k, dims, eligible=None):
    def fn(comm):
        pieces = [shard(t, world, comm.rank, d) for t, d in zip(tensors, dims)]
        elig = None if eligible is None else [shard(e, world, comm.rank, d)[0] for e, d in zip(eligible, dims)]
        return keep_mask_smallest_sharded([p for p, _ in pieces], [s for _, s in pieces], comm, k, elig), comm.calls

    res = run_ranks(world, fn)
    masks = [unshard([res[r][0][i] for r in range(world)], d) for i, d in enumerate(dims)]
    return masks, [calls for _, calls in res]


@pytest.mark.parametrize("chunk", [None, 5])
@pytest.mark.parametrize("seed", range(4))
def test_selection_equals_single_process(seed, chunk, monkeypatch):
    if chunk is not None:  # bucket a few entries at a time: the chunked passes must not change a thing
        monkeypatch.setattr(select_sharded, "CHUNK", chunk)
    rng = random.Random(seed)
    torch.manual_seed(seed)
    for _ in range(25):
        world = rng.choice([1, 2, 3, 4])
        dtype = rng.choice([torch.float32, torch.float64, torch.float16, torch.bfloat16])
        tensors, dims = [], []
        for _ in range(rng.randint(1, 4)):
            shape = tuple(rng.randint(1, 9) for _ in range(rng.randint(1, 3)))
            t = torch.randn(shape) if rng.random() < 0.5 else torch.randint(-3, 4, shape).float()  # many ties
            tensors.append(t.to(dtype))
            dims.append(rng.choice([None] + list(range(len(shape)))))
        eligible = None
        total = sum(t.numel() for t in tensors)
        if rng.random() < 0.4:
            eligible = [torch.rand(t.shape) < 0.7 for t in tensors]
            total = sum(int(e.sum()) for e in eligible)
        k = rng.randint(0, total)
        want = keep_mask_smallest_multi(tensors, k, eligible)
        got, _ = _select(tensors, world, k, dims, eligible)
        for a, b in zip(want, got):
            assert torch.equal(a, b), (world, dims, k)


def test_large_bucket_is_refined_and_ties_split_by_position():
    torch.manual_seed(0)
    dense = torch.randn(400, 300)
    zeros = torch.zeros(50, 30)  # 1500 tied zeros: the k-th falls among them
    for world in (2, 4):
        for k in (1, 1000, 1200, 60000, 121500):
            want = keep_mask_smallest_multi([zeros, dense], k)
            got, calls = _select([zeros, dense], world, k, [1, 0])
            assert all(torch.equal(a, b) for a, b in zip(want, got)), (world, k)
            assert max(calls) <= 12  # one histogram, a few 256-bin rounds, one small gather


def test_k_as_function_of_the_eligible_count_and_errors_on_every_rank():
    t = torch.arange(10.0).view(5, 2)
    got, _ = _select([t], 2, lambda n: n // 2, [0])
    assert int((~got[0]).sum()) == 5
    with pytest.raises(ValueError, match="cannot select k=11 entries out of 10"):
        _select([t], 2, 11, [0])
    t[4, 1] = float("nan")  # on the last rank only: both ranks raise
    with pytest.raises(NaNScoresError, match="1 NaN"):
        _select([t], 2, 3, [0])


def test_prefix_index_and_gather_along():
    torch.manual_seed(1)
    flags = torch.rand(5, 3, 4) < 0.5
    want = torch.full(flags.shape, -1, dtype=torch.int64)
    want[flags] = torch.arange(int(flags.sum()))
    for world in (1, 2, 3, 4):
        for dim in (None, 0, 1, 2):
            def fn(comm):
                piece, spec = shard(flags, world, comm.rank, dim)
                idx, total = prefix_index(piece, spec, comm)
                out = torch.full(piece.shape, -1, dtype=torch.int64)
                out[piece] = idx
                return out, total

            res = run_ranks(world, fn)
            assert torch.equal(unshard([r[0] for r in res], dim), want), (world, dim)
            assert {r[1] for r in res} == {int(flags.sum())}
    values = torch.arange(7.0)
    for world in (2, 3, 4):
        res = run_ranks(world, lambda comm: gather_along(
            shard(values, world, comm.rank, 0)[0], shard(values, world, comm.rank, 0)[1], comm))
        assert all(torch.equal(r, values) for r in res)


@pytest.mark.parametrize("n", [1, 2, 3, 0.5, 0, float("inf"), float("-inf"), "fro", "nuc"])
def test_channel_norms(n):
    torch.manual_seed(2)
    t = torch.randn(5, 4, 3, 2)
    t[t.abs() < 0.3] = 0
    for world in (2, 4):
        for dim in range(4):
            want = channel_norms(t, n, dim)
            for sdim in (None, 0, 1, 3):
                res = run_ranks(world, lambda comm: channel_norms_sharded(
                    *shard(t, world, comm.rank, sdim)[:1], n, dim, shard(t, world, comm.rank, sdim)[1], comm))
                for r in res:
                    if sdim is None or sdim == dim:
                        assert torch.equal(r, want), (world, dim, sdim)  # whole channels: bit for bit
                    else:
                        torch.testing.assert_close(r, want, rtol=1e-5, atol=1e-6)


def test_shard_spec_checks_its_piece():
    spec = ShardSpec((4, 3), dim=0, offset=2, length=2)
    spec.check((2, 3), "t")
    with pytest.raises(ValueError, match="does not fit"):
        spec.check((3, 3), "t")
