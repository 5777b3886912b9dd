"""The block walk of one-shot pruning: each block's statistics, its layers solved, the results written.

Sequential, block by block: the inputs of block ``i`` come from blocks
``0..i-1`` already pruned; only one block (moved to ``device`` when given)
and its calibration activations are in working memory at a time. What happens
to a block as it enters and leaves the walk -- recording it for the rollback,
loading it from disk, baking its masks, writing it out -- is the
:class:`BlockCycle`'s; how the work is shared between processes is the
:class:`~prunekit.oneshot.parallel.Parallel`'s.

The layers of a block are grouped by the input they read (q/k/v share one):
one set of statistics per group, gathered by forward pre-hooks on the group's
first layer (an expert's slice of a 3-D experts parameter: by a tap on the
experts' eager loop, from the tokens routed to that expert only), the forward
stopped as soon as the last group has its input. A slice that no calibration
token reached is pruned by magnitude.
"""

from __future__ import annotations

import copy
import ctypes
import dataclasses
import logging
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from .. import reparam
from ..importance import ActivationStats
from ..methods import custom_from_mask
from ..reparam._internal import orig_and_mask
from .blocks import (BlockInput, Chain, block_output, capture_block_inputs, find_chain, on_device, run_block,
                     stack_starts)
from .experts import Routes
from .inputs import input_taps, token_rows
from .layers import Target
from .parallel import Parallel
from .report import LayerResult, OneshotReport
from .solvers import NM, magnitude_prune, reconstruction_error, refit_masked, sparsegpt_prune, wanda_prune

__all__ = ["BlockCycle", "Walk", "walk_blocks"]

Blocks = List[Tuple[str, nn.Module]]
_TRIM: List[Any] = []
logger = logging.getLogger(__name__)


def give_back_free_memory() -> None:
    """Hand the C allocator's free memory back to the system (glibc's ``malloc_trim``; elsewhere nothing).

    A block's matrices below glibc's mmap threshold come from the heap; freed, they stay resident and
    are not reused by the next, larger matrices. Handing them back after each layer keeps the walk's
    resident size at one layer's working set.

    Examples:
        >>> give_back_free_memory()  # returns nothing; the process's resident size may shrink
    """
    if not _TRIM:
        fn = None
        if sys.platform.startswith("linux"):
            try:
                fn = ctypes.CDLL(None).malloc_trim
                fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
            except (OSError, AttributeError):  # not glibc
                fn = None
        _TRIM.append(fn)
    if _TRIM[0] is not None:
        _TRIM[0](0)


class BlockCycle:
    """What happens to a block as it enters the walk (before any change) and as it leaves (pruned, its
    working copy back where it lives). The default does nothing."""

    def enter(self, index: int, name: str, block: nn.Module, mine: List[Target]) -> None:
        """Called before block ``index`` is touched (``mine``: its layers to prune)."""

    def leave(self, index: int, name: str, block: nn.Module, mine: List[Target]) -> None:
        """Called once block ``index`` is pruned and its next inputs computed."""


@dataclass
class Walk:
    """The settings of one walk."""

    method: str
    sparsity: float
    nm: NM
    opts: Dict[str, Any]
    device: Any
    report: OneshotReport
    par: Parallel
    cycle: BlockCycle
    batches: int  # calibration batches in all (over every rank)
    progress: Optional[Callable[[int, int, str], None]] = None
    bake: bool = False  # write pruned weights straight into the plain parameters (no mask at any time)


def walk_blocks(model: nn.Module, block_list: Blocks, layers: List[Target], batches: List[Any], w: Walk) -> None:
    """Prune ``layers`` block by block (``batches``: every batch; each rank runs its share)."""
    by_block: Dict[int, List[Target]] = {}
    for t in layers:
        by_block.setdefault(t.block, []).append(t)
    if w.method == "magnitude":
        for bi, (bname, block) in enumerate(block_list):
            mine = by_block.get(bi, [])
            w.cycle.enter(bi, bname, block, mine)
            for t in mine:
                t0 = time.perf_counter()
                keep = magnitude_prune(t.matrix().detach(), w.sparsity, w.nm)
                write(t, keep, None, w.bake)
                w.report.layers.append(LayerResult(t.name, t.block, (t.out_features, t.in_features), int((~keep).sum()),
                                                   keep.numel(), None, time.perf_counter() - t0))
            w.cycle.leave(bi, bname, block, mine)
            if w.progress is not None:
                w.progress(bi + 1, len(block_list), bname)
        return
    share = w.par.share(batches)
    starts = stack_starts(block_list)
    inputs = capture_block_inputs(model, block_list[0][1], share, w.device)
    w.report.samples = w.par.sum_int(sum(int(i.hidden.shape[0]) for i in inputs))
    w.report.tokens = w.par.sum_int(sum(int(i.token_mask.sum()) if i.token_mask is not None
                                        else int(i.hidden[..., 0].numel()) for i in inputs))
    paired = w.method.startswith("prunekit") and w.opts["correct_error"]
    dense_inputs = inputs if paired else None
    chain: Optional[Chain] = None
    for bi, (bname, block) in enumerate(block_list):
        if bi in starts:
            if bi:
                inputs, dense_inputs = _restart(model, block_list, bi, share, dense_inputs, w)
            chain = _chain_of(model, block_list, bi, starts, share)
        mine = by_block.get(bi, [])
        w.cycle.enter(bi, bname, block, mine)
        with on_device(block, w.device):
            dense_block = copy.deepcopy(block) if (paired and mine) else None
            if mine:
                if w.method.startswith("prunekit"):
                    _prune_block_sequential(block, dense_block, mine, inputs, dense_inputs, w)
                else:
                    _prune_block_faithful(block, mine, inputs, w)
            if dense_inputs is not None:  # paired: the dense stream runs beside the pruned one
                dense_next = run_block(dense_block if dense_block is not None else block, dense_inputs, chain=chain)
                if mine and w.opts.get("tune_epochs"):
                    _tune_block(block, mine, inputs, dense_next, w.opts["tune_epochs"], w.opts["tune_lr"])
            outputs = run_block(block, inputs, chain=chain)
            if paired:
                dense_inputs = dense_next
            del dense_block
        w.cycle.leave(bi, bname, block, mine)
        give_back_free_memory()
        inputs = outputs
        if w.progress is not None:
            w.progress(bi + 1, len(block_list), bname)


def _restart(model: nn.Module, block_list: Blocks, bi: int, share: List[Any],
             dense_inputs: Optional[List[BlockInput]], w: Walk) -> Tuple[List[BlockInput], Optional[List[BlockInput]]]:
    """The inputs of block ``bi``, the first of a new stack (an encoder-decoder's decoder), from the model with
    the blocks before it pruned; the dense stream's with the last block before it returning the dense states."""
    decoder = bool(getattr(getattr(model, "config", None), "is_encoder_decoder", False))
    key = "decoder_attention_mask" if decoder else "attention_mask"
    block = block_list[bi][1]
    inputs = capture_block_inputs(model, block, share, w.device, mask_key=key)
    if dense_inputs is None:
        return inputs, None
    dense = capture_block_inputs(model, block, share, w.device, mask_key=key,
                                 replace=(block_list[bi - 1][1], [d.hidden for d in dense_inputs]))
    return inputs, dense


def _chain_of(model: nn.Module, block_list: Blocks, bi: int, starts: List[int], share: List[Any]) -> Optional[Chain]:
    """What the model hands from block to block in the stack beginning at ``bi`` (:func:`find_chain`, on the
    first batch); ``None`` for a stack of one block or blocks not in memory (only the hidden states then)."""
    if bi + 1 >= len(block_list) or (bi + 1) in starts or not share:
        return None
    pair = [block_list[bi][1], block_list[bi + 1][1]]
    if any(p.device.type == "meta" for b in pair for p in b.parameters()):
        return None
    return find_chain(model, pair[0], pair[1], share[0])


def write(t: Target, keep: Tensor, new: Optional[Tensor], bake: bool = False) -> None:
    """Mask (and, when given, new weights into ``weight_orig``) through the reparameterization; with ``bake``,
    the new weights (or the layer's own) with ``+0.0`` off the mask straight into the plain parameter.

    An expert's slice: the 3-D parameter gets a mask of ones at its first write, then each slice's entries."""
    p = t.param
    if bake:
        with torch.no_grad():
            slot = p if t.expert is None else p[t.expert]
            if new is not None:
                slot.copy_(t.stored(new))
            slot.masked_fill_(~t.stored(keep).to(p.device), 0)
        return
    mask = t.stored(keep).to(device=p.device, dtype=p.dtype)
    if t.expert is not None:
        if not reparam.is_masked(t.module, t.tensor):
            custom_from_mask(t.module, t.tensor, torch.ones_like(p))
        orig, masks = orig_and_mask(t.module, t.tensor)
        with torch.no_grad():
            masks[t.expert].copy_(mask)
        p, mask = orig[t.expert], masks[t.expert]
    else:
        custom_from_mask(t.module, t.tensor, mask)
        p = t.param
    if new is not None:
        with torch.no_grad():
            p.copy_(reparam.masked(t.stored(new).to(device=p.device, dtype=p.dtype), mask))


# ------------------------------------------------------------------ statistics
def stages(block: nn.Module, targets: Sequence[Target], inp: BlockInput) -> List[List[Target]]:
    """Group a block's targets by the input they read, in execution order (q/k/v share one input)."""
    # the inputs themselves, not their id(): a tensor freed during the forward (o_proj's input)
    # may hand its address to the next one (the FFN's input), and an id would then merge two stages
    order: List[Tuple[Tensor, Target]] = []

    def seen(t: Target, x: Tensor, _tokens: Optional[Tensor]) -> None:
        order.append((x, t))

    with input_taps([(t, seen) for t in targets], block), torch.no_grad():
        block(*inp.args, **inp.kwargs)
    out: List[List[Target]] = []
    last: Optional[Tensor] = None
    done = set()
    for x, t in order:
        if t.name in done:
            continue
        done.add(t.name)
        if out and last is x:
            out[-1].append(t)
        else:
            last = x
            out.append([t])
    # not called on this batch (a routed expert): each on its own, last, from the batches that call it
    out.extend([t] for t in targets if t.name not in done)
    return _experts_together(out, targets)


def _experts_together(groups: List[List[Target]], targets: Sequence[Target]) -> List[List[Target]]:
    """The slices of one experts module next to each other where the module is first seen: every expert's
    first parameter, then every expert's second (each expert's slice a group of its own)."""
    rank = {t.name: i for i, t in enumerate(targets)}
    by_module: Dict[int, List[List[Target]]] = {}
    for g in groups:
        if g[0].expert is not None:
            by_module.setdefault(id(g[0].module), []).append(g)
    out: List[List[Target]] = []
    for g in groups:
        if g[0].expert is None:
            out.append(g)
        elif id(g[0].module) in by_module:
            out.extend(sorted(by_module.pop(id(g[0].module)), key=lambda h: rank[h[0].name]))
    return out


def _same_slices(a: List[Target], b: List[Target]) -> bool:
    """Both groups are slices of one experts parameter (their inputs do not depend on each other)."""
    return (a[0].expert is not None and b[0].expert is not None and a[0].module is b[0].module
            and a[0].tensor == b[0].tensor)


class _StopBlock(Exception):
    pass


def _capture_first(block: nn.Module, leads: Sequence[Target], inp: BlockInput, record: Optional[Routes] = None,
                   replay: Optional[Routes] = None) -> List[Optional[Tensor]]:
    """Run ``block`` on ``inp`` and return the rows (padding left out) each of ``leads`` read first (``None`` for
    one the block did not call on this batch); the forward stops once every lead has its input."""
    got: Dict[str, Tensor] = {}
    want = {t.name for t in leads}

    def seen(t: Target, x: Tensor, tokens: Optional[Tensor]) -> None:
        if t.name not in got:
            got[t.name] = token_rows(x, inp.token_mask, tokens)
        if len(got) == len(want):
            raise _StopBlock

    with input_taps([(t, seen) for t in leads], block, record, replay), torch.no_grad():
        try:
            block(*inp.args, **inp.kwargs)
        except _StopBlock:
            pass
    return [got.get(t.name) for t in leads]


def _gather(block: nn.Module, groups: List[List[Target]], inputs: List[BlockInput], w: Walk,
            adders: List[Callable[..., None]], dense: Optional[Tuple[nn.Module, List[BlockInput]]] = None) -> None:
    """Each group's input rows (padding left out; with ``dense``, the dense block's rows beside them) of every
    calibration batch handed to the group's adder, batch by batch in batch order, on the group's owner rank."""
    leads = [g[0] for g in groups]
    dense_leads: List[Target] = []
    if dense is not None:
        names = {id(m): n for n, m in block.named_modules()}
        dense_mods = dict(dense[0].named_modules())
        dense_leads = [dataclasses.replace(t, module=dense_mods[names[id(t.module)]]) for t in leads]
    for j in range(w.par.rounds(w.batches)):
        rows: List[Optional[Tuple[Tensor, ...]]] = [None] * len(groups)
        if j < len(inputs):
            routes: Routes = {}  # the dense copy's experts see the pruned block's tokens
            xs = _capture_first(block, leads, inputs[j], record=routes)
            xds = _capture_first(dense[0], dense_leads, dense[1][j], replay=routes) if dense is not None else None
            for k, x in enumerate(xs):
                if x is None:
                    continue
                r: Tuple[Tensor, ...] = (x,)
                if xds is not None:
                    xd = xds[k]
                    if xd is None:
                        raise ValueError(f"the dense copy of the block never called {groups[k][0].name!r}, which the "
                                         "pruned block called, on one calibration batch")
                    r = r + (xd,)
                rows[k] = r
        for k in range(len(groups)):
            w.par.deliver(w.par.owner(k), rows[k], adders[k])


# ------------------------------------------------------------------ solving, shared between ranks
def _cost(t: Target) -> float:
    return float(t.in_features) ** 3 + float(t.out_features) * float(t.in_features) ** 2


Solved = Tuple[Optional[Tensor], Tensor, Optional[float], float]  # new weights, keep-mask, error, seconds


def _solve_all(jobs: List[Target], solve: Callable[[Target], Solved], writes_weights: bool, w: Walk,
               release: Optional[Callable[[Target], Any]] = None) -> None:
    """Solve every job once (on the rank the plan gives it), write each result on every rank, report it.

    ``release(t)`` drops the solver's references to ``t``'s statistics once ``t`` is solved (a group's
    statistics are freed with its last layer)."""
    owners = w.par.plan([_cost(t) for t in jobs])
    done: Dict[int, Solved] = {}
    for i, t in enumerate(jobs):
        if owners[i] != w.par.rank:
            if release is not None:
                release(t)
            continue
        done[i] = solve(t)
        if release is not None:
            release(t)
        if w.par.world == 1:  # written at once: one layer's result in memory at a time
            _record(t, done.pop(i), w)
            give_back_free_memory()  # here, not in _record: the call's arguments live until it returns
    for i, t in enumerate(jobs):
        if w.par.world > 1:
            _record(t, _share_result(t, done.pop(i, None), owners[i], writes_weights, w), w)
            give_back_free_memory()


def _share_result(t: Target, res: Optional[Solved], src: int, writes_weights: bool, w: Walk) -> Solved:
    shape = (t.out_features, t.in_features)
    dev = t.param.device
    keep = res[1] if res is not None else torch.empty(shape, dtype=torch.bool, device=dev)
    new = res[0] if res is not None else None
    # error (NaN: none), seconds, and whether new weights follow (a layer no token reached has none)
    nums = torch.tensor([float("nan") if res is None or res[2] is None else res[2], 0.0 if res is None else res[3],
                         float(new is not None)], dtype=torch.float64)
    w.par.share_tensor(keep, src)
    w.par.share_tensor(nums, src)
    if writes_weights and bool(nums[2]):
        if new is None:
            new = torch.empty(shape, dtype=torch.float32, device=dev)
        w.par.share_tensor(new, src)
    error = None if nums[0].isnan() else float(nums[0])
    return new, keep, error, float(nums[1])


def _record(t: Target, res: Solved, w: Walk) -> None:
    new, keep, error, seconds = res
    write(t, keep, new, w.bake)
    w.report.layers.append(LayerResult(t.name, t.block, (t.out_features, t.in_features), int((~keep).sum()),
                                       keep.numel(), error, seconds))


def _share_stats(st: ActivationStats, src: int, par: Parallel) -> None:
    par.share_tensor(st.sq_norm, src)
    if st.has_hessian:
        par.share_tensor(st.xtx, src)
    st.count = par.share_int(st.count, src)


# ------------------------------------------------------------------ the methods on one block
def _prune_block_faithful(block: nn.Module, mine: List[Target], inputs: List[BlockInput], w: Walk) -> None:
    """Wanda / SparseGPT as published: every layer's statistics from one pass of the block."""
    dev = mine[0].param.device
    groups = stages(block, mine, inputs[0])
    hessian = w.method == "sparsegpt"
    stats = [ActivationStats(g[0].in_features, hessian=hessian, device=dev) for g in groups]
    _gather(block, groups, inputs, w, [st.add for st in stats])
    for gi, st in enumerate(stats):
        _share_stats(st, w.par.owner(gi), w.par)
    of = {t.name: stats[gi] for gi, g in enumerate(groups) for t in g}
    del stats  # each group's statistics live as long as one of its layers is unsolved
    opts = w.opts

    def solve(t: Target) -> Solved:
        t0 = time.perf_counter()
        st = of[t.name]
        dense = t.matrix().detach()  # in its own dtype: the solvers compute in float32
        if st.count == 0:
            return _unseen(t, dense, w, t0)
        if w.method == "wanda":
            keep = wanda_prune(dense, st.norm, w.sparsity, w.nm)
            return None, keep, None, time.perf_counter() - t0
        new, keep = sparsegpt_prune(dense, st.xtx, w.sparsity, w.nm, block_size=opts["block_size"], damp=opts["damp"])
        return new, keep, reconstruction_error(new, dense, st.xtx), time.perf_counter() - t0

    _solve_all(mine, solve, hessian, w, release=lambda t: of.pop(t.name))


def _unseen(t: Target, dense: Tensor, w: Walk, t0: float) -> Solved:
    """A layer no calibration token reached (an expert never routed to): pruned by magnitude."""
    logger.info("%s: no calibration token reached it; pruned by magnitude", t.name)
    return None, magnitude_prune(dense, w.sparsity, w.nm), None, time.perf_counter() - t0


def solve_prunekit(w_dense: Tensor, xtx: Tensor, cross: Optional[Tensor], sparsity: float, nm: NM,
                   opts: Dict[str, Any]) -> Tuple[Tensor, Tensor, Tensor]:
    """The default method on one layer: (new weight, keep-mask, the target weights it fits)."""
    damp, bs = opts["damp"], opts["block_size"]
    target = w_dense
    if cross is not None and opts["correct_error"]:
        # the weights whose outputs on the pruned inputs best match the dense layer on the dense inputs,
        # ridge-regularised toward the dense weights (not toward zero):
        # min ||X_p T^T - X_d D^T||^2 + lam ||T - D||^2  ->  (H + lam I) T^T = X_p^T X_d D^T + lam D^T
        lam = float(opts["correct_damp"]) * float(xtx.diagonal().mean())
        h = xtx + lam * torch.eye(xtx.shape[0], device=xtx.device, dtype=xtx.dtype)
        target = torch.linalg.solve(h, cross @ w_dense.t() + lam * w_dense.t()).t()
    new, keep = sparsegpt_prune(target, xtx, sparsity, nm, block_size=bs, damp=damp)
    new = refit_masked(new, keep, xtx, target, iters=opts["refit_iters"], damp=damp)
    for _ in range(int(opts["rounds"])):
        # re-select: SparseGPT again, started from the refit weights plus what the mask dropped of the target
        start = torch.where(keep, new, target)
        new2, keep2 = sparsegpt_prune(start, xtx, sparsity, nm, block_size=bs, damp=damp)
        new2 = refit_masked(new2, keep2, xtx, target, iters=opts["refit_iters"], damp=damp)
        if reconstruction_error(new2, target, xtx) < reconstruction_error(new, target, xtx):
            new, keep = new2, keep2
    return new, keep, target


def _prune_block_sequential(block: nn.Module, dense_block: Optional[nn.Module], mine: List[Target],
                            inputs: List[BlockInput], dense_inputs: Optional[List[BlockInput]], w: Walk) -> None:
    """prunekit's method on one block: dense-model targets, SparseGPT selection, masked least-squares refit.

    With ``sequential`` the groups of layers that share an input (q/k/v; out; FFN in; FFN out) are solved
    in execution order, each from activations of the block with the earlier groups already pruned;
    without it every group is solved from one pass (as SparseGPT does).
    """
    groups = stages(block, mine, inputs[0])
    dev = mine[0].param.device
    rounds: List[List[List[Target]]] = [groups]
    if w.opts["sequential"]:  # one round per input, every expert's slices of one parameter in one round
        rounds = []
        for g in groups:
            if rounds and _same_slices(rounds[-1][-1], g):
                rounds[-1].append(g)
            else:
                rounds.append([g])
    dense = (dense_block, dense_inputs) if dense_block is not None and dense_inputs is not None else None
    for batch_groups in rounds:
        xtx = [torch.zeros(g[0].in_features, g[0].in_features, device=dev) for g in batch_groups]
        cross = [torch.zeros_like(h) for h in xtx] if dense is not None else None
        seen = [0] * len(batch_groups)

        def adder(j: int) -> Callable[..., None]:
            def add(xp: Tensor, xd: Optional[Tensor] = None) -> None:
                xp = xp.float()
                seen[j] += int(xp.shape[0])
                xtx[j].addmm_(xp.t(), xp)
                if cross is not None and xd is not None:
                    cross[j].addmm_(xp.t(), xd.float())
            return add

        _gather(block, batch_groups, inputs, w, [adder(j) for j in range(len(batch_groups))], dense)
        for j in range(len(batch_groups)):
            w.par.share_tensor(xtx[j], w.par.owner(j))
            if cross is not None:
                w.par.share_tensor(cross[j], w.par.owner(j))
            seen[j] = w.par.share_int(seen[j], w.par.owner(j))
        of = {t.name: j for j, g in enumerate(batch_groups) for t in g}

        def solve(t: Target) -> Solved:
            t0 = time.perf_counter()
            j = of[t.name]
            if not seen[j]:
                return _unseen(t, t.matrix().detach(), w, t0)
            new, keep, target = solve_prunekit(t.matrix().detach().float(), xtx[j], None if cross is None else cross[j],
                                               w.sparsity, w.nm, w.opts)
            return new, keep, reconstruction_error(new, target, xtx[j]), time.perf_counter() - t0

        _solve_all([t for g in batch_groups for t in g], solve, True, w)


def _tune_block(block: nn.Module, mine: List[Target], inputs: List[BlockInput], targets: List[BlockInput],
                epochs: int, lr: float) -> None:
    """A few epochs of Adam on the kept weights (and biases) of ``mine``: the block's output on the pruned
    model's inputs fitted to the dense block's output on the dense model's inputs (padding left out)."""
    biases = [getattr(t.module, "bias", None) for t in mine if t.expert is None]
    params = list({id(p): p for p in [t.param for t in mine] + [b for b in biases if b is not None]}.values())
    flags = [p.requires_grad for p in params]
    others = [p for p in block.parameters() if all(p is not q for q in params)]
    other_flags = [p.requires_grad for p in others]
    for p in params:
        p.requires_grad_(True)
    for p in others:
        p.requires_grad_(False)
    opt = torch.optim.Adam(params, lr=lr)
    try:
        with torch.enable_grad():
            for _ in range(int(epochs)):
                for inp, tgt in zip(inputs, targets):
                    out = block_output(block(*inp.args, **inp.kwargs))
                    diff = (out - tgt.hidden).float()
                    if inp.token_mask is not None and tuple(diff.shape[:-1]) == tuple(inp.token_mask.shape):
                        diff = diff[inp.token_mask]
                    loss = diff.pow(2).mean()
                    opt.zero_grad(set_to_none=True)
                    loss.backward()
                    opt.step()
    finally:
        for p, f in zip(params, flags):
            p.requires_grad_(f)
            p.grad = None
        for p, f in zip(others, other_flags):
            p.requires_grad_(f)
        with torch.no_grad():
            for t in mine:
                reparam.masked(*orig_and_mask(t.module, t.tensor), inplace=True)
