"""One-shot over the transformers families of ``shrink_models.ZOO`` (hidden 64, 2 layers, 4 heads; MoE with 4
experts): 50% by SparseGPT, then every targeted weight -- each expert's slice included -- holds exactly half
zeros by its mask, the report's sparsity is the exact fraction over them, and every weight of 2 or more
dimensions inside the blocks is either pruned or listed in ``report.dense`` (nothing skipped without a word)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import prunekit
from prunekit import reparam
from prunekit.oneshot import find_blocks
from prunekit.oneshot.solvers import prune_count

transformers = pytest.importorskip("transformers", reason="transformers is not installed")

from helpers import shrink_models as S  # noqa: E402

pytestmark = [pytest.mark.zoo, pytest.mark.hf, pytest.mark.usefixtures("one_thread")]


@pytest.fixture(autouse=True)
def _quiet():
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    yield
    transformers.logging.set_verbosity(verbosity)


def _expert(model, name):
    """``(module, tensor, e)`` when ``name`` is ``<experts module>.<3-D parameter>.<e>``, else None."""
    head, _, tail = name.rpartition(".")
    owner, _, tensor = head.rpartition(".")
    if not tail.isdigit() or not owner:
        return None
    module = model.get_submodule(owner)
    mask = reparam.get_mask(module, tensor) if hasattr(module, f"{tensor}_mask") else None
    return (module, tensor, int(tail)) if mask is not None and mask.dim() == 3 else None


def _mask_of(model, row):
    """The mask of one report row: a layer's ``weight_mask`` or an expert's slice of a 3-D parameter's mask."""
    ex = _expert(model, row.name)
    if ex is not None:
        return reparam.get_mask(ex[0], ex[1])[ex[2]]
    return reparam.get_mask(model.get_submodule(row.name), "weight")


def _key(model, name):
    """The parameter a report row prunes."""
    return name.rpartition(".")[0] if _expert(model, name) is not None else f"{name}.weight"


@pytest.mark.parametrize("family", sorted(S.ZOO))
def test_oneshot_zoo_exact_sparsity(family, record_property):
    model = S.build_zoo(family)
    batches = [S.zoo_batch(family, seed=i) for i in range(2)]
    report = prunekit.oneshot(model, batches, method="sparsegpt", sparsity=0.5)
    assert report.layers
    pruned = numel = 0
    for row in report.layers:
        mask = _mask_of(model, row)
        assert tuple(mask.shape) in (row.shape, row.shape[::-1]), row.name
        assert int((mask == 0).sum()) == row.pruned == prune_count(mask.numel(), 0.5), row.name
        pruned, numel = pruned + row.pruned, numel + mask.numel()
    assert report.sparsity == pruned / numel
    if family in ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3"):
        assert sum(".experts." in r.name for r in report.layers) >= 8  # 4 experts x gate_up/down per MoE layer
    keys = {_key(model, r.name) for r in report.layers}
    for bname, block in find_blocks(model):
        for mname, m in block.named_modules():
            if isinstance(m, nn.Embedding) or "Norm" in type(m).__name__:
                continue  # T5's relative position buckets, per-head q/k norms: not layers
            for pname, p in m.named_parameters(recurse=False):
                full = ".".join(x for x in (bname, mname, pname.removesuffix("_orig")) if x)
                if p.dim() >= 2:
                    assert full in keys or full.rsplit(".", 1)[0] in report.dense or full in report.dense, full
    with torch.no_grad():
        out = S.output(model, S.zoo_batch(family, seed=5))
    assert torch.isfinite(out).all()
    experts = sum(_expert(model, r.name) is not None for r in report.layers)
    record_property("outcome", "exact sparsity")
    record_property("reason", f"{len(report.layers)} weights pruned"
                    + (f" ({experts} of them expert slices)" if experts else "")
                    + (f"; {len(report.dense)} left dense: {'; '.join(sorted(set(report.dense.values())))}"
                       if report.dense else ""))

