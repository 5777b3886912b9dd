"""Least-squares refit of the layers that read removed heads and neurons (``o_proj``, ``down_proj``).

With units removed, a reader's kept input columns (and its bias, when it has one) are refitted
so that it computes, on the calibration inputs, what it computed with every unit
(:func:`prunekit.kernels.lstsq.refit_columns`; FLAP/ZipLM-style). Blocks are refitted in the
order they run, each on the inputs that the model *as already shrunk* gives it, so later blocks
also make up for what earlier ones lost. This runs under the search's emulation (the removed
units are zeroed by hooks), before the units are removed for real, so the refitted weights carry
over to the smaller layers unchanged.

Given a ``dense`` view (a context in which the model computes as the dense model), a reader whose
output joins the residual stream at a norm is fitted instead to what the dense model had there, less
the stream the shrunk model brings (:mod:`prunekit.shrink.targets`): the refit then also makes up for
the error earlier blocks left in the stream.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import Tensor, nn

from ..kernels.lstsq import fit_columns, output_error, refit_columns, target_error
from ..transaction import Transaction
from .calibration import input_moments
from .targets import DenseView, find_joins, teacher_moments
from .width import HIDDEN, Reader, Width, _block_of

logger = logging.getLogger(__name__)

__all__ = ["ReaderFit", "refit_readers"]


@dataclass
class ReaderFit:
    """One reader after the refit: relative output error on the calibration inputs, before and after."""

    module: str
    kept: int
    total: int
    error_before: float
    error_after: float


def _plan(width: Width, keep: Dict[str, int], skipped: List[int]) -> Dict[int, List[Tuple[str, Reader, Tensor]]]:
    """Per block (in order), ``(name, reader, kept input features)`` of every reader that loses inputs."""
    names = {id(m): n for n, m in width.model.named_modules()}
    out: Dict[int, Dict[int, Tuple[str, Reader, List[Tensor]]]] = {}
    for axis_name, n in keep.items():
        axis = width.axes.get(axis_name)
        if axis is None or axis_name == HIDDEN or n == axis.units:
            continue
        for g, removed in zip(axis.groups, axis.removed(n)):
            gone = torch.zeros(axis.units, dtype=torch.bool)
            gone[removed] = True
            for reader, idx, unit_of in width._readers(g):
                name = names[id(reader)]
                where = _block_of(name, width.blocks_name)
                if where is None or where[0] in skipped:
                    continue
                entry = out.setdefault(where[0], {}).setdefault(id(reader), (name, reader, []))
                entry[2].append(idx[gone[unit_of]])
    plan: Dict[int, List[Tuple[str, Reader, Tensor]]] = {}
    for block in sorted(out):
        plan[block] = []
        for name, reader, parts in out[block].values():
            n_in = reader.weight.shape[1] if isinstance(reader, nn.Linear) else reader.weight.shape[0]
            dropped = torch.zeros(n_in, dtype=torch.bool)
            dropped[torch.cat(parts)] = True
            plan[block].append((name, reader, (~dropped).nonzero().flatten()))
    return plan


def refit_readers(width: Width, keep: Dict[str, int], batches: List[Any], journal: Transaction,
                  skipped: Optional[List[int]] = None, damp: float = 0.01,
                  dense: Optional[DenseView] = None) -> List[ReaderFit]:
    """Refit every reader of removed heads/neurons, block by block; the weights change in place.

    Run it with the model emulating its shrunk sizes (``keep``; ``skipped`` blocks are left
    alone). Each weight (and bias) is recorded in ``journal`` before it changes. A refit that would
    not lower the reader's output error is not applied. With ``dense`` (a callable giving a context in
    which the model computes as the dense model), readers that join the residual stream are fitted to
    the dense model's stream there (:mod:`prunekit.shrink.targets`); their errors are then against it.

    Examples:
        >>> import torch, transformers
        >>> from prunekit.transaction import Transaction
        >>> cfg = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
        ...                                num_hidden_layers=2, num_attention_heads=2)
        >>> torch.manual_seed(0); model = transformers.LlamaForCausalLM(cfg).eval()
        <torch._C.Generator object at ...>
        >>> batches = [{"input_ids": torch.randint(0, 32, (4, 16))}]
        >>> width = Width(model, batches[0]); width.score(batches)
        >>> with width.emulated({"ffn": 8}):
        ...     fits = refit_readers(width, {"ffn": 8}, batches, Transaction())
        >>> [(f.module, f.kept, f.error_after < f.error_before) for f in fits]
        [('model.layers.0.mlp.down_proj', 8, True), ('model.layers.1.mlp.down_proj', 8, True)]
    """
    fits: List[ReaderFit] = []
    plan = _plan(width, keep, list(skipped or []))
    every = [r for readers in plan.values() for _, r, _ in readers]
    joins = find_joins(width.model, batches[0], every, dense) if dense is not None and every else {}
    originals: Dict[int, Tuple[Reader, Tensor, Optional[Tensor]]] = {}
    for block, readers in plan.items():
        plain = [r for _, r, _ in readers if id(r) not in joins]
        taught = [r for _, r, _ in readers if id(r) in joins]
        stats = input_moments(width.model, batches, plain) if plain else {}
        moments = teacher_moments(width.model, batches, taught, joins, originals, dense) \
            if taught and dense is not None else {}
        for name, reader, kept in readers:
            if id(reader) in moments:
                fits.append(_fit_to_dense(name, reader, kept, moments[id(reader)], journal, damp, originals))
                continue
            xtx, count = stats.get(id(reader), (None, 0))
            if xtx is None or count == 0:
                continue
            fits.append(_refit_one(name, reader, kept, xtx / count, journal, damp))
    logger.info("shrink: refitted %d readers (%d to the dense model's stream)", len(fits), len(joins))
    return fits


def _as_matrix(reader: Reader) -> Tuple[Tensor, int, Optional[Tensor]]:
    """``([W b] as (out, in + 1) float64, in, bias)`` of a Linear or Conv1D reader (zeros for no bias)."""
    linear = isinstance(reader, nn.Linear)
    w = reader.weight.detach() if linear else reader.weight.detach().T  # as (out, in)
    bias = reader.bias
    b = bias.detach().double() if bias is not None else torch.zeros(w.shape[0], dtype=torch.float64, device=w.device)
    return torch.cat([w.double(), b[:, None]], 1), w.shape[1], bias


def _write(reader: Reader, kept: Tensor, new: Tensor, n_in: int) -> None:
    with torch.no_grad():
        target = reader.weight if isinstance(reader, nn.Linear) else reader.weight.T
        target[:, kept] = new[:, kept].to(target.dtype)
        if reader.bias is not None:
            reader.bias.copy_(new[:, n_in].to(reader.bias.dtype))


def _fit_to_dense(name: str, reader: Reader, kept: Tensor, moments: Tuple[Tensor, Tensor, float, int],
                  journal: Transaction, damp: float,
                  originals: Dict[int, Tuple[Reader, Tensor, Optional[Tensor]]]) -> ReaderFit:
    g, c, tt, _ = moments
    a, n_in, bias = _as_matrix(reader)
    cols = torch.cat([kept, torch.tensor([n_in])]) if bias is not None else kept
    if bias is None:
        a, g, c = a[:, :n_in], g[:n_in, :n_in], c[:, :n_in]
    now = torch.zeros_like(a)
    now[:, cols] = a[:, cols]  # what the reader computes under the emulation
    before = target_error(now, g, c, tt)
    new = fit_columns(g, c, cols, damp)
    after = target_error(new, g, c, tt)
    if after < before:
        weight = reader.weight
        w0, b0 = weight.detach().clone(), None if bias is None else bias.detach().clone()
        originals[id(reader)] = (reader, w0, b0)  # the dense passes of later blocks compute with these

        def restore() -> None:
            with torch.no_grad():
                weight.copy_(w0)
                if bias is not None and b0 is not None:
                    bias.copy_(b0)

        journal.add(restore)
        _write(reader, kept, new, n_in)
    return ReaderFit(name, int(kept.numel()), n_in, before, min(before, after))


def _refit_one(name: str, reader: Reader, kept: Tensor, g: Tensor, journal: Transaction, damp: float) -> ReaderFit:
    a, n_in, bias = _as_matrix(reader)
    cols = torch.cat([kept, torch.tensor([n_in])]) if bias is not None else kept
    if bias is None:  # no bias to absorb the constant: fit on the inputs alone
        a, g = a[:, :n_in], g[:n_in, :n_in]
    masked = torch.zeros_like(a)
    masked[:, cols] = a[:, cols]
    before = output_error(a, masked, g)
    new = refit_columns(a, g, cols, damp)
    after = output_error(a, new, g)
    if after < before:
        journal.tensor(reader.weight)
        if bias is not None:
            journal.tensor(bias)
        _write(reader, kept, new, n_in)
    return ReaderFit(name, int(kept.numel()), n_in, before, min(before, after))
