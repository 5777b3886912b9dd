"""prunekit.oneshot on an encoder-decoder (T5): both stacks pruned, no cache anywhere, blocks chained as the
model chains them."""

from __future__ import annotations

import pytest
import torch

import prunekit
from prunekit.oneshot import capture_block_inputs, find_blocks, run_block
from prunekit.oneshot.blocks import find_chain

transformers = pytest.importorskip("transformers", reason="transformers is not installed")

from helpers import shrink_models as S  # noqa: E402

pytestmark = [pytest.mark.hf, pytest.mark.usefixtures("one_thread")]


def _batches(n=2):
    return [S.zoo_batch("t5", seed=i) for i in range(n)]


def test_t5_blocks_are_the_encoders_then_the_decoders():
    assert [n for n, _ in find_blocks(S.build_zoo("t5"))] == [
        "encoder.block.0", "encoder.block.1", "decoder.block.0", "decoder.block.1"]


@pytest.mark.parametrize("method", ["sparsegpt", "prunekit"])
def test_t5_prunes_both_stacks_and_equals_a_cache_free_run(method):
    model, reference = S.build_zoo("t5"), S.build_zoo("t5")
    assert model.decoder.config.use_cache is True  # the decoder's own config copy caches
    for m in reference.modules():
        if getattr(m, "config", None) is not None:
            m.config.use_cache = False
    report = prunekit.oneshot(model, _batches(), method=method, sparsity=0.5)
    prunekit.oneshot(reference, _batches(), method=method, sparsity=0.5)
    names = [r.name for r in report.layers]
    assert "encoder.block.0.layer.0.SelfAttention.q" in names
    assert "decoder.block.1.layer.1.EncDecAttention.k" in names  # cross-attention's k/v read the encoder output
    assert len(names) == 2 * 6 + 2 * 10  # encoder: q k v o wi wo; decoder: those and the cross-attention's q k v o
    assert all(r.pruned == r.numel // 2 for r in report.layers)
    got, want = model.state_dict(), reference.state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert model.decoder.config.use_cache is True and model.config.use_cache is True  # put back


def test_blocks_walked_with_the_chain_equal_the_models_own_stack():
    model, batch = S.build_zoo("t5"), S.zoo_batch("t5")
    for stack in (model.encoder, model.decoder):
        chain = find_chain(model, stack.block[0], stack.block[1], batch)
        assert chain is not None and chain.args[2] == 1  # the position bias block 0 computes goes to the next
        seen = []
        handle = stack.block[-1].register_forward_hook(lambda m, a, out: seen.append(out[0]))
        with torch.no_grad():
            model(**batch)
        handle.remove()
        inputs = capture_block_inputs(model, stack.block[0], [batch])
        for block in stack.block:
            inputs = run_block(block, inputs, chain=chain)
        assert torch.equal(inputs[0].hidden, seen[0])


def test_failure_in_the_decoder_leaves_t5_as_it_was():
    model = S.build_zoo("t5")
    before = {k: v.clone() for k, v in model.state_dict().items()}

    def fail(done, total, name):
        if done == 3:
            raise RuntimeError("stop")

    with pytest.raises(RuntimeError, match="stop"):
        prunekit.oneshot(model, _batches(), method="sparsegpt", progress=fail)
    assert not prunekit.is_pruned(model) and model.decoder.config.use_cache is True
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
