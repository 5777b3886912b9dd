"""The MoE expert axis: which routed experts and expert-FFN neurons matter, and removing the others.

* :func:`moe_layers` -- ``{layer index: sparse MoE block}`` (dense layers, e.g. Qwen-MoE's
  ``mlp_only_layers``, are left out);
* :func:`expert_importance` -- per layer and routed expert, its contribution on the calibration
  tokens (``score``) and its share of the router's assignments (``load``);
* :func:`expert_ffn_importance` -- per layer, expert and FFN neuron, the L2 norm of the neuron's
  activation over the tokens routed to the expert;
* :func:`keep_top` -- the indices of the largest scores, for ``keep``;
* :func:`dropped_experts` -- a context under which the model computes as if only the kept experts
  existed (for a search: nothing is copied);
* :func:`narrowed_expert_ffn` -- likewise, as if each expert had only its kept FFN neurons;
* :func:`remove_experts` / :func:`shrink_expert_ffn` -- the real removal, in place and
  failure-atomic; the config follows, so ``save_pretrained`` writes a model plain
  ``from_pretrained`` loads.

The layout read is that of transformers' fused experts (Mixtral, Qwen2-MoE, Qwen3-MoE):
``mlp.gate`` is the router, a bare ``weight`` [E, H] returning ``(logits, scores, indices)``;
``mlp.experts`` holds ``gate_up_proj`` [E, 2 I, H] (the gate rows ``0..I-1``, then the up rows
``I..2I-1``) and ``down_proj`` [E, H, I]. Qwen2-MoE's shared expert is an ordinary MLP that
every token passes through: it is not a routed expert and nothing here changes it.
"""

from __future__ import annotations

import contextlib
import logging
import math
from dataclasses import dataclass
from typing import Any, Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..transaction import Transaction, atomic, finish, run_then_clean
from .calibration import as_batches, forward, token_mask
from .families import FAMILIES, family_of, layer_list

logger = logging.getLogger(__name__)

__all__ = ["ExpertImportance", "dropped_experts", "expert_ffn_importance", "expert_importance", "keep_top",
           "moe_layers", "narrowed_expert_ffn", "remove_experts", "shrink_expert_ffn"]

Indices = Union[Tensor, Sequence[int]]
# A transformers sparse MoE block (its ``gate`` router and fused ``experts``) or one of its parts: classes
# differ per family, so they are read by attribute (``_fused`` checks the layout first)
MoEModule = Any


# ------------------------------------------------------------------ where the experts are
def _fused(mlp: nn.Module) -> bool:
    """Whether ``mlp`` is a sparse MoE block of the fused layout this module reads."""
    router, experts = getattr(mlp, "gate", None), getattr(mlp, "experts", None)
    weight = getattr(router, "weight", None)
    gate_up, down = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    if not (isinstance(weight, Tensor) and isinstance(gate_up, Tensor) and isinstance(down, Tensor)):
        return False
    layout = (getattr(experts, "has_gate", True), getattr(experts, "is_concatenated", True),
              not getattr(experts, "is_transposed", False), not getattr(experts, "has_bias", False))
    return (all(layout) and weight.dim() == 2 and gate_up.dim() == 3 and down.dim() == 3
            and weight.shape[0] == gate_up.shape[0] == down.shape[0] and gate_up.shape[1] == 2 * down.shape[2])


def moe_layers(model: nn.Module, what: str = "prunekit.shrink") -> Dict[int, MoEModule]:
    """``{layer index: sparse MoE block}`` of a mixture-of-experts model (its ``mlp`` with ``gate`` and ``experts``).

    A family without experts, a model with no MoE layer, or a block of another layout is a
    ``ValueError`` naming it.

    Examples:
        >>> import torch, transformers
        >>> cfg = transformers.Qwen2MoeConfig(vocab_size=32, hidden_size=16, intermediate_size=16, num_hidden_layers=3,
        ...     num_attention_heads=2, num_key_value_heads=1, moe_intermediate_size=8,
        ...     shared_expert_intermediate_size=8, num_experts=4, num_experts_per_tok=2, mlp_only_layers=[1])
        >>> sorted(moe_layers(transformers.Qwen2MoeForCausalLM(cfg)))
        [0, 2]
    """
    model_type, family = family_of(model, what)
    if not family.moe:
        moe = ", ".join(sorted(k for k, f in FAMILIES.items() if f.moe))
        raise ValueError(f"{what}: the family {model_type!r} ({type(model).__name__}) has no routed experts; the "
                         f"expert axis applies to mixtures of experts ({moe}): leave it out for this model")
    name, blocks = layer_list(model, what)
    found: Dict[int, MoEModule] = {}
    for i, block in enumerate(blocks):
        mlp = getattr(block, "mlp", None)
        if isinstance(mlp, nn.Module) and _fused(mlp):
            found[i] = mlp
        elif hasattr(mlp, "experts"):
            raise ValueError(f"{what}: {name}.{i}.mlp ({type(mlp).__name__}) keeps its experts in a layout "
                             "prunekit does not read (it needs mlp.gate.weight [E, H] and mlp.experts.gate_up_proj "
                             "[E, 2*I, H] / down_proj [E, H, I], as transformers >= 5 writes them); upgrade "
                             "transformers")
    if not found:
        raise ValueError(f"{what}: {type(model).__name__} has no sparse MoE layer (every block of {name} is dense, see "
                         "the config's mlp_only_layers / decoder_sparse_step); leave the expert axis out")
    return found


# ------------------------------------------------------------------ importance
@dataclass(frozen=True, eq=False)
class ExpertImportance:
    """One MoE layer's routed experts as the calibration tokens used them.

    ``score`` [E] (float64): the sum, over the real tokens routed to the expert, of its routing
    weight times the L2 norm of its output -- the size of what the expert adds to the layer's
    output, so an expert that is rarely chosen, or chosen with a small weight, or whose output is
    small, scores low; the criterion to rank experts by. ``load`` [E] (float64): the expert's
    share of the router's token assignments (sums to 1). ``tokens``: real tokens seen.
    """

    score: Tensor
    load: Tensor
    tokens: int


def _experts_inputs(args: tuple, kwargs: dict) -> List[Tensor]:
    """``(hidden_states [N, H], top_k_index [N, K], top_k_weights [N, K])`` of an experts call."""
    names = ("hidden_states", "top_k_index", "top_k_weights")
    return [args[j] if j < len(args) else kwargs[n] for j, n in enumerate(names)]


def _activation(experts: MoEModule, x: Tensor, e: int) -> Tensor:
    """Expert ``e``'s FFN activation ``act(gate) * up`` on the rows ``x`` (the input of its ``down_proj``)."""
    gate, up = F.linear(x, experts.gate_up_proj[e]).chunk(2, dim=-1)
    return experts.act_fn(gate) * up


def _unhook(module: nn.Module, hook: Any, pre: bool) -> None:
    """Remove ``hook`` from ``module``'s forward (pre-)hooks wherever it is registered; idempotent.

    It needs no handle, so a hook registered just before an interrupt, its handle not yet kept,
    is removed too."""
    table = module._forward_pre_hooks if pre else module._forward_hooks
    with_kwargs = module._forward_pre_hooks_with_kwargs if pre else module._forward_hooks_with_kwargs
    for key in [k for k, h in table.items() if h is hook]:
        del table[key]
        with_kwargs.pop(key, None)


def _unhook_all(hooked: Iterable[Tuple[nn.Module, Any]], pre: bool) -> None:
    """:func:`_unhook` each ``(module, hook)``."""
    for module, hook in hooked:
        _unhook(module, hook, pre)


def _config_key(key: Optional[str], what: str) -> str:
    """A family's config key for its experts (``moe_layers`` already refused a family without experts)."""
    if key is None:
        raise ValueError(f"{what}: the model's family has no routed experts")
    return key


def _routed_statistics(model: nn.Module, calibration: Iterable[Any], what: str, ffn: bool) -> Dict[int, Dict[str, Any]]:
    """Per MoE layer: assignments per expert, and either score sums or FFN sums of squares."""
    layers = moe_layers(model, what)
    batches = as_batches(calibration, what)
    stats: Dict[int, Dict[str, Any]] = {}
    for i, mlp in layers.items():
        e, _, inter = mlp.experts.down_proj.shape
        stats[i] = {"count": torch.zeros(e, dtype=torch.float64), "tokens": 0,
                    "sum": torch.zeros((e, inter) if ffn else e, dtype=torch.float64)}
    real: List[Any] = [None]  # the current batch's real tokens, flattened as the MoE block flattens them

    def hook_of(stat: Dict[str, Any]) -> Any:
        def hook(experts: MoEModule, args: tuple, kwargs: dict) -> None:
            x, index, weights = _experts_inputs(args, kwargs)
            mask = real[0]
            if mask is not None and mask.numel() == x.shape[0]:
                mask = mask.to(x.device)
                x, index, weights = x[mask], index[mask], weights[mask]
            stat["tokens"] += int(x.shape[0])
            for e in torch.unique(index).tolist():
                if not 0 <= e < stat["count"].numel():
                    continue  # an expert-parallel sentinel, no expert of this process
                rows, slots = torch.where(index == e)
                h = _activation(experts, x[rows], e)
                stat["count"][e] += rows.numel()
                if ffn:
                    stat["sum"][e] += h.double().pow(2).sum(0).cpu()
                else:
                    norms = F.linear(h, experts.down_proj[e]).double().norm(dim=-1)
                    stat["sum"][e] += float((weights[rows, slots].double() * norms).sum())
        return hook

    hooks = {i: hook_of(stats[i]) for i in layers}

    def body() -> None:
        for i, mlp in layers.items():
            mlp.experts.register_forward_pre_hook(hooks[i], with_kwargs=True)
        for batch in batches:
            mask = token_mask(batch)
            real[0] = mask.flatten() if mask is not None else None
            forward(model, batch)

    run_then_clean(body, lambda: _unhook_all([(layers[i].experts, h) for i, h in hooks.items()], pre=True))
    return stats


def expert_importance(model: nn.Module, calibration: Iterable[Any]) -> Dict[int, ExpertImportance]:
    """``{MoE layer index: ExpertImportance}``: each routed expert's contribution on the calibration tokens.

    ``score[e]`` = sum over real tokens t routed to expert e of ``w[t, e] * ||expert_e(x_t)||``
    (``w`` the routing weight the expert's output is multiplied by); ``load[e]`` = the fraction of
    the token assignments that went to e. Padding (``attention_mask`` 0) is left out. Rank by
    ``score`` (:func:`keep_top`) to choose the experts to keep.

    Examples:
        >>> import torch, transformers
        >>> cfg = transformers.MixtralConfig(vocab_size=32, hidden_size=16, intermediate_size=8, num_hidden_layers=2,
        ...     num_attention_heads=2, num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2)
        >>> torch.manual_seed(0); model = transformers.MixtralForCausalLM(cfg).eval()
        <torch._C.Generator object at ...>
        >>> imp = expert_importance(model, [{"input_ids": torch.randint(0, 32, (2, 8))}])
        >>> sorted(imp), imp[0].score.shape, imp[0].tokens, float(imp[0].load.sum())
        ([0, 1], torch.Size([4]), 16, 1.0)
    """
    stats = _routed_statistics(model, calibration, "prunekit.shrink.expert_importance", ffn=False)
    return {i: ExpertImportance(s["sum"], s["count"] / s["count"].sum().clamp_min(1.0), s["tokens"])
            for i, s in stats.items()}


def expert_ffn_importance(model: nn.Module, calibration: Iterable[Any]) -> Dict[int, Tensor]:
    """``{MoE layer index: [E, I] float64}``: per expert and FFN neuron, the L2 norm of the neuron's activation.

    The activation is ``act(gate) * up`` (the input of the expert's ``down_proj``), taken over the
    real tokens routed to that expert; an expert no token chose has zeros. Rank each row by it
    (:func:`keep_top`) to choose the neurons to keep.

    Examples:
        >>> import torch, transformers
        >>> cfg = transformers.MixtralConfig(vocab_size=32, hidden_size=16, intermediate_size=8, num_hidden_layers=2,
        ...     num_attention_heads=2, num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2)
        >>> torch.manual_seed(0); model = transformers.MixtralForCausalLM(cfg).eval()
        <torch._C.Generator object at ...>
        >>> expert_ffn_importance(model, [{"input_ids": torch.randint(0, 32, (2, 8))}])[1].shape
        torch.Size([4, 8])
    """
    stats = _routed_statistics(model, calibration, "prunekit.shrink.expert_ffn_importance", ffn=True)
    return {i: s["sum"].sqrt() for i, s in stats.items()}


def keep_top(scores: Mapping[int, Union[Tensor, ExpertImportance]], count: int) -> Dict[int, Tensor]:
    """``{layer: indices}`` of the ``count`` largest scores along the last dimension, in ascending order.

    Given :func:`expert_importance` (or its ``score`` tensors) it is a ``keep`` for
    :func:`remove_experts`; given :func:`expert_ffn_importance`, one for :func:`shrink_expert_ffn`.
    Ties keep the lower index.

    Examples:
        >>> import torch
        >>> keep_top({0: torch.tensor([0.5, 0.1, 0.9, 0.3])}, 2)
        {0: tensor([0, 2])}
        >>> keep_top({3: torch.tensor([[1.0, 3.0, 2.0], [0.0, 0.0, 5.0]])}, 2)[3].tolist()
        [[1, 2], [0, 2]]
    """
    out: Dict[int, Tensor] = {}
    for layer, value in scores.items():
        score = value.score if isinstance(value, ExpertImportance) else value
        size = score.shape[-1]
        if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= size:
            raise ValueError(f"prunekit.shrink.keep_top: count={count!r} for layer {layer}, which has {size} scores; "
                             f"write a whole number from 1 to {size}")
        order = torch.argsort(score, dim=-1, descending=True, stable=True)[..., :count]
        out[layer] = order.sort(dim=-1).values
    return out


# ------------------------------------------------------------------ what to keep, checked
def _indices(value: Any, size: int, what: str, where: str, unit: str) -> Tensor:
    """``value`` as sorted distinct indices in ``range(size)`` (a 1-D long tensor)."""
    if isinstance(value, Tensor):
        if value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool or value.dim() != 1:
            raise TypeError(f"{what}: {where} is a {value.dim()}-D {value.dtype} tensor; give the kept {unit} as a 1-D "
                            "integer tensor or a list of indices")
        idx = value.detach().to("cpu", torch.long)
    else:
        try:
            items = list(value)
        except TypeError:
            raise TypeError(f"{what}: {where} is {value!r}; give the kept {unit} as a list of indices") from None
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in items):
            raise TypeError(f"{what}: {where} is {items!r}; give the kept {unit} as whole numbers")
        idx = torch.tensor(items, dtype=torch.long)
    if idx.numel() == 0:
        raise ValueError(f"{what}: {where} keeps no {unit}; keep at least one (drop the whole layer with the depth "
                         "axis instead)")
    bad = idx[(idx < 0) | (idx >= size)]
    if bad.numel():
        raise IndexError(f"{what}: {where} names {unit[:-1]} {int(bad[0])}, out of range for {size} {unit} "
                         f"(valid: 0..{size - 1})")
    unique = torch.unique(idx)  # sorted
    if unique.numel() != idx.numel():
        raise ValueError(f"{what}: {where} names some {unit} twice ({idx.tolist()}); list each kept one once")
    return unique


def _layer_keys(layers: Mapping[int, MoEModule], keep: Any, what: str, every: bool, example: str) -> None:
    if not isinstance(keep, Mapping):
        raise TypeError(f"{what}: keep must map MoE layer index -> kept indices, e.g. {example}; got "
                        f"{type(keep).__name__}")
    unknown = [k for k in keep if k not in layers]
    if unknown:
        raise ValueError(f"{what}: keep names layer {unknown[0]!r}, which has no routed experts; the MoE layers are "
                         f"{sorted(layers)}")
    missing = [i for i in layers if i not in keep]
    if every and missing:
        raise ValueError(f"{what}: keep gives nothing for MoE layers {missing}; the config holds one size for every "
                         "MoE layer, so give every MoE layer's kept indices (the same count in each)")


def _kept_experts(layers: Mapping[int, MoEModule], keep: Any, what: str, every: bool) -> Dict[int, Tensor]:
    """``{layer: sorted kept expert indices}``, checked (and the same count everywhere when ``every``)."""
    _layer_keys(layers, keep, what, every, "{0: [0, 2, 3], 1: [0, 1, 3]}")
    plan: Dict[int, Tensor] = {}
    for i in sorted(keep):
        router = layers[i].gate
        plan[i] = _indices(keep[i], router.weight.shape[0], what, f"keep[{i}]", "experts")
        top_k = getattr(router, "top_k", 1)
        if plan[i].numel() < top_k:
            raise ValueError(f"{what}: layer {i} would keep {plan[i].numel()} experts, but its router picks "
                             f"num_experts_per_tok={top_k} per token; keep at least {top_k} experts (or lower "
                             "num_experts_per_tok first)")
    counts = {i: int(p.numel()) for i, p in plan.items()}
    if every and len(set(counts.values())) > 1:
        raise ValueError(f"{what}: keep gives different expert counts per layer ({counts}); the config holds one "
                         "number of experts, so keep the same count in every MoE layer")
    return plan


def _kept_neurons(layers: Mapping[int, MoEModule], keep: Any, what: str) -> Dict[int, Tensor]:
    """``{layer: [E, I'] sorted kept neuron indices of each expert}``, the same ``I'`` everywhere."""
    _layer_keys(layers, keep, what, True, "{0: [[0, 2], [1, 3], ...one list per expert], ...}")
    plan: Dict[int, Tensor] = {}
    for i in sorted(keep):
        n_experts, _, inter = layers[i].experts.down_proj.shape
        try:
            rows = list(keep[i])
        except TypeError:
            raise TypeError(f"{what}: keep[{i}] is {keep[i]!r}; give one list of kept neurons per expert") from None
        if len(rows) != n_experts:
            raise ValueError(f"{what}: keep[{i}] has {len(rows)} rows, but layer {i} has {n_experts} experts; give one "
                             "list of kept neurons per expert")
        kept = [_indices(r, inter, what, f"keep[{i}][{e}]", "neurons") for e, r in enumerate(rows)]
        sizes = [int(k.numel()) for k in kept]
        if len(set(sizes)) > 1:
            raise ValueError(f"{what}: the experts of layer {i} keep different numbers of neurons ({sizes}); the "
                             "config holds one expert FFN width, so every expert keeps the same number")
        plan[i] = torch.stack(kept)
    widths = {i: int(p.shape[1]) for i, p in plan.items()}
    if len(set(widths.values())) > 1:
        raise ValueError(f"{what}: keep gives different expert FFN widths per layer ({widths}); the config holds one "
                         "expert FFN width, so keep the same number of neurons in every MoE layer")
    return plan


# ------------------------------------------------------------------ emulation
class _KeptRouter:
    """A router seen through its own ``forward`` as if only the kept experts' rows existed."""

    def __init__(self, router: MoEModule, kept: Tensor) -> None:
        self._router = router
        self.weight = router.weight[kept]
        self.num_experts = int(kept.numel())

    def __getattr__(self, name: str) -> Any:
        return getattr(self._router, name)


def _routing_over(kept: Tensor) -> Any:
    """A router forward hook: the routing of a router that has only the ``kept`` experts, in the full index space."""

    def hook(router: MoEModule, args: tuple, kwargs: dict, output: Any) -> Any:
        idx = kept.to(router.weight.device)
        logits, scores, chosen = type(router).forward(_KeptRouter(router, idx), *args, **kwargs)
        full = logits.new_full((logits.shape[0], router.weight.shape[0]), float("-inf"))
        full[:, idx] = logits
        return full, scores, idx[chosen]

    return hook


@contextlib.contextmanager
def dropped_experts(model: nn.Module, keep: Mapping[int, Indices]) -> Iterator[nn.Module]:
    """Within the block the model computes as if each MoE layer ``i`` in ``keep`` had only the experts ``keep[i]``.

    A forward hook on each named layer's router re-runs the router's own ``forward`` on the kept
    experts' rows only (so softmax, top-k and the family's renormalisation are the family's own
    code) and hands the experts their original indices; the dropped experts' logits read
    ``-inf``. The hook runs before any other forward hook of the router, so they see this routing
    (``output_router_logits`` too). The outputs are those :func:`remove_experts` with the same
    ``keep`` gives, bit for bit. Nothing is copied; layers not in ``keep`` keep all their experts
    (counts may differ per layer here). The hooks are removed on exit, however the block ends.

    Examples:
        >>> import torch, transformers
        >>> cfg = transformers.MixtralConfig(vocab_size=32, hidden_size=16, intermediate_size=8, num_hidden_layers=2,
        ...     num_attention_heads=2, num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2)
        >>> torch.manual_seed(0); model = transformers.MixtralForCausalLM(cfg).eval()
        <torch._C.Generator object at ...>
        >>> ids = torch.randint(0, 32, (1, 6))
        >>> with dropped_experts(model, {0: [0, 1, 3], 1: [1, 2, 3]}):
        ...     emulated = model(ids).logits
        >>> torch.equal(emulated, remove_experts(model, {0: [0, 1, 3], 1: [1, 2, 3]})(ids).logits)
        True
    """
    what = "prunekit.shrink.dropped_experts"
    layers = moe_layers(model, what)
    plan = _kept_experts(layers, keep, what, every=False)
    hooks = {i: _routing_over(idx) for i, idx in plan.items()}
    try:
        for i, hook in hooks.items():
            layers[i].gate.register_forward_hook(hook, with_kwargs=True, prepend=True)  # others see its routing
        yield model
    finally:
        finish(lambda: _unhook_all([(layers[i].gate, h) for i, h in hooks.items()], pre=False))


def _narrowed(kept: Tensor) -> Any:
    """An experts forward hook: the output recomputed with the columns of ``down_proj`` of the dropped neurons zeroed."""
    inside = [False]

    def hook(experts: MoEModule, args: tuple, kwargs: dict, output: Any) -> Any:
        if inside[0]:  # the call below
            return output
        down = experts.down_proj
        mask = torch.zeros(down.shape[0], 1, down.shape[2], dtype=down.dtype, device=down.device)
        mask.scatter_(2, kept.to(down.device)[:, None, :], 1)
        inside[0] = True
        try:
            return torch.func.functional_call(experts, {"down_proj": down * mask}, args, kwargs)
        finally:
            inside[0] = False

    return hook


@contextlib.contextmanager
def narrowed_expert_ffn(model: nn.Module, keep: Mapping[int, Any]) -> Iterator[nn.Module]:
    """Within the block every expert ``e`` of MoE layer ``i`` computes with only its FFN neurons ``keep[i][e]``.

    ``keep`` is what :func:`shrink_expert_ffn` takes (every MoE layer, the same count everywhere).
    A forward hook on each layer's experts recomputes their output with the dropped neurons'
    ``down_proj`` columns zeroed (a masked copy of ``down_proj`` per call; no weight changes), which is
    what :func:`shrink_expert_ffn` with the same ``keep`` computes, to float rounding. The hooks are
    removed on exit, however the block ends.

    Examples:
        >>> import torch, transformers
        >>> cfg = transformers.Qwen3MoeConfig(vocab_size=32, hidden_size=16, intermediate_size=16, num_hidden_layers=1,
        ...     num_attention_heads=2, num_key_value_heads=1, head_dim=8, moe_intermediate_size=8, num_experts=2,
        ...     num_experts_per_tok=1)
        >>> torch.manual_seed(0); model = transformers.Qwen3MoeForCausalLM(cfg).eval()
        <torch._C.Generator object at ...>
        >>> ids, keep = torch.randint(0, 32, (1, 6)), {0: [[0, 3, 4, 7], [1, 2, 5, 6]]}
        >>> with narrowed_expert_ffn(model, keep):
        ...     emulated = model(ids).logits
        >>> torch.allclose(emulated, shrink_expert_ffn(model, keep)(ids).logits, atol=1e-6)
        True
    """
    what = "prunekit.shrink.narrowed_expert_ffn"
    layers = moe_layers(model, what)
    plan = _kept_neurons(layers, keep, what)
    hooks = {i: _narrowed(kept) for i, kept in plan.items()}
    try:
        for i, hook in hooks.items():
            layers[i].experts.register_forward_hook(hook, with_kwargs=True)
        yield model
    finally:
        finish(lambda: _unhook_all([(layers[i].experts, h) for i, h in hooks.items()], pre=False))


# ------------------------------------------------------------------ removal
def _replace(txn: Transaction, module: nn.Module, name: str, value: Tensor) -> None:
    """``module.<name>`` becomes a parameter holding ``value`` (recorded for rollback)."""
    old = getattr(module, name)
    txn.module(module)
    setattr(module, name, nn.Parameter(value, requires_grad=old.requires_grad))


def _set(txn: Transaction, owner: Any, name: str, value: Any) -> None:
    """``owner.<name> = value``, put back on rollback (for configs, whose values a module record does not hold)."""
    old = getattr(owner, name)
    txn.add(lambda: setattr(owner, name, old))
    setattr(owner, name, value)


def remove_experts(model: nn.Module, keep: Mapping[int, Indices], *,
                   journal: Optional[Transaction] = None) -> nn.Module:
    """Keep only the experts ``keep[i]`` of every MoE layer ``i``, in place; returns ``model``.

    Every MoE layer must be in ``keep`` with the same number of experts (the config holds one),
    at least ``num_experts_per_tok``. The router's weight rows and the experts' first dimension
    are sliced (kept experts stay in their original order), and the modules' ``num_experts`` and
    the config's experts key (``num_local_experts`` / ``num_experts``) follow. On any error --
    ``KeyboardInterrupt`` included -- the model and its config are as they were.

    Examples:
        >>> import torch, transformers
        >>> cfg = transformers.MixtralConfig(vocab_size=32, hidden_size=16, intermediate_size=8, num_hidden_layers=2,
        ...     num_attention_heads=2, num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2)
        >>> model = remove_experts(transformers.MixtralForCausalLM(cfg), {0: [0, 1, 3], 1: [1, 2, 3]})
        >>> model.config.num_local_experts, tuple(model.model.layers[0].mlp.experts.gate_up_proj.shape)
        (3, (3, 16, 16))
    """
    what = "prunekit.shrink.remove_experts"
    model_type, family = family_of(model, what)
    layers = moe_layers(model, what)
    plan = _kept_experts(layers, keep, what, every=True)
    count = int(next(iter(plan.values())).numel())
    experts_key = _config_key(family.experts_key, what)
    old = getattr(model.config, experts_key)
    with atomic(journal) as txn:
        for i, kept in plan.items():
            router, experts = layers[i].gate, layers[i].experts
            idx = kept.to(router.weight.device)
            _replace(txn, router, "weight", router.weight.detach().index_select(0, idx))
            router.num_experts = count
            idx = kept.to(experts.gate_up_proj.device)
            _replace(txn, experts, "gate_up_proj", experts.gate_up_proj.detach().index_select(0, idx))
            _replace(txn, experts, "down_proj", experts.down_proj.detach().index_select(0, idx))
            experts.num_experts = count
        for owner in {id(m): m for m in (model, getattr(model, "base_model", model))}.values():
            if getattr(owner, "num_experts", None) == old:  # *ForCausalLM's copy (its load-balancing loss reads it)
                txn.module(owner)
                owner.num_experts = count
        _set(txn, model.config, experts_key, count)
    logger.info("shrink: %s experts per MoE layer %d -> %d (%s)", model_type, old, count, family.experts_key)
    return model


def _check_aligned(layers: Mapping[int, MoEModule], width: int, what: str) -> None:
    """``ValueError`` when transformers' ``grouped_mm`` experts could not run an expert FFN ``width`` wide.

    ``torch._grouped_mm`` needs every row stride to be a multiple of 16 bytes: a width of
    ``16 / bytes per value`` multiples (4 float32, 8 bfloat16 values)."""
    for experts in (mlp.experts for mlp in layers.values()):
        if getattr(getattr(experts, "config", None), "_experts_implementation", None) != "grouped_mm":
            continue
        size = experts.down_proj.element_size()
        step = 16 // math.gcd(16, size)
        if width % step:
            low, high = width // step * step, (width // step + 1) * step
            raise ValueError(f"{what}: an expert FFN width of {width} {experts.down_proj.dtype} values ({width * size} "
                             "bytes a row) cannot run in transformers' grouped_mm experts, which need rows of a "
                             f"multiple of 16 bytes; keep {high} neurons{f' or {low}' if low else ''} per expert (or "
                             "run the model with model.set_experts_implementation('eager'), again after each "
                             "from_pretrained)")


def shrink_expert_ffn(model: nn.Module, keep: Mapping[int, Any], *,
                      journal: Optional[Transaction] = None) -> nn.Module:
    """Keep only the FFN neurons ``keep[i][e]`` of expert ``e`` in every MoE layer ``i``, in place; returns ``model``.

    ``keep[i]`` is an [E, I'] integer tensor (e.g. from :func:`keep_top`) or one list per expert;
    experts may keep different neurons but every expert of every MoE layer keeps the same number
    (the config's ``intermediate_size`` for Mixtral, ``moe_intermediate_size`` for Qwen-MoE,
    follows); with transformers' default ``grouped_mm`` experts that number must give rows of a
    multiple of 16 bytes (4 float32 values, 8 bfloat16). Neuron ``j`` is the gate row ``j`` and
    the up row ``I + j`` of ``gate_up_proj`` and the column ``j`` of ``down_proj``. Qwen2-MoE's
    shared expert is not touched. Failure-atomic.

    Examples:
        >>> import torch, transformers
        >>> cfg = transformers.Qwen3MoeConfig(vocab_size=32, hidden_size=16, intermediate_size=16, num_hidden_layers=1,
        ...     num_attention_heads=2, num_key_value_heads=1, head_dim=8, moe_intermediate_size=8, num_experts=2,
        ...     num_experts_per_tok=1)
        >>> model = shrink_expert_ffn(transformers.Qwen3MoeForCausalLM(cfg), {0: [[0, 3, 4, 7], [1, 2, 5, 6]]})
        >>> model.config.moe_intermediate_size, tuple(model.model.layers[0].mlp.experts.down_proj.shape)
        (4, (2, 16, 4))
    """
    what = "prunekit.shrink.shrink_expert_ffn"
    model_type, family = family_of(model, what)
    layers = moe_layers(model, what)
    plan = _kept_neurons(layers, keep, what)
    width = int(next(iter(plan.values())).shape[1])
    _check_aligned(layers, width, what)
    ffn_key = _config_key(family.expert_ffn_key, what)
    old = getattr(model.config, ffn_key)
    with atomic(journal) as txn:
        for i, kept in plan.items():
            experts = layers[i].experts
            gate_up, down = experts.gate_up_proj.detach(), experts.down_proj.detach()
            hidden, inter = down.shape[1], down.shape[2]
            rows = kept.to(gate_up.device)
            both = torch.cat([rows, rows + inter], dim=1)  # the gate rows j, then the up rows I + j
            rows_of_both = both[:, :, None].expand(-1, -1, gate_up.shape[2])
            _replace(txn, experts, "gate_up_proj", gate_up.gather(1, rows_of_both))
            _replace(txn, experts, "down_proj", down.gather(2, rows[:, None, :].expand(-1, hidden, -1)))
            experts.intermediate_dim = width
        _set(txn, model.config, ffn_key, width)
    logger.info("shrink: %s expert FFN width %d -> %d (%s)", model_type, old, width, family.expert_ffn_key)
    return model
