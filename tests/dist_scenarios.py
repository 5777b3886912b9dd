"""Scenarios that tests/dist_harness.py runs on every rank of a gloo process group.

Each scenario builds the same model on every rank (same seed), prunes an
unsharded copy in-process -- the single-process reference -- and a sharded
copy (FSDP2's ``fully_shard``, or ``distribute_tensor``) with the same call,
and checks that this rank's part of every sharded result equals the
reference's part. Nothing is gathered to check it: each rank compares its own
shard with the same slice of the reference.
"""

from __future__ import annotations

import copy
from typing import Callable, List, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor, init_device_mesh

import prunekit
from prunekit.distributed.layout import piece_of


# ----------------------------------------------------------------- helpers
def mesh():
    return init_device_mesh("cpu", (dist.get_world_size(),))


def local_part(full: torch.Tensor, like: DTensor) -> torch.Tensor:
    """The slice of the unsharded ``full`` that this rank's part of ``like`` holds."""
    return piece_of(like, "check").spec.local_slice(full)


def check_equal(sharded: torch.Tensor, full: torch.Tensor, what: str) -> None:
    assert isinstance(sharded, DTensor), f"{what}: expected a DTensor, got {type(sharded).__name__}"
    mine, ref = sharded.to_local().detach(), local_part(full.detach(), sharded)
    assert mine.dtype == ref.dtype, f"{what}: dtype {mine.dtype} vs reference {ref.dtype}"
    assert torch.equal(mine, ref), f"{what}: differs from the single-process result at {int((mine != ref).sum())} of {mine.numel()} entries"


def same_on_all_ranks(value: torch.Tensor, what: str) -> None:
    parts = [torch.empty_like(value) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, value.contiguous())
    assert all(torch.equal(p, parts[0]) for p in parts), f"{what} differs between ranks"


def layers() -> List[Tuple[str, Callable[[], nn.Module], str]]:
    # shapes chosen so that 4 ranks get uneven shards, one of them empty (6 and 5 rows)
    return [
        ("linear", lambda: nn.Linear(10, 6), "weight"),
        ("conv", lambda: nn.Conv2d(4, 5, 3), "weight"),
    ]


def sharded_twin(module: nn.Module, how: str) -> nn.Module:
    """A copy of ``module`` whose parameters are DTensors: FSDP2 (Shard(0)), Shard(1) or Replicate."""
    twin = copy.deepcopy(module)
    if how == "fsdp":
        fully_shard(twin, mesh=mesh())
        return twin
    placement = {"shard1": Shard(1), "replicate": Replicate()}[how]
    for name, p in list(twin.named_parameters()):
        place = placement if p.dim() > 1 else Replicate()
        setattr(twin, name, nn.Parameter(distribute_tensor(p.detach(), mesh(), [place])))
    return twin


CASES = [
    ("identity", lambda m, n: prunekit.identity(m, n)),
    ("l1 0.3", lambda m, n: prunekit.l1_unstructured(m, n, 0.3)),
    ("l1 count", lambda m, n: prunekit.l1_unstructured(m, n, 7)),
    ("l1 twice", lambda m, n: (prunekit.l1_unstructured(m, n, 0.3), prunekit.l1_unstructured(m, n, 0.5))),
    ("l1 bool mask", lambda m, n: prunekit.l1_unstructured(m, n, 0.4, mask_dtype=torch.bool)),
    ("l1 ties", lambda m, n: (_set_ties(m, n), prunekit.l1_unstructured(m, n, 0.45))),
    ("l1 importance", lambda m, n: prunekit.l1_unstructured(
        m, n, 0.5, importance_scores=_scores(m, n))),
    ("random_unstructured", lambda m, n: (prunekit.random_unstructured(m, n, 0.4),
                                          prunekit.random_unstructured(m, n, 0.5))),
    ("ln 2 dim0", lambda m, n: prunekit.ln_structured(m, n, 0.34, 2, 0)),
    ("ln 1 dim1", lambda m, n: prunekit.ln_structured(m, n, 0.5, 1, 1)),
    ("ln inf dim1", lambda m, n: prunekit.ln_structured(m, n, 2, float("inf"), 1)),
    ("ln -inf dim0", lambda m, n: prunekit.ln_structured(m, n, 2, float("-inf"), 0)),
    ("ln fro dim-1", lambda m, n: prunekit.ln_structured(m, n, 0.25, "fro", -1)),
    ("ln nuc dim0", lambda m, n: prunekit.ln_structured(m, n, 0.5, "nuc", 0)),
    ("ln nuc dim1", lambda m, n: prunekit.ln_structured(m, n, 0.5, "nuc", 1)),
    ("ln importance", lambda m, n: prunekit.ln_structured(m, n, 0.5, 2, 1, importance_scores=_scores(m, n))),
    ("random_structured", lambda m, n: (prunekit.random_structured(m, n, 0.34, 0),
                                        prunekit.random_structured(m, n, 1, 1))),
    ("custom_from_mask", lambda m, n: prunekit.custom_from_mask(m, n, _custom(m, n))),
    ("mixed", lambda m, n: (prunekit.l1_unstructured(m, n, 0.2), prunekit.ln_structured(m, n, 1, 2, 0),
                            prunekit.random_structured(m, n, 1, 1), prunekit.l1_unstructured(m, n, 0.3),
                            prunekit.ln_structured(m, n, 0.5, 1, 1))),
    ("bias l1", lambda m, n: prunekit.l1_unstructured(m, "bias", 2)),
]


def _shape(m: nn.Module, n: str) -> torch.Size:
    return (m._parameters.get(n) if n in m._parameters else m._parameters[n + "_orig"]).shape


def _scores(m: nn.Module, n: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    return torch.rand(_shape(m, n), generator=g)


def _custom(m: nn.Module, n: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(8)
    return (torch.rand(_shape(m, n), generator=g) > 0.3).float()


def _set_ties(m: nn.Module, n: str) -> None:
    with torch.no_grad():
        p = m._parameters[n]
        g = torch.Generator().manual_seed(9)
        full = torch.randint(-2, 3, p.shape, generator=g).float()
        if isinstance(p, DTensor):
            p.to_local().copy_(local_part(full, p))
        else:
            p.copy_(full)


# ----------------------------------------------------------------- scenarios
def api_methods(rank: int, world: int) -> None:
    """Every method (and compositions) on FSDP2 shards, Shard(1) and Replicate DTensors."""
    for how in ("fsdp", "shard1", "replicate"):
        for lname, make, pname in layers():
            for cname, call in CASES:
                torch.manual_seed(0)
                ref = make()
                twin = sharded_twin(ref, how)
                torch.manual_seed(1)
                call(ref, pname)
                torch.manual_seed(1)
                call(twin, pname)
                what = f"{how}/{lname}/{cname}"
                for n in ("weight", "bias"):
                    if n + "_mask" in ref._buffers:
                        check_equal(twin._buffers[n + "_mask"], ref._buffers[n + "_mask"], f"{what}: {n}_mask")
                        check_equal(getattr(twin, n), getattr(ref, n), f"{what}: effective {n}")
                hooks = [type(h).__name__ for h in twin._forward_pre_hooks.values() if hasattr(h, "_tensor_name")]
                assert hooks == [type(h).__name__ for h in ref._forward_pre_hooks.values()], (what, hooks)
                # remove bakes the mask in: equal to the reference's plain parameter
                for n in ("weight", "bias"):
                    if n + "_mask" in ref._buffers:
                        prunekit.remove(ref, n)
                        prunekit.remove(twin, n)
                        check_equal(getattr(twin, n), getattr(ref, n), f"{what}: {n} after remove")
                assert not prunekit.is_pruned(twin), what


def api_errors(rank: int, world: int) -> None:
    """Errors are the single-process ones, raised on every rank; the model is left as it was."""
    torch.manual_seed(0)
    m = sharded_twin(nn.Linear(10, 6), "fsdp")
    before = {k: v.to_local().clone() for k, v in m.state_dict().items()}
    for call, exc, text in [
        (lambda: prunekit.l1_unstructured(m, "weight", 61), ValueError, "should be smaller than"),
        (lambda: prunekit.l1_unstructured(m, "weight", 1.5), ValueError, "float in the range [0, 1]"),
        (lambda: prunekit.ln_structured(m, "weight", 0.5, 2, 5), IndexError, "Invalid index"),
        (lambda: prunekit.ln_structured(m, "bias", 0.5, 2, 0), ValueError, "multidimensional"),
    ]:
        try:
            call()
        except exc as e:
            assert text in str(e), f"{text!r} not in {e}"
        else:
            raise AssertionError(f"no {exc.__name__}")
        assert not prunekit.is_pruned(m)
    if rank == 0:  # NaN on one rank only: every rank must still raise
        with torch.no_grad():
            m.weight.to_local()[0, 0] = float("nan")
    try:
        prunekit.l1_unstructured(m, "weight", 0.5)
    except ValueError as e:
        assert "NaN" in str(e), str(e)
    else:
        raise AssertionError("NaN was accepted")

    class KeepOdd(prunekit.BasePruningMethod):
        PRUNING_TYPE = "unstructured"

        def compute_mask(self, t, default_mask):
            return default_mask

    try:
        KeepOdd.apply(m, "bias")
    except TypeError as e:
        assert "no sharded implementation" in str(e) and "custom_from_mask" in str(e), str(e)
    else:
        raise AssertionError("a user method ran on shards")
    assert not prunekit.is_pruned(m)
    with torch.no_grad():
        m.weight.to_local().copy_(before["weight"])
    for k, v in m.state_dict().items():
        assert torch.equal(v.to_local(), before[k]), k


def _net() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 6, 3), nn.ReLU(), nn.Conv2d(6, 5, 3), nn.ReLU(), nn.Flatten(),
                         nn.Linear(5 * 4 * 4, 7), nn.ReLU(), nn.Linear(7, 3))


def _shard_net(net: nn.Module) -> nn.Module:
    for layer in net:
        if any(True for _ in layer.parameters()):
            fully_shard(layer, mesh=mesh())
    fully_shard(net, mesh=mesh())
    return net


def global_pruning(rank: int, world: int) -> None:
    """global_unstructured over sharded layers (and one left unsharded) equals the single-process call."""
    for method, extra in ((prunekit.L1Unstructured, {}), (prunekit.RandomUnstructured, {})):
        for with_scores in (False, True):
            torch.manual_seed(0)
            ref = _net()
            twin = copy.deepcopy(ref)
            for i, layer in enumerate(twin):
                if any(True for _ in layer.parameters()) and i != 7:  # the last layer stays unsharded
                    fully_shard(layer, mesh=mesh())
            names = [(i, "weight") for i in (0, 2, 5, 7)] + [(5, "bias")]
            scores = ({(ref[i], n): torch.rand(_shape(ref[i], n)) for i, n in names} if with_scores else None)
            tscores = ({(twin[i], n): scores[(ref[i], n)] for i, n in names} if with_scores else None)
            # twice: the second call ranks only what the first left
            for amount in (0.6, 0.5):
                torch.manual_seed(3)
                prunekit.global_unstructured([(ref[i], n) for i, n in names], method,
                                             importance_scores=scores, amount=amount, **extra)
                torch.manual_seed(3)
                prunekit.global_unstructured([(twin[i], n) for i, n in names], method,
                                             importance_scores=tscores, amount=amount, **extra)
                for i, n in names:
                    what = f"{method.__name__} scores={with_scores} amount={amount} layer {i}.{n}"
                    got, want = twin[i]._buffers[n + "_mask"], ref[i]._buffers[n + "_mask"]
                    if isinstance(got, DTensor):
                        check_equal(got, want, what)
                    else:
                        assert torch.equal(got, want), what
            total = sum(int((ref[i]._buffers[n + "_mask"] == 0).sum()) for i, n in names)
            numel = sum(_shape(ref[i], n).numel() for i, n in names)
            assert total == round(0.6 * numel) + round(0.5 * (numel - round(0.6 * numel))), total


def fsdp_training(rank: int, world: int) -> None:
    """A pruned FSDP2 model trains unchanged: same losses as one process, pruned entries stay zero."""
    torch.manual_seed(0)
    ref = _net()
    twin = _shard_net(copy.deepcopy(ref))
    prunekit.global_unstructured([(ref[i], "weight") for i in (0, 2, 5, 7)], prunekit.L1Unstructured, amount=0.7)
    prunekit.global_unstructured([(twin[i], "weight") for i in (0, 2, 5, 7)], prunekit.L1Unstructured,
                                 amount=0.7)
    prunekit.ln_structured(ref[2], "weight", 1, 2, 0, mask_dtype=torch.bool)
    prunekit.ln_structured(twin[2], "weight", 1, 2, 0, mask_dtype=torch.bool)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=0.05, weight_decay=0.1)
    opt = torch.optim.AdamW(twin.parameters(), lr=0.05, weight_decay=0.1)
    g = torch.Generator().manual_seed(5)
    for step in range(4):
        x = torch.randn(4 * world, 3, 8, 8, generator=g)
        y = torch.randn(4 * world, 3, generator=g)
        loss_ref = nn.functional.mse_loss(ref(x), y)
        mine = slice(4 * rank, 4 * rank + 4)
        loss = nn.functional.mse_loss(twin(x[mine]), y[mine])
        losses = torch.stack([loss.detach()])
        dist.all_reduce(losses)
        assert torch.allclose(losses / world, loss_ref.detach(), rtol=1e-5, atol=1e-6), (step, losses, loss_ref)
        loss_ref.backward()
        loss.backward()
        for i in (0, 2, 5, 7):
            grad = twin[i].weight_orig.grad
            check_mask = twin[i].weight_mask
            assert torch.all(grad.to_local()[check_mask.to_local() == 0] == 0), f"layer {i}: gradient at pruned entries"
        opt_ref.step()
        opt.step()
        opt_ref.zero_grad()
        opt.zero_grad()
    for i in (0, 2, 5, 7):
        w = twin[i].weight
        assert torch.all(w.to_local()[twin[i].weight_mask.to_local() == 0] == 0)
        assert torch.allclose(w.to_local(), local_part(ref[i].weight.detach(), w), rtol=1e-4, atol=1e-5), i
        check_equal(twin[i].weight_mask, ref[i].weight_mask, f"layer {i} mask")
    # the forward of the sharded model reads the pruned weights: one more step, compare outputs
    x = torch.randn(2, 3, 8, 8, generator=g)
    assert torch.allclose(twin(x), ref(x), rtol=1e-4, atol=1e-5)
    # masks take only this rank's share: no full-size buffer anywhere
    for i in (0, 2, 5, 7):
        mask = twin[i]._buffers["weight_mask"]
        assert isinstance(mask, DTensor) and mask.to_local().shape == twin[i].weight_orig.to_local().shape


def prune_before_shard(rank: int, world: int) -> None:
    """A model pruned before fully_shard: shard_masks() shards its masks; training is unchanged."""
    torch.manual_seed(0)
    ref = _net()
    prunekit.l1_unstructured(ref[5], "weight", 0.5)
    twin = copy.deepcopy(ref)
    _shard_net(twin)
    try:
        twin[5].weight
    except TypeError as e:
        assert "shard_masks" in str(e), str(e)
    else:
        raise AssertionError("a full-size mask beside a shard went unnoticed")
    assert prunekit.distributed.shard_masks(twin) == 1
    check_equal(twin[5].weight_mask, ref[5].weight_mask, "mask")
    check_equal(twin[5].weight, ref[5].weight, "effective weight")
    x = torch.randn(2, 3, 8, 8)
    assert torch.allclose(twin(x), ref(x), rtol=1e-5, atol=1e-6)
