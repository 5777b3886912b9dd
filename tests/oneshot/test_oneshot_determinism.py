"""The same one-shot call gives the same masks and weights, every time: ties go by position, nothing depends on
addresses, allocation order or hash seeds."""

import hashlib
import os
import subprocess
import sys

import pytest
import torch

import prunekit
from prunekit.oneshot import magnitude_prune, sparsegpt_prune, wanda_prune

transformers = pytest.importorskip("transformers", reason="transformers is not installed")

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.join(HERE, "..", "..", "src")


# ------------------------------------------------------------------ exact ties: the earlier position goes
def test_magnitude_and_wanda_prune_the_earlier_of_equal_scores():
    w = torch.tensor([[1.0, -1.0, 2.0, 1.0], [3.0, 1.0, 1.0, -1.0]])
    # six entries tie at |w| = 1 for four prunings: the first four in flat order go
    assert magnitude_prune(w, 0.5).tolist() == [[False, False, True, False], [True, False, True, True]]
    assert wanda_prune(w, torch.ones(4), 0.5).tolist() == [[False, False, True, True], [True, False, False, True]]
    # N:M keeps the highest; of equal ones, the earlier stays
    assert magnitude_prune(w, nm=(2, 4)).tolist() == [[True, False, True, False], [True, True, False, False]]


@pytest.mark.parametrize("nm", [None, (2, 4)])
def test_sparsegpt_breaks_exact_saliency_ties_by_position(nm):
    # identity Hessian, every weight of equal magnitude: every saliency ties, and no update changes that
    w = torch.tensor([[1.0, -1.0, 1.0, -1.0, 1.0, 1.0, -1.0, 1.0]] * 2)
    new, keep = sparsegpt_prune(w, torch.eye(8), 0.5, nm, damp=0.0)
    if nm is None:  # the block's 8 prunings are chosen over both rows: the first 8 in flat order
        assert keep.tolist() == [[False] * 8, [True] * 8]
    else:
        assert keep.tolist() == [[True, True, False, False] * 2] * 2
    assert torch.equal(new, w * keep)


# ------------------------------------------------------------------ whole calls, again and again
def _llama():
    cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=64, max_position_embeddings=32)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval()


def _batches():
    g = torch.Generator().manual_seed(1)
    return [{"input_ids": torch.randint(0, 64, (2, 12), generator=g),
             "attention_mask": torch.ones(2, 12, dtype=torch.long)} for _ in range(3)]


def _digest(model):
    h = hashlib.sha256()
    for name, m in model.named_modules():
        if hasattr(m, "weight_mask"):
            h.update(name.encode())
            h.update(m.weight_mask.numpy().tobytes())
            h.update(m.weight.detach().numpy().tobytes())
    return h.hexdigest()


_CHILD = """
import sys, torch
sys.path.insert(0, {tests!r})
from test_oneshot_determinism import _llama, _batches, _digest
import prunekit
torch.set_num_threads(1)
for method, device in {runs!r}:
    m = _llama()
    prunekit.oneshot(m, _batches(), sparsity=0.6, method=method, device=device)
    print(_digest(m))
"""

RUNS = [("prunekit", None), ("prunekit", "cpu"), ("sparsegpt", None), ("wanda", None)]


@pytest.mark.slow
def test_the_same_call_gives_the_same_masks_and_weights_in_this_process_and_in_fresh_ones():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        here = []
        junk = []
        for i, (method, device) in enumerate(RUNS * 2):
            junk.append(torch.empty(1 + 7919 * i))  # other addresses for every run's tensors
            m = _llama()
            prunekit.oneshot(m, _batches(), sparsity=0.6, method=method, device=device)
            here.append(_digest(m))
    finally:
        torch.set_num_threads(threads)
    assert here[:4] == here[4:]
    assert here[0] == here[1]  # offloading to the working device changes nothing
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=SRC, HF_HUB_OFFLINE="1")
    for seed in ("1", "2"):  # other hash seeds: no order comes from a set or an id()
        out = subprocess.run([sys.executable, "-c", _CHILD.format(tests=HERE, runs=RUNS)], capture_output=True,
                             text=True, env=dict(env, PYTHONHASHSEED=seed), timeout=600)
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stdout.split() == here[:4]
