"""``prunekit.shrink``: a Hugging Face model made smaller and dense, to a size target, from calibration data.

The steps (NVIDIA's Minitron recipe, without the training):

1. measure importance on the calibration batches: hidden channels, heads and FFN neurons by their
   activations (:mod:`~prunekit.shrink.width`), blocks by their influence on the residual stream
   or by the loss without them (:mod:`~prunekit.shrink.depth`), routed experts by their routed
   output (:mod:`~prunekit.shrink.experts`);
2. list the candidate mixes of sizes that meet the target (:mod:`~prunekit.shrink.search`) and
   score each on the calibration objective with the model *running as if* it had that size
   (forward hooks: nothing is copied or changed);
3. remove the best candidate's units and blocks for real, update the config, and check that the
   smaller model computes what its emulation computed.

The model is changed in place; all or nothing (on any failure, ``KeyboardInterrupt`` included,
it is left exactly as it was). Keep the dense model (load it again) to distill from it:
:func:`prunekit.shrink.distill`.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor, nn

from ..compact.hf_config import FAMILIES as CONFIG_FAMILIES
from ..compact.surgery.journal import Journal
from ..errors import first_line
from ..transaction import Transaction, atomic
from . import depth, experts
from .calibration import Objective, as_batches, forward, output_vectors, scoring_split
from .families import family_of
from .refit import ReaderFit, refit_readers
from .search import Candidate, Target, grid_candidates
from .sizes import EXPERT_FFN, EXPERTS, LAYERS, SizeModel
from .width import FFN, HEADS, HIDDEN, Width

logger = logging.getLogger(__name__)

__all__ = ["ShrinkReport", "shrink"]


@dataclass
class ShrinkReport:
    """What :func:`shrink` did: the candidates it scored, the one it chose, and the model after."""

    model_type: str
    target: Target
    objective: str  # "loss" (next-token cross-entropy) or "cosine" (1 - cosine to the dense outputs)
    dense: Candidate  # the full sizes, with the dense model's score
    chosen: Candidate
    candidates: List[Candidate] = field(default_factory=list)  # every candidate scored, best first
    removed_layers: List[int] = field(default_factory=list)
    params: int = 0  # parameters of the shrunk model
    score: float = math.nan  # the objective measured on the shrunk model
    seconds: float = 0.0
    fits: List[ReaderFit] = field(default_factory=list)  # the readers refitted after the units went

    def __repr__(self) -> str:
        changed = ", ".join(f"{k} {self.dense.sizes[k]}->{v}" for k, v in sorted(self.chosen.sizes.items())
                            if v != self.dense.sizes.get(k))
        return (f"ShrinkReport({self.model_type}: {self.dense.params:,} -> {self.params:,} params "
                f"({self.params / max(self.dense.params, 1):.1%}); {changed or 'nothing removed'}; "
                f"{'1 - cosine' if self.objective == 'cosine' else 'loss'} {self.dense.score:.4g} -> {self.score:.4g}; {len(self.candidates)} candidates, {self.seconds:.1f} s)")


#: routed experts run through grouped matrix products, whose rows must be multiples of 16 bytes
MOE_ALIGN = 8


def _steps(units: Dict[str, int], round_to: Optional[int]) -> Dict[str, int]:
    """Multiples the hidden and FFN sizes are rounded to (by default 64 from 4096 units, 8 from 128;
    with routed experts, the hidden size and the experts' width are multiples of 8 in any case)."""
    out = {}
    moe = EXPERTS in units
    for axis in (HIDDEN, FFN, EXPERT_FFN):
        n = units.get(axis)
        if n is not None:
            step = round_to if round_to is not None else 64 if n >= 4096 else 8 if n >= 128 else 1
            if moe and axis in (HIDDEN, EXPERT_FFN):
                step = step * MOE_ALIGN // math.gcd(step, MOE_ALIGN)
            out[axis] = min(step, n)
    return out


def _axes(width: Width, sizes: SizeModel, model_type: str, axes: Optional[Sequence[str]]) -> Tuple[List[str], Any]:
    """The axes searched, and the rule deriving sizes that follow others (heads from the hidden size)."""
    known = [a for a in (HIDDEN, HEADS, FFN) if a in width.axes] + [LAYERS]
    if EXPERTS in sizes.units:
        known.append(EXPERTS)
    if axes is not None and (isinstance(axes, str) or not isinstance(axes, (list, tuple, set, frozenset))):
        raise TypeError(f"prunekit.shrink: axes must be a list of axis names, got {type(axes).__name__} {axes!r}; "
                        f"write e.g. axes={[axes] if isinstance(axes, str) else known!r}")
    chosen = list(known) if axes is None else list(axes)
    if not chosen:
        raise ValueError(f"prunekit.shrink: axes is empty; name at least one of {known}, or leave axes out for all")
    bad = [a for a in chosen if a not in known + [EXPERT_FFN] or a not in sizes.units]
    if bad:
        extra = sorted(set(width.axes) - set(known))
        raise ValueError(f"prunekit.shrink: {type(width.model).__name__} has no axis {bad[0]!r} that shrink can write to "
                         f"its config; its axes are {known}" + (f" ({extra} cannot be set in its config)" if extra else ""))
    family = CONFIG_FAMILIES.get(model_type)
    tied = family is not None and family.head_dim_key is None and HEADS in width.axes
    link = None
    if tied and HEADS in chosen:
        if HIDDEN not in chosen and axes is None:  # by default: the heads stay with the hidden size
            chosen.remove(HEADS)
        elif HIDDEN not in chosen:
            raise ValueError(f"prunekit.shrink: {model_type}'s config derives the head size from the hidden size, so its "
                             "heads can only be pruned with the hidden size (heads x head size = hidden size); add "
                             "'hidden' to axes or leave 'heads' out")
        else:
            chosen.remove(HEADS)
    if tied and HIDDEN in chosen:
        head = width.axes[HEADS].unit_width
        hidden_unit = width.axes[HIDDEN].unit_width

        def link(s: Dict[str, int]) -> Dict[str, int]:
            return dict(s, **{HEADS: max(1, s[HIDDEN] * hidden_unit // head)})
    return chosen, link


def _dense_objective(model: nn.Module, batches: List[Any], scored: List[Any]) -> Tuple[Objective, float]:
    """The objective on the batches ``scored`` and the dense model's score there. Every batch runs once
    first, so a batch the model does not take is a ``ValueError`` that says so (quoting its own error)."""
    try:
        for batch in batches:
            forward(model, batch)
        objective = Objective(model, scored)
        return objective, objective(model)
    except Exception as e:  # the model raises whatever its forward raises on inputs it does not take
        raise ValueError(f"prunekit.shrink: the calibration does not run on {type(model).__name__} "
                         f"({first_line(e, with_type=True)}); give batches of the inputs it takes, e.g. dicts of "
                         "input_ids and attention_mask from its tokenizer (pixel_values for a vision model)") from e


class _Plan:
    """Everything measured on the dense model that candidates are scored and applied with."""

    def __init__(self, model: nn.Module, batches: List[Any], depth_importance: str, importance: str,
                 refit: bool) -> None:
        self.model, self.batches = model, batches
        # refitted candidates are scored on batches their refit did not see (calibration.scoring_split)
        self.fit_batches, scored = scoring_split(batches) if refit else (batches, batches)
        self.objective, self.dense_score = _dense_objective(model, batches, scored)
        self.width = Width(model, batches[0])
        self.width.score(batches, importance)
        self.sizes = SizeModel(model, self.width)
        if depth_importance == "influence":
            ranks = depth.block_influence(model, batches)
        elif depth_importance == "loss":
            ranks = depth.layer_loss_importance(model, batches)
        else:
            raise ValueError(f"prunekit.shrink: depth_importance must be 'influence' or 'loss', got {depth_importance!r}")
        self.block_order = torch.argsort(ranks.double(), stable=True).tolist()  # least important first
        self.expert_scores = experts.expert_importance(model, batches) if EXPERTS in self.sizes.units else {}
        self._expert_ffn: Optional[Dict[int, Tensor]] = None
        self._active: Any = None  # [the installed emulation, its sizes] while one runs

    def expert_ffn_keep(self, sizes: Dict[str, int]) -> Optional[Dict[int, Tensor]]:
        """Per MoE layer, each expert's most important ``sizes["expert_ffn"]`` neurons (None: all stay).

        The importance is measured on first use; the search scores candidates before anything
        changes, so that is on the dense model."""
        n = sizes.get(EXPERT_FFN, self.sizes.units.get(EXPERT_FFN))
        if n is None or n == self.sizes.units[EXPERT_FFN]:
            return None
        if self._expert_ffn is None:
            self._expert_ffn = experts.expert_ffn_importance(self.model, self.batches)
        return experts.keep_top(self._expert_ffn, n)

    def removed_blocks(self, sizes: Dict[str, int]) -> List[int]:
        n = self.sizes.n_blocks
        return sorted(self.block_order[: n - sizes.get(LAYERS, n)])

    def _emulate(self, sizes: Dict[str, int]) -> contextlib.ExitStack:
        """Every emulation hook of the candidate ``sizes`` installed; closing the stack removes them."""
        ffn_keep = self.expert_ffn_keep(sizes)  # before any emulation starts
        with contextlib.ExitStack() as stack:
            if ffn_keep is not None:
                stack.enter_context(experts.narrowed_expert_ffn(self.model, ffn_keep))
            stack.enter_context(self.width.emulated({a: n for a, n in sizes.items() if a in self.width.axes}))
            if EXPERTS in sizes and sizes[EXPERTS] != self.sizes.units[EXPERTS]:
                stack.enter_context(experts.dropped_experts(self.model, experts.keep_top(self.expert_scores, sizes[EXPERTS])))
            removed = self.removed_blocks(sizes)
            if removed:
                stack.enter_context(depth.skipped_layers(self.model, removed))
            return stack.pop_all()

    @contextlib.contextmanager
    def emulated(self, sizes: Dict[str, int]):
        """Within the block the model computes at ``sizes`` (hooks only; nothing changes)."""
        self._active = [self._emulate(sizes), sizes]
        try:
            yield
        finally:
            active, self._active = self._active, None
            active[0].close()

    @contextlib.contextmanager
    def dense(self):
        """Within :meth:`emulated`: the model computes as the dense model, then emulates again on exit."""
        self._active[0].close()
        try:
            yield
        finally:
            self._active[0] = self._emulate(self._active[1])

    def score(self, candidate: Candidate, refit: bool) -> float:
        """The objective with the model running at the candidate's sizes (and refitted, then put back)."""
        with self.emulated(candidate.sizes):
            if not refit:
                return self.objective(self.model)
            txn = Transaction()
            try:
                refit_readers(self.width, candidate.sizes, self.fit_batches, txn,
                              skipped=self.removed_blocks(candidate.sizes), dense=self.dense)
                return self.objective(self.model)
            finally:
                txn.rollback()

    def apply(self, sizes: Dict[str, int], journal: Journal) -> None:
        width_keep = {a: n for a, n in sizes.items() if a in self.width.axes}
        if any(n != self.width.axes[a].units for a, n in width_keep.items()):
            self.width.apply(width_keep, journal)
        ffn_keep = self.expert_ffn_keep(sizes)  # indexed by the experts before any is removed
        if ffn_keep is not None:
            experts.shrink_expert_ffn(self.model, ffn_keep, journal=journal)
        if EXPERTS in sizes and sizes[EXPERTS] != self.sizes.units[EXPERTS]:
            experts.remove_experts(self.model, experts.keep_top(self.expert_scores, sizes[EXPERTS]), journal=journal)
        removed = self.removed_blocks(sizes)
        if removed:
            depth.remove_layers(self.model, removed, journal=journal)


def _check(model: nn.Module, batch: Any, expected: Tensor) -> None:
    """The shrunk model computes what its emulation computed (to the rounding of its dtype)."""
    got = output_vectors(forward(model, batch))
    err = float((got.float() - expected.float()).norm() / expected.float().norm().clamp_min(1e-30))
    tolerance = 1e-3 if expected.dtype in (torch.float32, torch.float64) else 3e-2  # half precision rounds more
    if got.shape != expected.shape or not err <= tolerance:
        raise ValueError(f"prunekit.shrink: the shrunk model computes {err:.3g} (relative) away from the emulation it "
                         "was chosen by; the model is left unchanged (please report this with the model's config)")


def shrink(
    model: nn.Module,
    calibration: Iterable[Any],
    target: Union[int, float] = 0.5,
    *,
    measure: str = "params",
    scope: str = "model",
    axes: Optional[Sequence[str]] = None,
    sizes: Optional[Dict[str, int]] = None,
    grid: Optional[Dict[str, Sequence[float]]] = None,
    round_to: Optional[int] = None,
    importance: str = "auto",
    depth_importance: str = "influence",
    max_candidates: int = 64,
    refit: bool = True,
) -> ShrinkReport:
    """Make a Hugging Face model smaller and dense, in place: the best mix of width and depth for ``target``.

    Args:
        model: a transformers model of a family in :data:`prunekit.shrink.FAMILIES`.
        calibration: batches the model accepts (dicts of ``input_ids``/``attention_mask``, or
            ``pixel_values`` ...); padding (``attention_mask == 0``) is left out of every statistic.
        target: a fraction in (0, 1) of the dense model's ``measure`` to keep, or an int count.
        measure: ``"params"`` or ``"macs"`` (per-token MACs of the matrix products).
        scope: ``"model"`` counts every parameter; ``"blocks"`` only the transformer blocks'
            (embeddings and heads left out of the target).
        axes: what may shrink, among ``"hidden"``, ``"heads"``, ``"ffn"``, ``"layers"``, ``"experts"``
            (default: all the model has).
        sizes: skip the search and shrink to these sizes (units kept per axis; ``"layers"``: blocks).
        grid: fractions of each axis's units the search tries (default
            :data:`~prunekit.shrink.search.FRACTIONS`).
        round_to: hidden and FFN sizes are multiples of it (default 64 from 4096 units, 8 from 128).
        importance: how heads and FFN neurons are ranked: ``"activation"`` (Minitron), ``"obs"`` (greedy
            structured OBS, ZipLM: better, slower), ``"auto"`` (OBS where it is cheap; see
            :meth:`~prunekit.shrink.width.Width.score`).
        depth_importance: ``"influence"`` (1 - cosine between a block's input and output) or
            ``"loss"`` (the objective with that block skipped).
        max_candidates: the most candidates scored (an even spread of the grid's when it has more).
        refit: refit the layers that read removed heads and neurons by least squares
            (:mod:`~prunekit.shrink.refit`) to the dense model's residual stream where their outputs
            join it; candidates are scored refitted too (their weights put back after), so the search
            compares the models it would return. The search refits on three of every four batches and
            scores on the fourth (:func:`~prunekit.shrink.calibration.scoring_split`): the refit
            cannot favour the candidate that merely fits the calibration best. The chosen model is
            refitted on every batch; every score in the report is on the scoring batches.

    The hidden size is approximate by design: a RMSNorm/LayerNorm over fewer channels is not
    the same function. Everything else (heads, FFN neurons, whole blocks, experts) removes exactly
    what its emulation removed. Raises ``ValueError`` for an unknown family, an axis the config
    cannot say, a target no candidate meets, or empty calibration -- the model unchanged.

    Examples:
        >>> import torch, transformers
        >>> cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
        ...                                num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2)
        >>> torch.manual_seed(0); model = transformers.LlamaForCausalLM(cfg).eval()
        <torch._C.Generator object at ...>
        >>> batches = [{"input_ids": torch.randint(0, 64, (2, 16))} for _ in range(2)]
        >>> report = shrink(model, batches, target=0.6, axes=["ffn", "layers"])
        >>> report.params <= 0.6 * report.dense.params, model.config.num_hidden_layers <= 4
        (True, True)
    """
    started = time.perf_counter()
    model_type, _ = family_of(model)
    batches = as_batches(calibration)
    if scope not in ("model", "blocks"):
        raise ValueError(f"prunekit.shrink: scope must be 'model' or 'blocks', got {scope!r}")
    if isinstance(max_candidates, bool) or not isinstance(max_candidates, int) or max_candidates < 1:
        raise ValueError(f"prunekit.shrink: max_candidates must be an int >= 1, got {max_candidates!r}")
    if round_to is not None and (isinstance(round_to, bool) or not isinstance(round_to, int) or round_to < 1):
        raise ValueError(f"prunekit.shrink: round_to must be an int >= 1 (or None for the default), got {round_to!r}")
    plan = _Plan(model, batches, depth_importance, importance, refit)
    sm, blocks_only = plan.sizes, scope == "blocks"
    count = sm.params if measure == "params" else sm.macs
    goal = Target.parse(target, measure, count({}, blocks_only=blocks_only))
    full = dict(sm.units)
    dense = Candidate(full, sm.params({}), sm.macs({}), plan.dense_score)
    found = _candidates(plan, model_type, goal, sizes, axes, grid, round_to, max_candidates, blocks_only)
    for c in found:
        c.sizes = dict(full, **c.sizes)
        c.score = plan.score(c, refit)
        logger.info("shrink: %r", c)
    found.sort(key=lambda c: (c.score, -c.params))
    best = found[0]
    removed = plan.removed_blocks(best.sizes)
    journal = Journal()
    with atomic(journal):
        fits: List[ReaderFit] = []
        with plan.emulated(best.sizes):
            if refit:
                fits = refit_readers(plan.width, best.sizes, batches, journal, skipped=removed, dense=plan.dense)
            expected = output_vectors(forward(model, batches[0]))
        plan.apply(best.sizes, journal)
        _check(model, batches[0], expected)
        report = ShrinkReport(model_type, goal, plan.objective.kind, dense, best, found, removed,
                              sum(p.numel() for p in {id(p): p for p in model.parameters()}.values()),
                              plan.objective(model), time.perf_counter() - started, fits)
        logger.info("shrink: %r", report)
        return report


def _candidates(plan: _Plan, model_type: str, goal: Target, sizes: Optional[Dict[str, int]],
                axes: Optional[Sequence[str]], grid: Optional[Dict[str, Sequence[float]]], round_to: Optional[int],
                max_candidates: int, blocks_only: bool) -> List[Candidate]:
    """The candidates to score: the grid's that meet ``goal`` (at most ``max_candidates``), or ``sizes``."""
    sm, measure = plan.sizes, goal.measure
    full = dict(sm.units)
    if sizes is not None:
        return [_explicit(sm, plan, sizes, full)]
    chosen_axes, link = _axes(plan.width, sm, model_type, axes)
    steps = _steps(full, round_to)
    if link is not None:  # the hidden size stays a whole number of heads
        head = plan.width.axes[HEADS].unit_width
        steps[HIDDEN] = steps.get(HIDDEN, 1) * head // math.gcd(steps.get(HIDDEN, 1), head)
    least = {EXPERTS: sm.top_k} if sm.top_k else {}  # a router picks top_k experts per token
    found = grid_candidates(sm, chosen_axes, goal, plan.block_order, grid=grid, steps=steps, link=link,
                            least=least, blocks_only=blocks_only)
    if not found:
        raise ValueError(f"prunekit.shrink: no mix of {chosen_axes} brings {model_type} to {goal.limit:,} {measure} "
                         f"(dense {goal.dense:,}); allow more axes, a finer grid, or a larger target")
    if len(found) > max_candidates:
        stride = len(found) / max_candidates
        found = [found[int(i * stride)] for i in range(max_candidates)]
    return found


def _explicit(sm: SizeModel, plan: _Plan, sizes: Dict[str, int], full: Dict[str, int]) -> Candidate:
    if not isinstance(sizes, dict):
        raise TypeError(f"prunekit.shrink: sizes must be a dict of axis -> units kept, got {type(sizes).__name__}")
    for axis, n in sizes.items():
        if axis not in full:
            raise ValueError(f"prunekit.shrink: sizes names {axis!r}, which this model does not have; its axes are "
                             f"{sorted(full)}")
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= full[axis]:
            raise ValueError(f"prunekit.shrink: sizes[{axis!r}]={n!r}; keep an int between 1 and {full[axis]}")
    if EXPERTS in full:
        odd = [a for a in (HIDDEN, EXPERT_FFN) if a in sizes and sizes[a] % MOE_ALIGN]
        if odd:
            raise ValueError(f"prunekit.shrink: sizes[{odd[0]!r}]={sizes[odd[0]]}: with routed experts it must be a "
                             f"multiple of {MOE_ALIGN} (grouped matrix products need rows of 16-byte multiples)")
    s = dict(full, **sizes)
    blocks = [b for b in range(sm.n_blocks) if b not in plan.removed_blocks(s)]
    return Candidate(s, sm.params(s, blocks), sm.macs(s, blocks))
