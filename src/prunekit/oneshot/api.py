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

import logging
import math
import numbers
import re
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

from torch import Tensor, nn

from .. import reparam
from ..reparam._internal import after_restore
from ..transaction import Transaction, run_then_clean
from .blocks import find_blocks
from .layers import Patterns, Target, find_targets, left_dense
from .parallel import parallel_for
from .report import OneshotReport
from .solvers import NM
from .undo import OriginalsSpool
from .walk import BlockCycle, Walk, walk_blocks

__all__ = ["oneshot", "METHODS", "MASKS", "PRUNEKIT_DEFAULTS", "parse_pattern"]

logger = logging.getLogger(__name__)

METHODS = ("magnitude", "wanda", "sparsegpt", "prunekit", "prunekit-fast")
#: what ``oneshot`` leaves in the model: the masks (``weight_orig``/``weight_mask``) or plain weights with zeros
MASKS = ("keep", "bake")

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


def oneshot(
    model: nn.Module, calibration: Iterable[Any], *, sparsity: float = 0.5, pattern: str = "unstructured",
    method: str = "prunekit", targets: Patterns = None, ignore: Patterns = None, tokenizer: Any = None,
    blocks: Any = None, device: Any = None, batch_size: int = 16, max_length: int = 128,
    options: Optional[Dict[str, Any]] = None, progress: Optional[Callable[[int, int, str], None]] = None,
    masks: str = "keep", scratch_dir: Any = None, group: Any = None, routers: bool = False,
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
            (``ignore``: to leave out); by default every ``nn.Linear`` (and GPT-2 ``Conv1D``) in the blocks,
            and every expert of a mixture-of-experts module with 3-D parameters (``transformers`` 5):
            each expert's slice, named ``<experts module>.<parameter>.<expert>`` (e.g.
            ``model.layers.0.mlp.experts.gate_up_proj.3``), is a layer of its own, its statistics
            from the calibration tokens routed to that expert only (a slice no token reached is
            pruned by magnitude).
        blocks: override the block search (a class name or a list of module names). An
            encoder-decoder model's default is both stacks: the encoder's blocks, then the decoder's
            (fed with the pruned encoder's output).
        device: the working device; each block (and its activations) moves there for its turn
            and back (offloading). ``None``: where the model is.
        options: method options (``damp``, ``block_size``; for ``"prunekit"`` those of
            :data:`PRUNEKIT_DEFAULTS`).
        progress: called as ``progress(done, total, block_name)`` after each block.
        masks: ``"keep"`` (the default): each pruned layer keeps its mask through the
            reparameterization (``weight_orig``/``weight_mask``; ``prunekit.remove`` makes it
            permanent). ``"bake"``: each block's pruned weights are written into its plain
            parameters as the block finishes -- the model stays a plain model, with zeros, in its
            own dtypes, and no mask outlives its block (the lean form for large models).
        scratch_dir: where the originals of the layers whose values change are kept (scratch
            files without a name, freed when the call ends) until the call succeeds: every
            layer with ``"bake"``, the weight-updating methods with ``"keep"``. Default: the
            system's temporary folder.
        group: a ``torch.distributed`` process group (``True``: the default group) to share the
            work with: every rank calls ``oneshot`` with the same model and the same calibration;
            each runs its share of the batches, statistics are summed on one rank per input and
            each layer is solved on one rank, then sent to all (:mod:`prunekit.oneshot.parallel`).
            The masks and weights are those of one process.
        routers: also prune the mixture-of-experts routers (and gates of shared experts); by default
            they are left dense, and the report's ``dense`` lists them.

    Returns a :class:`~prunekit.oneshot.OneshotReport`. On any error (``KeyboardInterrupt``
    included) the model is left exactly as it was: the block in flight and every finished block
    are restored (from the scratch files), masks and all.

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
        >>> lean = nn.Sequential(nn.Linear(8, 16), nn.ModuleList([nn.Linear(16, 16)]).bfloat16())
        >>> lean.forward = lambda x: lean[1][0](lean[0](x).bfloat16())
        >>> _ = prunekit.oneshot(lean, [torch.randn(32, 8)], method="sparsegpt", masks="bake")
        >>> prunekit.is_pruned(lean), lean[1][0].weight.dtype, int((lean[1][0].weight == 0).sum())
        (False, torch.bfloat16, 128)
    """
    if masks not in MASKS:
        raise ValueError(f"masks={masks!r}: write 'keep' (weight_orig/weight_mask) or 'bake' (plain weights with zeros)")
    t_start = time.perf_counter()
    plan = plan_walk(model, calibration, sparsity=sparsity, pattern=pattern, method=method, targets=targets,
                     ignore=ignore, tokenizer=tokenizer, blocks=blocks, device=device, batch_size=batch_size,
                     max_length=max_length, options=options, progress=progress, group=group, routers=routers)
    walk = plan.walk
    # on success the spool's scratch files close as it is dropped, on the return (see OriginalsSpool)
    spool = OriginalsSpool(scratch_dir) if (masks == "bake" or method not in ("magnitude", "wanda")) else None
    txn = Transaction(after_restore)
    walk.cycle = InMemoryCycle(txn, spool, masks == "bake")
    # bake straight into the parameters; block tuning trains through the masks, baked as the block leaves
    walk.bake = masks == "bake" and not walk.opts.get("tune_epochs")
    try:
        run_walk(model, plan.blocks, plan.layers, plan.batches, walk)
        walk.report.seconds = time.perf_counter() - t_start
        logger.info("%s", walk.report)
        return walk.report  # inside the try: an interrupt anywhere before the return rolls everything back
    except BaseException:
        txn.rollback()
        if spool is not None:
            spool.close()
        raise


@dataclass
class Plan:
    """A checked call: the walk's settings, the blocks, the layers to prune and the calibration batches."""

    walk: Walk
    blocks: List[Tuple[str, nn.Module]]
    layers: List[Target]
    batches: List[Any]


def plan_walk(model: nn.Module, calibration: Iterable[Any], *, sparsity: float, pattern: str, method: str,
              targets: Patterns, ignore: Patterns, tokenizer: Any, blocks: Any, device: Any, batch_size: int,
              max_length: int, options: Optional[Dict[str, Any]], progress: Any, group: Any,
              routers: bool = False) -> Plan:
    """Check the arguments of :func:`oneshot` (every refusal before anything changes) and plan its walk
    (with a :class:`BlockCycle` that does nothing: the caller sets its own)."""
    nm = parse_pattern(pattern)
    sparsity = _check_sparsity(sparsity, nm)
    opts = _method_options(method, options, batch_size=batch_size, max_length=max_length)
    par = parallel_for(group)
    if par.world > 1 and opts.get("tune_epochs"):
        raise ValueError("options tune_epochs > 0 cannot run with group=...: the ranks' gradients would be summed in "
                         "another order than one process sums them; tune in one process, or set tune_epochs=0")
    block_list, layers = _layers_to_prune(model, blocks, targets, ignore, nm, pattern, routers)
    batches = [] if method == "magnitude" else _prepare_calibration(calibration, tokenizer, batch_size, max_length)
    if method != "magnitude" and not batches:
        raise ValueError(f"method={method!r} needs calibration data: got no batch")
    if method != "magnitude" and len(batches) < par.world:
        raise ValueError(f"{len(batches)} calibration batches for {par.world} ranks: every rank needs at least one "
                         "(use a smaller batch_size or more samples)")
    report = OneshotReport(method, pattern if nm is None else f"{nm[0]}:{nm[1]}", sparsity,
                           blocks=len(block_list), options=dict(opts), dense=left_dense(block_list, layers))
    walk = Walk(method, sparsity, nm, opts, device, report, par, BlockCycle(), len(batches), progress)
    return Plan(walk, block_list, layers, batches)


class InMemoryCycle(BlockCycle):
    """A block of a model held in memory: recorded for the rollback as it enters (its modules' structure,
    and its weights' values into the scratch files when they will change), baked as it leaves (``bake``)."""

    def __init__(self, txn: Transaction, spool: Optional[OriginalsSpool], bake: bool) -> None:
        self.txn, self.spool, self.bake = txn, spool, bake

    def enter(self, index: int, name: str, block: nn.Module, mine: List[Target]) -> None:
        for t in mine:
            self.txn.module(t.module)
        if self.spool is not None and mine:
            # one entry per parameter: the experts' slices of a 3-D parameter share it
            self.txn.add(self.spool.keep({t.key: t.param for t in mine}))

    def leave(self, index: int, name: str, block: nn.Module, mine: List[Target]) -> None:
        if self.bake:
            for t in mine:
                if reparam.is_masked(t.module, t.tensor):
                    reparam.remove(t.module, t.tensor)


def run_walk(model: nn.Module, block_list: List[Tuple[str, nn.Module]], layers: List[Target], batches: List[Any],
             walk: Walk) -> None:
    """:func:`~prunekit.oneshot.walk.walk_blocks` with the model in eval mode and without a KV cache (``use_cache``
    off in every config the model and its submodules hold, an encoder-decoder's decoder copy included); both
    are put back however the walk ends."""
    modes = [(m, m.training) for m in model.modules()]
    caching = [c for c in _configs(model) if getattr(c, "use_cache", None)]

    def body() -> None:
        model.eval()
        for c in caching:
            c.use_cache = False
        walk_blocks(model, block_list, layers, batches, walk)

    def cleanup() -> None:
        for m, training in modes:
            m.training = training
        for c in caching:
            c.use_cache = True

    run_then_clean(body, cleanup)


def _configs(model: nn.Module) -> List[Any]:
    """Every configuration object of ``model``: the ``config`` of each module and the configs nested in them
    (``text_config``, ``decoder``, ...), each once."""
    out: Dict[int, Any] = {}
    todo = [getattr(m, "config", None) for m in model.modules()]
    while todo:
        c = todo.pop()
        if c is None or id(c) in out or not hasattr(c, "to_dict") or isinstance(c, (dict, nn.Module)):
            continue
        out[id(c)] = c
        todo.extend(v for v in vars(c).values() if hasattr(v, "to_dict") and hasattr(v, "use_cache"))
    return list(out.values())


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
                     pattern: str, routers: bool = False) -> Tuple[List[Tuple[str, nn.Module]], List[Target]]:
    """The model's blocks and the layers in them to prune; refuses none, a pruned one, or one ``nm`` cannot cut."""
    block_list = find_blocks(model, blocks)
    layers = find_targets(block_list, targets, ignore, routers=routers)
    if not layers:
        raise ValueError(f"no layer to prune: no linear layer inside the {len(block_list)} blocks of "
                         f"{type(model).__name__} matches targets={targets!r} and not ignore={ignore!r}")
    for t in layers:
        if reparam.is_pruned(t.module):
            raise ValueError(f"layer {t.name!r} is already pruned (it has {t.tensor}_orig/{t.tensor}_mask); call "
                             f"prunekit.remove(module, {t.tensor!r}) first, or leave it out with ignore=")
        if nm is not None and t.in_features % nm[1]:
            raise ValueError(f"layer {t.name!r}: pattern {pattern!r} needs in_features divisible by {nm[1]}, got "
                             f"{t.in_features}; leave it out with ignore=")
    return block_list, layers
