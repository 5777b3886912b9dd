"""Scenarios that tests/helpers/dist_harness.py runs on every rank of a gloo process group.

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
    ("ln ties", lambda m, n: (_set_ties(m, n), prunekit.ln_structured(m, n, 0.5, 1, 0),
                              prunekit.ln_structured(m, n, 0.5, float("inf"), 1))),
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
    # a state dict with values at pruned entries loads, and the shards stay masked
    sd = {k: (torch.ones_like(v) if k.endswith("weight_orig") else v) for k, v in twin.state_dict().items()}
    twin.load_state_dict(sd)
    for i in (0, 2, 5, 7):
        local, mask = twin[i].weight_orig.to_local(), twin[i].weight_mask.to_local()
        assert torch.all(local[mask == 0] == 0) and torch.all(local[mask != 0] == 1), i
    with torch.no_grad():
        twin[0].weight_orig.to_local().fill_(3.0)  # by hand: remask() puts the zeros back
    assert prunekit.distributed.remask(twin) == 4
    assert torch.all(twin[0].weight_orig.to_local()[twin[0].weight_mask.to_local() == 0] == 0)


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


# ----------------------------------------------------------------- training-aware pruning
def _train_net() -> nn.Module:
    # 8 output rows everywhere: shard boundaries fall on multiples of 2 for 2 and 4 ranks
    return nn.Sequential(nn.Conv2d(4, 8, 3), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 2 * 2, 8), nn.ReLU(),
                         nn.Linear(8, 8))


def _pruning_config(prune_type: str, pattern: str, scope: str, **extra):
    target = {"2:4": 0.5, "1:4": 0.75}.get(pattern, 0.6)
    cfg = {"prune_type": prune_type, "pattern": pattern, "target_sparsity": target, "prune_domain": scope,
           "start_step": 0, "end_step": 0}
    cfg.update(extra)
    return cfg


def _masks(model: nn.Module):
    return {n: m._buffers["weight_mask"] for n, m in model.named_modules() if "weight_mask" in m._buffers}


def training_oneshot_equal(rank: int, world: int) -> None:
    """One mask update of every pattern and scope (and caps) equals the single-process update."""
    patterns = ["1x1", "2x1", "1x2", "2:4", "1xchannel", "channelx1"]
    configs = [(p, s, {}) for p in patterns for s in ("global", "local")]
    configs += [("1x1", "global", {"max_sparsity_ratio_per_layer": 0.65}),
                ("2x1", "global", {"min_sparsity_ratio_per_layer": 0.55}),
                ("1x1", "local", {"max_sparsity_ratio_per_layer": 0.62})]
    for prune_type in ("magnitude", "snip"):
        for pattern, scope, extra in configs:
            what = f"{prune_type} {pattern} {scope} {extra}"
            torch.manual_seed(0)
            ref = _train_net()
            twin = _shard_net(copy.deepcopy(ref))
            cfg = _pruning_config(prune_type, pattern, scope, **extra)
            p_ref = prunekit.prepare_pruning(ref, cfg)
            p_twin = prunekit.prepare_pruning(twin, cfg)
            x = torch.randn(2 * world, 4, 4, 4, generator=torch.Generator().manual_seed(1))
            ref(x).square().mean().backward()
            mine = slice(2 * rank, 2 * rank + 2)
            (twin(x[mine]).square().mean() / 1.0).backward()
            for p in (p_ref, p_twin):
                p.on_step_begin(0)
                p.on_before_optimizer_step()
                p.on_step_end()
            got, want = _masks(twin), _masks(ref)
            assert set(got) == set(want), what
            for n in want:
                check_equal(got[n], want[n], f"{what}: {n}")


def training_run(rank: int, world: int) -> None:
    """Each pruner trains an FSDP2 model to its target exactly; pruned weights stay zero."""
    for prune_type, pattern in (("magnitude", "1x1"), ("snip", "2:4"), ("snip_momentum", "2x1"),
                                ("gradient", "1x2"), ("pattern_lock", "1x1")):
        torch.manual_seed(0)
        model = _shard_net(_train_net())
        if prune_type == "pattern_lock":
            prunekit.l1_unstructured(model[3], "weight", 0.5)
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        cfg = _pruning_config(prune_type, pattern, "global", start_step=1, end_step=4, update_frequency_on_step=1)
        pruning = prunekit.prepare_pruning(model, cfg, opt)
        g = torch.Generator().manual_seed(rank)
        for _ in range(7):
            opt.zero_grad()
            model(torch.randn(4, 4, 4, 4, generator=g)).square().mean().backward()
            opt.step()
        masks = _masks(model)
        zeros = sum(int((m.to_local() == 0).sum()) for m in masks.values())
        total = sum(m.numel() for m in masks.values())
        counts = torch.tensor([zeros])
        dist.all_reduce(counts)
        if prune_type == "pattern_lock":  # keeps exactly the zeros it found
            assert int(counts) == 128, (prune_type, int(counts))  # half of the 32x8 layer
        else:  # the target, in whole units of the pattern
            unit = 2 if pattern in ("2x1", "1x2") else 1
            assert int(counts) == round(cfg["target_sparsity"] * total / unit) * unit, (prune_type, int(counts))
        for n, m in model.named_modules():
            if "weight_mask" in m._buffers:
                local = m.weight_orig.to_local()
                assert torch.all(local[m.weight_mask.to_local() == 0] == 0), (prune_type, n)
                assert torch.all(m.weight.to_local()[m.weight_mask.to_local() == 0] == 0), (prune_type, n)
        pruning.unwire()


def ddp_training(rank: int, world: int) -> None:
    """Under DDP (plain tensors) every rank reaches the same masks with a gradient criterion."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = _train_net()
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    cfg = _pruning_config("snip_momentum", "1x1", "global", start_step=0, end_step=3)
    prunekit.prepare_pruning(model, cfg, opt)
    g = torch.Generator().manual_seed(rank)  # different data per rank: the gradients are averaged
    for _ in range(5):
        opt.zero_grad()
        ddp(torch.randn(4, 4, 4, 4, generator=g)).square().mean().backward()
        opt.step()
    for n, m in _masks(model).items():
        same_on_all_ranks(m, f"mask {n}")
    zeros = sum(int((m == 0).sum()) for m in _masks(model).values())
    assert zeros == round(0.6 * sum(m.numel() for m in _masks(model).values()))


# ----------------------------------------------------------------- checkpoints
class _SharedDir:
    """A temporary directory every rank uses (made by rank 0, removed by it at the end)."""

    def __enter__(self) -> str:
        import tempfile

        box = [tempfile.mkdtemp(prefix="prunekit-dcp-") if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(box, src=0)
        self.path = box[0]
        return self.path

    def __exit__(self, *exc) -> None:
        import shutil

        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(self.path, ignore_errors=True)


def dcp_round_trip(rank: int, world: int) -> None:
    """A pruned FSDP2 model saved with DCP loads (masks included) into a fresh, unpruned one."""
    import os

    torch.manual_seed(0)
    model = _shard_net(_net())
    prunekit.global_unstructured([(model[i], "weight") for i in (0, 2, 5)], prunekit.L1Unstructured, amount=0.6)
    prunekit.ln_structured(model[7], "weight", 1, 2, 0, mask_dtype=torch.bool)
    with _SharedDir() as tmp:
        path = os.path.join(tmp, "ckpt")
        prunekit.distributed.save(path, model)
        torch.manual_seed(1)
        fresh = _shard_net(_net())
        prunekit.distributed.load(path, fresh)
    x = _assert_same_shards(model, fresh)
    # the fresh model trains like the original (its masks are wired to FSDP2)
    for m in (model, fresh):
        m(x).sum().backward()
    for i in (0, 2, 5, 7):
        assert torch.equal(model[i].weight_orig.grad.to_local(), fresh[i].weight_orig.grad.to_local()), i


def training_resume(rank: int, world: int) -> None:
    """Pruning state saved mid-schedule and resumed in fresh processes' objects continues identically."""
    import os

    cfg = _pruning_config("snip_momentum", "1x1", "global", start_step=0, end_step=6)

    def fresh():
        torch.manual_seed(0)
        model = _shard_net(_train_net())
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        return model, opt, prunekit.prepare_pruning(model, cfg, opt)

    def steps(model, opt, start, stop):
        for s in range(start, stop):
            g = torch.Generator().manual_seed(100 * s + rank)
            opt.zero_grad()
            model(torch.randn(4, 4, 4, 4, generator=g)).square().mean().backward()
            opt.step()

    model, opt, pruning = fresh()
    steps(model, opt, 0, 3)
    with _SharedDir() as tmp:
        path = os.path.join(tmp, "ckpt")
        prunekit.distributed.save(path, model, pruning)
        steps(model, opt, 3, 8)
        model2, opt2, pruning2 = fresh()
        prunekit.distributed.load(path, model2, pruning2)
    assert pruning2.global_step == 3 and set(pruning2.pruners[0].scores) == set(pruning.pruners[0].scores)
    steps(model2, opt2, 3, 8)
    for (n, a), (_, b) in zip(_masks(model).items(), _masks(model2).items()):
        assert torch.equal(a.to_local(), b.to_local()), n
    for (n, a), (_, b) in zip(model.named_parameters(), model2.named_parameters()):
        assert torch.equal(a.to_local(), b.to_local()), n


def prune_while_gathered(rank: int, world: int) -> None:
    """Pruning FSDP2's all-gathered copy (root parameters kept gathered after a forward) is refused."""
    torch.manual_seed(0)
    model = nn.Linear(6, 4)
    fully_shard(model, mesh=mesh(), reshard_after_forward=False)
    with torch.no_grad():
        model(torch.randn(2, 6))
    assert not isinstance(model.weight, DTensor)  # gathered, and kept so
    for call in (lambda: prunekit.l1_unstructured(model, "weight", 0.5),
                 lambda: prunekit.global_unstructured([(model, "weight")], prunekit.L1Unstructured, amount=2)):
        try:
            call()
        except ValueError as e:
            assert "all-gathered copy" in str(e) and "reshard" in str(e), str(e)
        else:
            raise AssertionError("pruned the gathered copy")
        assert not prunekit.is_pruned(model)
    model.reshard()
    prunekit.l1_unstructured(model, "weight", 0.5)
    assert isinstance(model.weight_mask, DTensor)


def reports(rank: int, world: int) -> None:
    """model_report and the pruners' report count a sharded model as one process counts it."""
    torch.manual_seed(0)
    ref = _train_net()
    twin = _shard_net(copy.deepcopy(ref))
    cfg = _pruning_config("magnitude", "2x1", "global")
    p_ref, p_twin = prunekit.prepare_pruning(ref, cfg), prunekit.prepare_pruning(twin, cfg)
    for p in (p_ref, p_twin):
        p.on_step_begin(0)
        p.on_step_end()
    got, want = p_twin.report(), p_ref.report()
    assert got == want, (got, want)
    a, b = prunekit.model_report(twin), prunekit.model_report(ref)
    assert (a.nonzero_all, a.numel_all, [e.nonzero for e in a.layers]) == \
        (b.nonzero_all, b.numel_all, [e.nonzero for e in b.layers])
    assert [(e.zero_channels, e.fits_2_4) for e in a.layers] == [(e.zero_channels, e.fits_2_4) for e in b.layers]


def prune_mid_training(rank: int, world: int) -> None:
    """Pruned mid-training with the plain API: Adam's momentum at the newly pruned entries does not leak
    into the FSDP2 forward (the shards are re-masked after every optimizer step); losses as one process."""
    torch.manual_seed(0)
    ref = _net()
    twin = _shard_net(copy.deepcopy(ref))
    opt_ref = torch.optim.Adam(ref.parameters(), lr=0.05)
    opt = torch.optim.Adam(twin.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(5)
    for step in range(5):
        if step == 2:
            for m in (ref, twin):
                prunekit.global_unstructured([(m[i], "weight") for i in (0, 2, 5, 7)], prunekit.L1Unstructured,
                                             amount=0.5)
        x = torch.randn(2 * world, 3, 8, 8, generator=g)
        loss_ref = ref(x).square().mean()
        loss = twin(x[2 * rank:2 * rank + 2]).square().mean()
        total = loss.detach().clone()
        dist.all_reduce(total)
        assert torch.allclose(total / world, loss_ref.detach(), rtol=1e-5, atol=1e-6), step
        loss_ref.backward()
        loss.backward()
        opt_ref.step()
        opt.step()
        opt_ref.zero_grad()
        opt.zero_grad()
        if step >= 2:
            for i in (0, 2, 5, 7):
                local, mask = twin[i].weight_orig.to_local(), twin[i].weight_mask.to_local()
                assert torch.all(local[mask == 0] == 0), (step, i)  # right after the step, not only at forward


def pattern_misaligned(rank: int, world: int) -> None:
    """A block pattern whose blocks a shard boundary would cut is refused up front, saying why."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 12), nn.ReLU(), nn.Linear(12, 8))
    _shard_net(model)
    rows = -(-12 // world)  # FSDP2's split of the first layer's 12 rows
    try:
        prunekit.prepare_pruning(model, _pruning_config("magnitude", "4x1", "global"))
    except ValueError as e:
        assert rows % 4, "12 rows split into multiples of 4: nothing to refuse"
        assert "blocks of 4 output rows" in str(e) and "multiples of 4" in str(e), str(e)
    else:
        assert rows % 4 == 0, "a 4x1 pattern over shards that cut its blocks was accepted"
    assert not prunekit.is_pruned(model)


def save_compressed_sharded(rank: int, world: int) -> None:
    """One compressed file from an FSDP2 model: what one process saves for the same pruned model."""
    import os

    torch.manual_seed(0)
    ref = _net()
    twin = _shard_net(copy.deepcopy(ref))
    for m in (ref, twin):
        prunekit.global_unstructured([(m[i], "weight") for i in (0, 2, 5)], prunekit.L1Unstructured, amount=0.7)
        prunekit.ln_structured(m[7], "weight", 1, 2, 0, mask_dtype=torch.bool)
    try:
        prunekit.save_compressed(twin, "never-written.safetensors")
    except TypeError as e:
        assert "prunekit.distributed.save_compressed" in str(e), str(e)
    else:
        raise AssertionError("the single-process writer took DTensor shards")
    with _SharedDir() as tmp:
        path = os.path.join(tmp, "model.safetensors")
        prunekit.distributed.save_compressed(twin, path, drop_masked_values=True)
        if rank == 0:
            loaded = prunekit.load_compressed(path)
            want = ref.state_dict()
            assert list(loaded) == list(want), (list(loaded), list(want))
            for k, v in want.items():
                if k.endswith("_orig"):  # stored with zeros at pruned entries, as drop_masked_values does
                    v = v * want[k[:-len("_orig")] + "_mask"]
                assert loaded[k].dtype == v.dtype and torch.equal(loaded[k], v), k
            assert os.listdir(tmp) == ["model.safetensors"]  # no spool or temporary left
        # a failure on the writing rank stops every rank, and leaves nothing behind
        bad = os.path.join(tmp, "missing-dir", "m.safetensors")
        try:
            prunekit.distributed.save_compressed(twin, bad)
        except (OSError, RuntimeError) as e:
            assert rank == 0 or "failed to write" in str(e), str(e)
        else:
            raise AssertionError("a failed write went unreported")


# ----------------------------------------------------------------- verified checkpoints
def _pruned_sharded_net() -> nn.Module:
    torch.manual_seed(0)
    model = _shard_net(_net())
    prunekit.global_unstructured([(model[i], "weight") for i in (0, 2, 5)], prunekit.L1Unstructured, amount=0.6)
    prunekit.ln_structured(model[7], "weight", 1, 2, 0, mask_dtype=torch.bool)
    return model


def _local_state(model: nn.Module):
    """Everything a failed load must leave as it was: this rank's values, and which tensors are pruned."""
    values = {k: (v.to_local() if isinstance(v, DTensor) else v).detach().clone() for k, v in model.state_dict().items()}
    return values, [(type(m).__name__, sorted(prunekit.reparam.pruned_names(m))) for m in model.modules()]


def _assert_unchanged(model: nn.Module, before, what: str) -> None:
    values, pruned = _local_state(model)
    assert pruned == before[1], f"{what}: the model was reparameterized: {pruned}"
    assert list(values) == list(before[0]), f"{what}: state dict keys changed: {list(values)}"
    for k, v in values.items():
        assert torch.equal(v, before[0][k]), f"{what}: {k} changed"


def _refused(path: str, model: nn.Module, kind, words: str, **extra) -> str:
    import os

    try:
        prunekit.distributed.load(path, model, **extra)
    except kind as e:
        assert str(e).startswith(os.path.realpath(path)), str(e)
        assert words in str(e), str(e)
        return str(e)
    raise AssertionError(f"a load that must fail ({words}) succeeded")


def dcp_verified_round_trip(rank: int, world: int) -> None:
    """save writes a manifest last; saving over a checkpoint replaces it whole; a fresh model loads it exactly."""
    import os

    model = _pruned_sharded_net()
    with _SharedDir() as tmp:
        path = os.path.join(tmp, "ckpt")
        prunekit.distributed.save(path, _shard_net(_net()))  # an older checkpoint at the same place
        prunekit.distributed.save(path, model, note={"step": 7, "lr": torch.tensor([0.5, 0.25])})
        if rank == 0:
            assert sorted(os.listdir(tmp)) == ["ckpt"], os.listdir(tmp)  # no temporary or replaced folder left
            assert sorted(os.listdir(path)) == [".metadata", "__0_0.distcp", "__1_0.distcp",
                                                "prunekit-manifest.json"], os.listdir(path)
        dist.barrier()
        torch.manual_seed(1)
        fresh = _shard_net(_net())
        note = {"step": 0, "lr": torch.zeros(2)}
        prunekit.distributed.load(path, fresh, note=note)
    assert note["step"] == 7 and torch.equal(note["lr"], torch.tensor([0.5, 0.25])), note
    _assert_same_shards(model, fresh)


def _assert_same_shards(model, fresh):
    """The pruned layers of ``fresh`` hold ``model``'s shards (same dtypes) and compute the same; returns the input."""
    for i in (0, 2, 5, 7):
        for key in ("weight_orig", "weight_mask", "bias"):
            a, b = getattr(model[i], key), getattr(fresh[i], key)
            assert isinstance(b, DTensor) and b.dtype == a.dtype, (i, key)
            assert torch.equal(a.to_local(), b.to_local()), (i, key)
    x = torch.randn(2, 3, 8, 8)
    assert torch.equal(model(x), fresh(x))
    return x


def dcp_damaged_shard(rank: int, world: int) -> None:
    """A bit flipped, a shard missing or truncated on one rank's file: every rank refuses, no model changes."""
    import os

    model = _pruned_sharded_net()
    with _SharedDir() as tmp:
        path = os.path.join(tmp, "ckpt")
        prunekit.distributed.save(path, model)
        shard = os.path.join(path, "__1_0.distcp")
        original = b""
        if rank == 1:
            with open(shard, "rb") as f:
                original = f.read()
        cases = [("bit flip", lambda b: b[:-300] + bytes([b[-300] ^ 0x10]) + b[-299:], "does not match the manifest"),
                 ("truncated", lambda b: b[: len(b) // 2], "truncated or altered"),
                 ("missing", None, "is missing")]
        for what, damage, words in cases:
            if rank == 1:
                if damage is None:
                    os.unlink(shard)
                else:
                    with open(shard, "wb") as f:
                        f.write(damage(original))
            dist.barrier()
            torch.manual_seed(1)
            fresh = _shard_net(_net())
            before = _local_state(fresh)
            msg = _refused(path, fresh, prunekit.distributed.CorruptDistributedCheckpointError, words)
            # the flip is found by the rank that hashes rank 1's shard; the other ranks are told which one
            assert "__1_0.distcp" in msg and (rank == 1 or damage is None or what != "bit flip"
                                             or "(on rank 1)" in msg), msg
            _assert_unchanged(fresh, before, what)
            # a pruned target is left as it was too (its masks and values)
            target = _pruned_sharded_net()
            before = _local_state(target)
            _refused(path, target, prunekit.distributed.CorruptDistributedCheckpointError, words)
            _assert_unchanged(target, before, what + ", pruned target")
            dist.barrier()
            if rank == 1:
                with open(shard, "wb") as f:
                    f.write(original)
            dist.barrier()
        fresh = _shard_net(_net())
        prunekit.distributed.load(path, fresh)  # restored: loads again
        assert torch.equal(fresh[0].weight_mask.to_local(), model[0].weight_mask.to_local())


def dcp_one_rank_fails(rank: int, world: int) -> None:
    """A failure on one rank only -- while reading, or after the others have committed -- changes no rank's model."""
    import os

    model = _pruned_sharded_net()
    with _SharedDir() as tmp:
        path = os.path.join(tmp, "ckpt")
        prunekit.distributed.save(path, model, note={"step": 7})
        # reading: rank 1 asks for an entry the checkpoint does not have (DCP's planning fails there)
        fresh = _shard_net(_net())
        before = _local_state(fresh)
        extra = {"note": {"step": 0}} if rank == 0 else {"note": {"step": 0, "absent": torch.zeros(2)}}
        _refused(path, fresh, prunekit.distributed.DistributedCheckpointError, "absent", **extra)
        _assert_unchanged(fresh, before, "read failure")
        assert extra["note"]["step"] == 0
        # committing: rank 1's target has a tensor where the checkpoint holds a number; rank 0 has already
        # applied everything when it learns, and puts it all back
        note = {"step": 0} if rank == 0 else {"step": torch.zeros(1)}
        _refused(path, fresh, prunekit.distributed.DistributedCheckpointError, "not a tensor", note=note)
        _assert_unchanged(fresh, before, "commit failure on the other rank")
        assert rank == 1 or note == {"step": 0}, note
