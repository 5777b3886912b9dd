"""One-shot pruning on several ranks (tests/helpers/dist_harness.py runs these on every rank of a gloo group).

Every rank builds the same model and calibration (same seeds), prunes one copy with ``group=True``
(its share of the batches, statistics summed on an owner rank, each layer solved once and broadcast)
and another in this process alone -- the single-process reference -- and checks that every mask and
weight is the reference's, bit for bit, and so is the report.
"""

from __future__ import annotations

import copy
import os
import tempfile

import torch
import torch.distributed as dist

import prunekit
from prunekit.oneshot import oneshot_folder


def _llama(dtype=torch.float32, layers=2):
    import transformers

    cfg = transformers.LlamaConfig(num_hidden_layers=layers, hidden_size=32, intermediate_size=64,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
                                   max_position_embeddings=32, tie_word_embeddings=False)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).to(dtype).eval()


def _batches(n=5, seed=1):
    """``n`` batches (not a multiple of 2 or 4: the last round leaves ranks without one), padded unevenly."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        mask = torch.ones(2, 12, dtype=torch.long)
        mask[i % 2, 12 - (i + 1):] = 0
        out.append({"input_ids": torch.randint(0, 64, (2, 12), generator=g), "attention_mask": mask})
    return out


def _state(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _same(got, want, what):
    assert list(got) == list(want), f"{what}: other tensors"
    for k in want:
        a, b = got[k], want[k]
        if a.is_floating_point():
            a, b = a.view(torch.int16) if a.element_size() == 2 else a.view(torch.int32), \
                b.view(torch.int16) if b.element_size() == 2 else b.view(torch.int32)
        assert torch.equal(a, b), f"{what}: {k} differs from one process's at {int((a != b).sum())} entries"


def _report(r):
    return [(x.name, x.pruned, x.numel, x.error) for x in r.layers], r.samples, r.tokens


def _compare(method, pattern="unstructured", masks="keep", dtype=torch.float32):
    base = _llama(dtype)
    alone, shared = copy.deepcopy(base), copy.deepcopy(base)
    kw = dict(method=method, pattern=pattern, masks=masks, sparsity=0.5)
    ra = prunekit.oneshot(alone, _batches(), **kw)
    rs = prunekit.oneshot(shared, _batches(), group=True, **kw)
    _same(_state(shared), _state(alone), f"{method} {pattern} {masks}")
    assert _report(rs) == _report(ra), f"{method}: the reports differ"


def oneshot_sparsegpt(rank, world):
    _compare("sparsegpt")
    _compare("sparsegpt", "2:4", masks="bake", dtype=torch.bfloat16)


def oneshot_wanda_and_magnitude(rank, world):
    _compare("wanda")
    _compare("magnitude", masks="bake")


def oneshot_prunekit(rank, world):
    _compare("prunekit")  # dense-model targets: two streams of activations, cross statistics
    _compare("prunekit-fast", masks="bake", dtype=torch.bfloat16)


def oneshot_moe_unseen_experts(rank, world):
    """Experts no calibration token reaches (pruned by magnitude, no new weights) on every rank."""
    from helpers import shrink_models as S

    base = S.build_zoo("mixtral")
    batches = [{"input_ids": torch.tensor([[5]])} for _ in range(4)]  # one token, 2 of 4 experts: 2 see nothing
    for method in ("sparsegpt", "prunekit"):
        alone, shared = copy.deepcopy(base), copy.deepcopy(base)
        ra = prunekit.oneshot(alone, batches, method=method, sparsity=0.5)
        rs = prunekit.oneshot(shared, batches, method=method, sparsity=0.5, group=True)
        unseen = [x.name for x in ra.layers if ".experts." in x.name and x.error is None]
        assert len(unseen) >= 2, f"{method}: every expert saw a token ({unseen})"
        _same(_state(shared), _state(alone), f"{method} with unseen experts")
        assert _report(rs) == _report(ra), f"{method}: the reports differ"


def oneshot_refusals(rank, world):
    model = _llama()
    before = _state(model)
    for kwargs, match in ((dict(options={"tune_epochs": 1}), "tune_epochs > 0 cannot run with group"),
                          (dict(batch_size=1), None)):
        try:
            if match is None:  # one batch for several ranks
                prunekit.oneshot(model, [_batches()[0]], group=True, **kwargs)
            else:
                prunekit.oneshot(model, _batches(), group=True, **kwargs)
        except ValueError as e:
            assert (match or "every rank needs at least one") in str(e), str(e)
        else:
            raise AssertionError(f"{kwargs} was not refused")
    _same(_state(model), before, "after a refusal")


def oneshot_folder_shared(rank, world):
    """Disk to disk on every rank, rank 0 writing: the folder is the one process's in-memory result."""
    import transformers

    box = [tempfile.mkdtemp(prefix="prunekit-oneshot-") if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)  # one folder, written by rank 0, read by every rank
    src, out = os.path.join(box[0], "src"), os.path.join(box[0], "out")
    if rank == 0:
        _llama(torch.bfloat16).save_pretrained(src, max_shard_size="20KB")
    dist.barrier()
    report = oneshot_folder(src, out, _batches(), method="sparsegpt", group=True)
    assert os.path.isdir(out)  # rank 0 wrote it; every rank returns once it is in place
    model = transformers.LlamaForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
    ref = prunekit.oneshot(model, _batches(), method="sparsegpt", masks="bake")
    assert _report(report) == _report(ref)
    if rank == 0:
        loaded = transformers.LlamaForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
        _same(_state(loaded), _state(model), "the folder")
    dist.barrier()
    if rank == 0:
        import shutil

        shutil.rmtree(box[0])
