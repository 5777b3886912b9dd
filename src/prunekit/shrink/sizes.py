"""How big a model would be with fewer units on each axis, without building it.

:class:`SizeModel` records, for every parameter, which of its dimensions each axis scales
(width axes from the dependency graph; routed experts and their FFN width from the experts'
3-D tensors and the router) and which block holds it. From that the parameter count of any
choice of sizes -- and of which blocks stay -- is a sum of products; no tensor is touched.

MACs are counted per token for the matrix products (``nn.Linear``, GPT-2's ``Conv1D``, routed
experts): ``in x out`` for each, and for a mixture of experts only the ``top_k`` experts a token
is routed to. Attention's token-to-token products (which grow with the sequence) and embedding
lookups are left out: they are the same for every candidate of one hidden size and head count
or cost no MACs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from torch import Tensor, nn

from .families import family_of, layer_list
from .width import Width

__all__ = ["EXPERTS", "EXPERT_FFN", "LAYERS", "SizeModel"]

LAYERS, EXPERTS, EXPERT_FFN = "layers", "experts", "expert_ffn"


@dataclass
class _Param:
    numel: int
    scales: Tuple[Tuple[str, int], ...]  # (axis, that dimension's units at full size), one per scaled dimension
    block: Optional[int]
    macs: float  # MACs per token at full size (0 for tensors no matrix product runs over)


class SizeModel:
    """Parameter and MAC counts of a model for any sizes of its axes.

    ``units`` gives each axis's full size; :meth:`params` and :meth:`macs` take ``sizes`` (units
    kept per axis; a missing axis stays full) and ``kept_blocks`` (default: all).

    Examples:
        >>> import torch, transformers
        >>> cfg = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
        ...                                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
        >>> model = transformers.LlamaForCausalLM(cfg)
        >>> sizes = SizeModel(model, Width(model, {"input_ids": torch.arange(8).view(1, 8)}))
        >>> sizes.params({}) == sum(p.numel() for p in model.parameters())
        True
        >>> sizes.params({"ffn": 16}), sizes.params({"ffn": 16}, kept_blocks=[1])
        (4176, 2608)
    """

    def __init__(self, model: nn.Module, width: Width) -> None:
        _, family = family_of(model)
        blocks_name, blocks = layer_list(model)
        self.n_blocks = len(blocks)
        self.units: Dict[str, int] = {name: axis.units for name, axis in width.axes.items()}
        self.units[LAYERS] = self.n_blocks
        dims: Dict[int, Dict[int, Tuple[str, int]]] = {}  # id(tensor) -> dim -> (axis, units)
        for name, axis in width.axes.items():
            for g in axis.groups:
                for mname, e, _, _ in width.graph.entries(g):
                    t = _tensor(width.graph.module(mname), e.path)
                    dims.setdefault(id(t), {})[e.axis] = (name, axis.units)
        self.top_k: Optional[int] = None
        if family.moe:
            self._experts(model, family, dims)
        macs: Dict[int, float] = {}
        for m in model.modules():
            w = m._parameters.get("weight")
            if isinstance(w, Tensor) and (isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D"):
                macs[id(w)] = macs.get(id(w), 0.0) + w.numel()
            for p in m._parameters.values():
                if p is None or dims.get(id(p), {}).get(0, ("", 0))[0] != EXPERTS:
                    continue
                # a routed expert runs for the top_k of every token; the router for every token
                macs[id(p)] = p.numel() * (self.top_k or 1) / p.shape[0] if p.dim() == 3 else p.numel()
        self._params: List[_Param] = []
        seen = set()
        prefix = blocks_name + "."
        for pname, p in model.named_parameters(remove_duplicate=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            block = None
            if pname.startswith(prefix):
                head = pname[len(prefix):].partition(".")[0]
                block = int(head) if head.isdigit() else None
            scales = tuple(dims.get(id(p), {}).values())
            self._params.append(_Param(p.numel(), scales, block, macs.get(id(p), 0.0)))

    def _experts(self, model: nn.Module, family: object, dims: Dict[int, Dict[int, Tuple[str, int]]]) -> None:
        """Routed experts (3-D ``gate_up_proj`` [E, 2I, H] / ``down_proj`` [E, H, I]) and router rows."""
        config = model.config
        n = int(getattr(config, family.experts_key))  # type: ignore[attr-defined]
        ffn = int(getattr(config, family.expert_ffn_key))  # type: ignore[attr-defined]
        self.top_k = int(getattr(config, "num_experts_per_tok", 1))
        self.units[EXPERTS], self.units[EXPERT_FFN] = n, ffn
        for m in model.modules():
            gate_up, down = getattr(m, "gate_up_proj", None), getattr(m, "down_proj", None)
            if isinstance(gate_up, nn.Parameter) and gate_up.dim() == 3 and isinstance(down, nn.Parameter):
                dims.setdefault(id(gate_up), {}).update({0: (EXPERTS, n), 1: (EXPERT_FFN, ffn)})
                dims.setdefault(id(down), {}).update({0: (EXPERTS, n), 2: (EXPERT_FFN, ffn)})
            router = getattr(m, "gate", None)
            w = getattr(router, "weight", None)
            if isinstance(w, nn.Parameter) and w.dim() == 2 and w.shape[0] == n and hasattr(m, "experts"):
                dims.setdefault(id(w), {})[0] = (EXPERTS, n)

    def _count(self, sizes: Dict[str, int], kept_blocks: Optional[Sequence[int]], blocks_only: bool, macs: bool) -> int:
        keep = set(range(self.n_blocks)) if kept_blocks is None else set(kept_blocks)
        total = 0.0
        for p in self._params:
            if p.block is None and blocks_only:
                continue
            if p.block is not None and p.block not in keep:
                continue
            value = p.macs if macs else float(p.numel)
            for axis, units in p.scales:
                value *= sizes.get(axis, units) / units
            total += value
        return int(round(total))

    def params(self, sizes: Dict[str, int], kept_blocks: Optional[Sequence[int]] = None, *,
               blocks_only: bool = False) -> int:
        """Parameters with ``sizes`` units per axis and ``kept_blocks`` (all by default); tied tensors once."""
        return self._count(sizes, kept_blocks, blocks_only, macs=False)

    def macs(self, sizes: Dict[str, int], kept_blocks: Optional[Sequence[int]] = None, *,
             blocks_only: bool = False) -> int:
        """Multiply-accumulates per token of the matrix products (see the module docstring)."""
        return self._count(sizes, kept_blocks, blocks_only, macs=True)


def _tensor(module: nn.Module, path: str) -> Tensor:
    owner_path, _, leaf = path.rpartition(".")
    owner = module.get_submodule(owner_path) if owner_path else module
    return getattr(owner, leaf)
