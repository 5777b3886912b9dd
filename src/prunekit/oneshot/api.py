"""``prunekit.oneshot``: prune a pretrained model from a few hundred calibration samples.

Sequential, block by block: the inputs of block ``i`` come from blocks
``0..i-1`` already pruned; only one block (moved to ``device`` when given)
and its calibration activations are in working memory at a time. Masks are
written through the reparameterization (``weight_orig``/``weight_mask``), so
``remove``, compressed checkpoints, sparse inference and the reports all
work; methods that update the remaining weights write them to ``weight_orig``.

Methods
-------
``"magnitude"``   smallest ``|w|`` per matrix (or per group of ``m``); no calibration
``"wanda"``       Wanda (Sun et al. 2023): ``|w| * ||x||`` per output row; weights unchanged
``"sparsegpt"``   SparseGPT (Frantar & Alistarh 2023): OBS selection with lazy blocked
                  updates, dampening ``damp``, columns in blocks of ``block_size``
``"prunekit"``    the default (see :data:`PRUNEKIT_DEFAULTS`): each layer's target is the
                  DENSE model's layer output, fitted from the pruned model's inputs
                  (the error of earlier pruned layers is corrected; ridge toward the
                  dense weights keeps it from over-fitting the calibration set);
                  the layers of a block are solved in execution order (q/k/v, then
                  the attention output, then the FFN), each from activations of the
                  block with the earlier ones already pruned; SparseGPT's selection
                  and update on the corrected weights, then the kept weights refit by
                  masked least squares
``"prunekit-fast"`` the same without the dense-model stream (no error correction):
                  SparseGPT's quality at about SparseGPT's cost
"""

from __future__ import annotations

import copy
import logging
import math
import numbers
import re
import time
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from .. import reparam
from ..reparam._internal import Snapshot
from ..importance import ActivationStats
from ..methods import custom_from_mask
from .blocks import BlockInput, block_output, capture_block_inputs, find_blocks, on_device, pre_hooks, run_block
from .layers import Patterns, Target, find_targets
from .report import LayerResult, OneshotReport
from .solvers import (
    NM,
    magnitude_prune,
    reconstruction_error,
    refit_masked,
    sparsegpt_prune,
    wanda_prune,
)

__all__ = ["oneshot", "METHODS", "PRUNEKIT_DEFAULTS", "parse_pattern"]

logger = logging.getLogger(__name__)

METHODS = ("magnitude", "wanda", "sparsegpt", "prunekit", "prunekit-fast")

#: the options of ``method="prunekit"`` (override any of them with ``options={...}``)
PRUNEKIT_DEFAULTS: Dict[str, Any] = {
    "correct_error": True,   # fit the DENSE model's layer outputs from the pruned model's inputs
    "correct_damp": 0.3,     # ridge toward the dense weights in that fit (x the mean diagonal of X^T X)
    "sequential": True,      # solve a block's layers in execution order (q/k/v, then out, then FFN)
    "refit_iters": 40,       # conjugate-gradient steps of the least-squares refit with the mask fixed
    "rounds": 0,             # mask re-selection rounds: OBS saliency of the refit weights, then refit again
    "damp": 0.01,
    "block_size": 128,
    "tune_epochs": 0,        # passes of Adam over the calibration batches fitting the block's output to the dense block's
    "tune_lr": 1e-4,
}
_FAST = dict(PRUNEKIT_DEFAULTS, correct_error=False, refit_iters=10)
_FAITHFUL = {"damp": 0.01, "block_size": 128}


def parse_pattern(pattern: str) -> NM:
    """``"unstructured"`` -> ``None``; ``"N:M"`` -> ``(N, M)`` (keep at most N of every M).

    Examples:
        >>> parse_pattern("2:4"), parse_pattern("unstructured")
        ((2, 4), None)
    """
    if not isinstance(pattern, str):
        raise TypeError(f"pattern must be a string ('unstructured' or 'N:M'), got {type(pattern).__name__}")
    if pattern.strip().lower() in ("unstructured", "1x1"):
        return None
    m = re.fullmatch(r"\s*(\d+)\s*:\s*(\d+)\s*", pattern)
    if not m or not 0 < int(m.group(1)) < int(m.group(2)):
        raise ValueError(f"pattern={pattern!r} is not 'unstructured' or 'N:M' with 0 < N < M (e.g. '2:4')")
    return int(m.group(1)), int(m.group(2))


def _check_sparsity(sparsity: Any, nm: NM) -> float:
    if isinstance(sparsity, bool) or not isinstance(sparsity, numbers.Real):
        raise TypeError(f"sparsity must be a float in [0, 1), got {type(sparsity).__name__} {sparsity!r}")
    s = float(sparsity)
    if nm is not None:
        return 1.0 - nm[0] / nm[1]
    if not 0.0 <= s < 1.0 or math.isnan(s):
        raise ValueError(f"sparsity must be in [0, 1) (the fraction of each layer's weights to prune), got {sparsity}")
    return s


def _prepare_calibration(calibration: Any, tokenizer: Any, batch_size: int, max_length: int) -> List[Any]:
    if isinstance(calibration, (str, bytes)):
        raise TypeError("calibration must be an iterable of batches or a list of strings, not one string")
    items = list(calibration)
    if items and all(isinstance(x, str) for x in items):
        if tokenizer is None:
            raise ValueError("calibration is a list of strings: pass tokenizer=... (e.g. AutoTokenizer.from_pretrained(path))")
        # batches of similar lengths: little padding to compute (padding is left out of the statistics anyway)
        lengths = [len(ids) for ids in tokenizer(items, truncation=True, max_length=max_length)["input_ids"]]
        order = sorted(range(len(items)), key=lambda i: (lengths[i], i))
        items = [items[i] for i in order]
        return [dict(tokenizer(items[i:i + batch_size], padding=True, truncation=True, max_length=max_length,
                               return_tensors="pt"))
                for i in range(0, len(items), batch_size)]
    for i, b in enumerate(items):
        if not isinstance(b, (dict, tuple, list, Tensor)):
            raise TypeError(f"calibration[{i}] is a {type(b).__name__}; a batch is a dict (model(**batch)), a tuple "
                            "(model(*batch)) or a tensor (model(batch)); strings need tokenizer=...")
    return items


class _Stats:
    """Per-layer activation statistics, fed by forward pre-hooks while a block runs."""

    def __init__(self, targets: Sequence[Target], hessian: bool, device: Any) -> None:
        self.stats = {t.name: ActivationStats(t.in_features, hessian=hessian, device=device) for t in targets}
        self.token_mask: Optional[Tensor] = None
        self.hooks = [(t.module, self._hook(t.name)) for t in targets]  # installed with blocks.pre_hooks

    def _hook(self, name: str) -> Callable[..., None]:
        def hook(_m: nn.Module, args: Tuple[Any, ...]) -> None:
            x = args[0]
            mask = self.token_mask
            if mask is not None and tuple(x.shape[:-1]) != tuple(mask.shape):
                mask = None
            self.stats[name].add(x, mask)
        return hook

    def set_batch(self, _i: int, inp: BlockInput) -> None:
        self.token_mask = inp.token_mask


def _stages(block: nn.Module, targets: Sequence[Target], inp: BlockInput) -> List[List[Target]]:
    """Group a block's targets by the input they read, in execution order (q/k/v share one input)."""
    # the inputs themselves, not their id(): a tensor freed during the forward (o_proj's input)
    # may hand its address to the next one (the FFN's input), and an id would then merge two stages
    order: List[Tuple[Tensor, Target]] = []

    def hook_for(t: Target) -> Callable[..., None]:
        def hook(_m: nn.Module, args: Tuple[Any, ...]) -> None:
            order.append((args[0], t))
        return hook

    with pre_hooks([(t.module, hook_for(t)) for t in targets]), torch.no_grad():
        block(*inp.args, **inp.kwargs)
    stages: List[List[Target]] = []
    last: Optional[Tensor] = None
    done = set()
    for x, t in order:
        if t.name in done:
            continue
        done.add(t.name)
        if stages and last is x:
            stages[-1].append(t)
        else:
            last = x
            stages.append([t])
    missing = [t for t in targets if t.name not in done]
    if missing:
        stages.append(missing)  # never called on this batch: solved last, from no data
    return stages


class _StopBlock(Exception):
    pass


def _rows(x: Tensor, mask: Optional[Tensor]) -> Tensor:
    f = x.shape[-1]
    if mask is not None and tuple(x.shape[:-1]) == tuple(mask.shape):
        return x.reshape(-1, f)[mask.reshape(-1)]
    return x.reshape(-1, f)


def _write(t: Target, keep: Tensor, new: Optional[Tensor]) -> None:
    """Mask (and, when given, new weights into ``weight_orig``) through the reparameterization."""
    p = t.param
    mask = t.stored(keep).to(device=p.device, dtype=p.dtype)
    custom_from_mask(t.module, "weight", mask)
    if new is not None:
        with torch.no_grad():
            t.param.copy_(reparam.masked(t.stored(new).to(device=p.device, dtype=p.dtype), mask))


def _solve_prunekit(w_dense: Tensor, xtx: Tensor, cross: Optional[Tensor], sparsity: float, nm: NM,
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


def oneshot(
    model: nn.Module, calibration: Iterable[Any], *, sparsity: float = 0.5, pattern: str = "unstructured",
    method: str = "prunekit", targets: Patterns = None, ignore: Patterns = None, tokenizer: Any = None,
    blocks: Any = None, device: Any = None, batch_size: int = 16, max_length: int = 128,
    options: Optional[Dict[str, Any]] = None, progress: Optional[Callable[[int, int, str], None]] = None,
) -> OneshotReport:
    """Prune ``model``'s linear layers in one shot from ``calibration`` data, block by block.

    Args:
        calibration: batches -- a dict is called as ``model(**batch)``, a tuple as
            ``model(*batch)``, a tensor as ``model(batch)`` -- or a list of strings with
            ``tokenizer`` (batched by ``batch_size``, padded, cut at ``max_length``).
            Padding (a 2-D ``attention_mask``) is left out of the statistics.
        sparsity: fraction of each layer's weights to prune (ignored for ``"N:M"``).
        pattern: ``"unstructured"`` or ``"N:M"`` (at most N non-zeros in every M consecutive
            input weights, PyTorch's convention).
        method: one of :data:`METHODS` (see the module docstring).
        targets: regular expressions over qualified layer names (or layer class names) to prune
            (``ignore``: to leave out); by default every ``nn.Linear`` (and GPT-2 ``Conv1D``) in the blocks.
        blocks: override the block search (a class name or a list of module names).
        device: the working device; each block (and its activations) moves there for its turn
            and back (offloading). ``None``: where the model is.
        options: method options (``damp``, ``block_size``; for ``"prunekit"`` those of
            :data:`PRUNEKIT_DEFAULTS`).
        progress: called as ``progress(done, total, block_name)`` after each block.

    Returns a :class:`~prunekit.oneshot.OneshotReport`. On any error (``KeyboardInterrupt``
    included) the model is left exactly as it was.

    Examples:
        >>> import torch, prunekit
        >>> from torch import nn
        >>> _ = torch.manual_seed(0)
        >>> net = nn.Sequential(nn.Linear(8, 16), nn.ModuleList([nn.Sequential(nn.Linear(16, 16), nn.ReLU())
        ...                     for _ in range(2)]))
        >>> net.forward = lambda x: net[1][1](net[1][0](net[0](x)))
        >>> report = prunekit.oneshot(net, [torch.randn(32, 8)], sparsity=0.5, method="sparsegpt")
        >>> [r.name for r in report.layers], report.sparsity
        (['1.0.0', '1.1.0'], 0.5)
        >>> int((net[1][0][0].weight == 0).sum())
        128
    """
    nm = parse_pattern(pattern)
    sparsity = _check_sparsity(sparsity, nm)
    opts = _method_options(method, options, batch_size=batch_size, max_length=max_length)
    t_start = time.perf_counter()
    block_list, layers = _layers_to_prune(model, blocks, targets, ignore, nm, pattern)
    batches = [] if method == "magnitude" else _prepare_calibration(calibration, tokenizer, batch_size, max_length)
    if method != "magnitude" and not batches:
        raise ValueError(f"method={method!r} needs calibration data: got no batch")

    report = OneshotReport(method, pattern if nm is None else f"{nm[0]}:{nm[1]}", sparsity,
                           blocks=len(block_list), options=dict(opts))
    snapshots = {t.name: Snapshot(t.module) for t in layers}
    saved: Dict[str, Tensor] = {}
    modes = [(m, m.training) for m in model.modules()]
    config = getattr(model, "config", None)
    use_cache = getattr(config, "use_cache", None)

    def restore_modes() -> None:
        for m, training in modes:
            m.training = training
        if use_cache:
            config.use_cache = use_cache

    try:
        model.eval()
        if use_cache:
            config.use_cache = False
        if method == "magnitude":
            _prune_by_magnitude(layers, block_list, sparsity, nm, report, progress)
        else:
            _run_sequential(model, block_list, layers, batches, method, sparsity, nm, opts, device, report,
                            saved, progress)
        report.seconds = time.perf_counter() - t_start
        logger.info("%s", report)
        restore_modes()
        return report  # inside the try: an interrupt anywhere before the return rolls everything back
    except BaseException:
        restore_modes()
        with torch.no_grad():
            for t in layers:
                snapshots[t.name].restore()
                if t.name in saved:
                    t.param.copy_(saved[t.name].to(t.param.device))
        raise


def _method_options(method: str, options: Optional[Dict[str, Any]], **counts: Any) -> Dict[str, Any]:
    """The options ``method`` runs with: its defaults updated by ``options``; refuses an unknown method, an
    unknown option and ``counts`` (``batch_size``, ``max_length``) that are not positive ints."""
    if method not in METHODS:
        raise ValueError(f"method={method!r} is unknown; use one of {', '.join(METHODS)}")
    opts = dict(PRUNEKIT_DEFAULTS if method == "prunekit" else _FAST if method == "prunekit-fast" else _FAITHFUL)
    for k, v in (options or {}).items():
        if k not in opts:
            raise ValueError(f"options: {k!r} is not an option of method {method!r}; use some of {sorted(opts)}")
        opts[k] = v
    for k, v in counts.items():
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{k} must be a positive int, got {v!r}")
    return opts


def _layers_to_prune(model: nn.Module, blocks: Any, targets: Patterns, ignore: Patterns, nm: NM,
                     pattern: str) -> Tuple[List[Tuple[str, nn.Module]], List[Target]]:
    """The model's blocks and the layers in them to prune; refuses none, a pruned one, or one ``nm`` cannot cut."""
    block_list = find_blocks(model, blocks)
    layers = find_targets(block_list, targets, ignore)
    if not layers:
        raise ValueError(f"no layer to prune: no linear layer inside the {len(block_list)} blocks of "
                         f"{type(model).__name__} matches targets={targets!r} and not ignore={ignore!r}")
    for t in layers:
        if reparam.is_pruned(t.module):
            raise ValueError(f"layer {t.name!r} is already pruned (it has weight_orig/weight_mask); call "
                             "prunekit.remove(module, 'weight') first, or leave it out with ignore=")
        if nm is not None and t.in_features % nm[1]:
            raise ValueError(f"layer {t.name!r}: pattern {pattern!r} needs in_features divisible by {nm[1]}, got "
                             f"{t.in_features}; leave it out with ignore=")
    return block_list, layers


def _prune_by_magnitude(layers: List[Target], block_list: List[Tuple[str, nn.Module]], sparsity: float, nm: NM,
                        report: OneshotReport, progress: Optional[Callable[[int, int, str], None]]) -> None:
    """``method="magnitude"``: each layer's smallest weights, no calibration; ``progress`` after each block."""
    for t in layers:
        t0 = time.perf_counter()
        keep = magnitude_prune(t.matrix().detach(), sparsity, nm)
        _write(t, keep, None)
        report.layers.append(LayerResult(t.name, t.block, tuple(t.matrix().shape), int((~keep).sum()),
                                         keep.numel(), None, time.perf_counter() - t0))
        if progress is not None and (t is layers[-1] or layers[layers.index(t) + 1].block != t.block):
            progress(t.block + 1, len(block_list), block_list[t.block][0])


def _run_sequential(model: nn.Module, block_list: List[Tuple[str, nn.Module]], layers: List[Target],
                    batches: List[Any], method: str, sparsity: float, nm: NM, opts: Dict[str, Any], device: Any,
                    report: OneshotReport, saved: Dict[str, Tensor], progress: Any) -> None:
    inputs = capture_block_inputs(model, block_list[0][1], batches, device)
    report.samples = sum(int(i.hidden.shape[0]) for i in inputs)
    report.tokens = sum(int(i.token_mask.sum()) if i.token_mask is not None else int(i.hidden[..., 0].numel())
                        for i in inputs)
    paired = method.startswith("prunekit") and opts["correct_error"]
    dense_inputs = inputs if paired else None
    by_block: Dict[int, List[Target]] = {}
    for t in layers:
        by_block.setdefault(t.block, []).append(t)
    for bi, (bname, block) in enumerate(block_list):
        mine = by_block.get(bi, [])
        with on_device(block, device):
            dense_block = copy.deepcopy(block) if (paired and mine) else None
            if mine:
                for t in mine:
                    saved[t.name] = t.param.detach().to("cpu", copy=True)
                if method.startswith("prunekit"):
                    _prune_block_sequential(block, dense_block, mine, inputs, dense_inputs, sparsity, nm, opts, report)
                else:
                    _prune_block_faithful(block, mine, inputs, method, sparsity, nm, opts, report)
            if paired:
                dense_next = run_block(dense_block if dense_block is not None else block, dense_inputs)
                if mine and opts.get("tune_epochs"):
                    _tune_block(block, mine, inputs, dense_next, opts["tune_epochs"], opts["tune_lr"])
            outputs = run_block(block, inputs)
            if paired:
                dense_inputs = dense_next
            del dense_block
        inputs = outputs
        if progress is not None:
            progress(bi + 1, len(block_list), bname)


def _result(t: Target, keep: Tensor, new: Tensor, dense: Tensor, xtx: Optional[Tensor], seconds: float) -> LayerResult:
    return LayerResult(t.name, t.block, tuple(dense.shape), int((~keep).sum()), keep.numel(),
                       None if xtx is None else reconstruction_error(new, dense, xtx), seconds)


def _prune_block_faithful(block: nn.Module, mine: List[Target], inputs: List[BlockInput], method: str,
                          sparsity: float, nm: NM, opts: Dict[str, Any], report: OneshotReport) -> None:
    """Wanda / SparseGPT as published: every layer's statistics from one pass of the block."""
    dev = mine[0].param.device
    hooks = _Stats(mine, hessian=method == "sparsegpt", device=dev)
    with pre_hooks(hooks.hooks):
        run_block(block, inputs, each=hooks.set_batch)
    for t in mine:
        t0 = time.perf_counter()
        st = hooks.stats[t.name]
        dense = t.matrix().detach().float()
        if method == "wanda":
            keep = wanda_prune(dense, st.norm, sparsity, nm)
            new = dense * keep
            _write(t, keep, None)
        else:
            new, keep = sparsegpt_prune(dense, st.xtx, sparsity, nm, block_size=opts["block_size"], damp=opts["damp"])
            _write(t, keep, new)
        report.layers.append(_result(t, keep, new, dense, st.xtx if st.has_hessian else None,
                                     time.perf_counter() - t0))


def _capture_many(block: nn.Module, modules: Sequence[nn.Module], inp: BlockInput, stop: bool) -> List[Tensor]:
    """Run ``block`` on ``inp`` and return the input each of ``modules`` received (stopping after the last
    of them when ``stop``)."""
    got: Dict[int, Tensor] = {}
    want = {id(m) for m in modules}

    def hook(m: nn.Module, args: Tuple[Any, ...]) -> None:
        got.setdefault(id(m), args[0])
        if stop and len(got) == len(want):
            raise _StopBlock

    with pre_hooks([(m, hook) for m in modules]), torch.no_grad():
        try:
            block(*inp.args, **inp.kwargs)
        except _StopBlock:
            pass
    missing = [type(m).__name__ for m in modules if id(m) not in got]
    if missing:
        raise ValueError(f"the block never called {missing} on a calibration batch")
    return [got[id(m)] for m in modules]


def _prune_block_sequential(block: nn.Module, dense_block: Optional[nn.Module], mine: List[Target],
                            inputs: List[BlockInput], dense_inputs: Optional[List[BlockInput]], sparsity: float,
                            nm: NM, opts: Dict[str, Any], report: OneshotReport) -> None:
    """prunekit's method on one block: dense-model targets, SparseGPT selection, masked least-squares refit.

    With ``sequential`` the groups of layers that share an input (q/k/v; out; FFN in; FFN out) are solved
    in execution order, each from activations of the block with the earlier groups already pruned;
    without it every group is solved from one pass (as SparseGPT does).
    """
    groups = _stages(block, mine, inputs[0])
    dense_mods = dict(dense_block.named_modules()) if dense_block is not None else {}
    block_names = {id(m): n for n, m in block.named_modules()}
    dev = mine[0].param.device
    rounds = [[g] for g in groups] if opts["sequential"] else [groups]
    for batch_groups in rounds:
        leads = [g[0].module for g in batch_groups]
        dense_leads = [dense_mods[block_names[id(m)]] for m in leads] if dense_block is not None else []
        xtx = [torch.zeros(g[0].in_features, g[0].in_features, device=dev) for g in batch_groups]
        cross = [torch.zeros_like(h) for h in xtx] if dense_block is not None else None
        for i, inp in enumerate(inputs):
            xps = _capture_many(block, leads, inp, stop=True)
            xds = _capture_many(dense_block, dense_leads, dense_inputs[i], stop=True) if dense_block is not None else None
            for j, xp in enumerate(xps):
                xp = _rows(xp.float(), inp.token_mask)
                xtx[j].addmm_(xp.t(), xp)
                if cross is not None:
                    cross[j].addmm_(xp.t(), _rows(xds[j].float(), inp.token_mask))
        for j, group in enumerate(batch_groups):
            for t in group:
                t0 = time.perf_counter()
                dense = t.matrix().detach().float()
                new, keep, target = _solve_prunekit(dense, xtx[j], None if cross is None else cross[j], sparsity,
                                                    nm, opts)
                _write(t, keep, new)
                report.layers.append(_result(t, keep, new, target, xtx[j], time.perf_counter() - t0))


def _tune_block(block: nn.Module, mine: List[Target], inputs: List[BlockInput], targets: List[BlockInput],
                epochs: int, lr: float) -> None:
    """A few epochs of Adam on the kept weights (and biases) of ``mine``: the block's output on the pruned
    model's inputs fitted to the dense block's output on the dense model's inputs (padding left out)."""
    params = [t.param for t in mine] + [t.module.bias for t in mine if getattr(t.module, "bias", None) is not None]
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
                reparam.masked(t.param, reparam.get_mask(t.module, "weight"), inplace=True)
