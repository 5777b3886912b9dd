"""One-shot pruning at the memory of one block (issue 26): prunekit beside llm-compressor 0.14 on a 0.55 B model.

The model: a random Llama-architecture model built from a config (hidden 1536, FFN 4096, 16 blocks, vocabulary
32000, untied head: 551 M parameters) saved in bfloat16 as 6 safetensors shards with a word-level tokenizer;
calibration: 8 sequences of 128 random token ids (the same for both libraries); method: SparseGPT, 50 %
unstructured, block size 128, dampening 0.01. Every measurement is a fresh process; memory is the peak resident
size (VmHWM, reset through /proc/self/clear_refs) while the model is loaded and pruned, minus the resident size
just before, divided by the weights' bytes: the model and everything the call needs are included, the
interpreter and the code of the libraries are not (the model's class is imported before the baseline in
every process: importing transformers' Llama modules alone takes about 136 MiB). Rows:

* prunekit in memory, ``masks="bake"`` and ``masks="keep"`` (``from_pretrained``, then ``prunekit.oneshot``);
* prunekit disk to disk (``oneshot_folder``: folder in, new folder out, one block in memory);
* llm-compressor 0.14 (``oneshot`` with ``SparseGPTModifier``, the sequential pipeline over
  ``LlamaDecoderLayer``), in its own environment (it pins transformers 5.15-5.17):

      python3 -m venv /work/venvs/llmc
      /work/venvs/llmc/bin/pip install torch==2.13.0
      /work/venvs/llmc/bin/pip install "llmcompressor==0.14.*" "torch==2.13.0"

  (``--llmc-python`` or ``PRUNEKIT_LLMC_PYTHON``; without it the row says "not available");
* disk to disk under an address-space limit (``RLIMIT_AS``) of ``--limit`` times the weights' bytes above
  what the process holds once its code is loaded (glibc's mmap threshold fixed at 1 MiB, so that freed
  memory gives its address space back: see ``child_limited``): the output is loaded with plain
  ``transformers`` and compared, tensor by tensor, with the in-memory result;
* 1, 2 and 4 processes (``torchrun``, gloo) disk to disk on the first ``--dist-blocks`` blocks: the same
  tensors as one process, and the wall time.

    python benchmarks/bench_oneshot_scale.py                 # everything (about 45 min on 2 busy cores)
    python benchmarks/bench_oneshot_scale.py --hidden 512 --inter 1408 --layers 8 --dist-blocks 2   # a quick look
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from _harness import MIB, MemoryMeter, load_note, table  # noqa: E402

SRC = os.path.join(HERE, "..", "src")


# ----------------------------------------------------------------------------- children
def _calibration(n: int = 8, tokens: int = 128, vocab: int = 32000):
    import torch

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, vocab, (n, tokens), generator=g)
    return ids


def _digest_state(state) -> dict:
    from prunekit.io.plain import tensor_bytes

    return {k: hashlib.sha256(tensor_bytes(v)).hexdigest()[:16] for k, v in state.items()}


def child_build(job: dict) -> dict:
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    cfg = transformers.LlamaConfig(hidden_size=job["hidden"], intermediate_size=job["inter"],
                                   num_hidden_layers=job["layers"], num_attention_heads=job["hidden"] // 64,
                                   num_key_value_heads=job["hidden"] // 64, vocab_size=32000,
                                   max_position_embeddings=2048, tie_word_embeddings=False, dtype="bfloat16")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(job["folder"], max_shard_size="200MB")
    vocab = {f"t{i}": i for i in range(32000)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", pad_token="t1", eos_token="t2",
                                         bos_token="t3").save_pretrained(job["folder"])
    return {"parameters": sum(p.numel() for p in model.parameters()),
            "weights_bytes": sum(p.numel() * p.element_size() for p in model.parameters())}


def _import_model_code() -> None:
    """Import what the model's code needs (transformers imports it lazily) before the baseline."""
    import accelerate  # noqa: F401
    from transformers import LlamaForCausalLM  # noqa: F401


def child_prunekit(job: dict) -> dict:
    import torch
    import transformers

    import prunekit
    from prunekit.oneshot import oneshot_folder

    ids = _calibration()
    batches = [{"input_ids": ids[i:i + 1]} for i in range(ids.shape[0])]
    out: dict = {}
    _import_model_code()
    meter = MemoryMeter()
    with meter:
        t0 = time.perf_counter()
        if job["mode"] == "folder":
            report = oneshot_folder(job["folder"], job["out"], batches, method="sparsegpt", sparsity=0.5,
                                    blocks=job.get("blocks"))
            load = 0.0
        else:
            model = transformers.AutoModelForCausalLM.from_pretrained(job["folder"], dtype=torch.bfloat16)
            load = time.perf_counter() - t0
            report = prunekit.oneshot(model, batches, method="sparsegpt", sparsity=0.5, masks=job["mode"])
        seconds = time.perf_counter() - t0 - load
    if job["mode"] == "bake":
        out["digest"] = _digest_state(model.state_dict())
    out.update(peak_bytes=meter.peak_extra, meter=meter.method, load_s=load, prune_s=seconds,
               blocks=report.blocks, sparsity=report.sparsity, layers=len(report.layers))
    return out


def child_llmc(job: dict) -> dict:
    import logging

    import torch
    import transformers
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.pruning.sparsegpt import SparseGPTModifier

    logging.disable(logging.WARNING)
    try:
        from loguru import logger as _loguru

        _loguru.remove()
    except Exception:
        pass
    ids = _calibration()
    ds = Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": torch.ones_like(ids).tolist()})
    recipe = SparseGPTModifier(sparsity=0.5, mask_structure="0:0", targets=["Linear"], ignore=["lm_head"],
                               block_size=128, dampening_frac=0.01)
    _import_model_code()
    meter = MemoryMeter()
    with meter:
        t0 = time.perf_counter()
        model = transformers.AutoModelForCausalLM.from_pretrained(job["folder"], dtype=torch.bfloat16)
        load = time.perf_counter() - t0
        oneshot(model=model, dataset=ds, recipe=recipe, num_calibration_samples=ids.shape[0], max_seq_length=128,
                shuffle_calibration_samples=False, pipeline="sequential", sequential_targets=["LlamaDecoderLayer"])
        seconds = time.perf_counter() - t0 - load
    lin = [m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and ".layers." in n]
    zeros = sum(int((m.weight == 0).sum()) for m in lin) / sum(m.weight.numel() for m in lin)
    return {"peak_bytes": meter.peak_extra, "meter": meter.method, "load_s": load, "prune_s": seconds,
            "blocks": model.config.num_hidden_layers, "sparsity": zeros, "layers": len(lin)}


def child_limited(job: dict) -> dict:
    """Disk to disk with the address space limited to what the process holds plus ``headroom`` bytes.

    ``RLIMIT_AS`` counts address space, not resident memory: glibc serves allocations below its (adaptive)
    mmap threshold from a heap that only grows, so memory that was handed out and freed -- or never
    touched, as the parameters ``nn.Linear`` allocates before they move to the ``meta`` device -- keeps
    counting. The child fixes the threshold at 1 MiB first (``mallopt``), so that every tensor's address
    space goes back to the system when the tensor is freed and the limit bounds what the process holds.
    """
    import ctypes
    import resource

    from prunekit.oneshot import oneshot_folder

    ids = _calibration()
    batches = [{"input_ids": ids[i:i + 1]} for i in range(ids.shape[0])]
    libc = ctypes.CDLL(None)
    libc.mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD
    # every code path imported first (transformers imports lazily): the limit bounds data, not code
    oneshot_folder(job["warm"], job["warm"] + "-pruned", batches[:1], method="sparsegpt")
    libc.malloc_trim(0)

    def vm() -> int:
        with open("/proc/self/status") as f:
            return int(next(ln for ln in f if ln.startswith("VmSize")).split()[1]) * 1024

    base = vm()
    limit = base + job["headroom"]
    resource.setrlimit(resource.RLIMIT_AS, (limit, resource.RLIM_INFINITY))
    import torch

    try:
        torch.empty(job["weights_bytes"], dtype=torch.uint8)
        bound = False
    except (MemoryError, RuntimeError):
        bound = True
    t0 = time.perf_counter()
    oneshot_folder(job["folder"], job["out"], batches, method="sparsegpt", sparsity=0.5)
    return {"bound": bound, "headroom": job["headroom"], "base": base, "prune_s": time.perf_counter() - t0}


def child_verify(job: dict) -> dict:
    """Load a folder with plain transformers and digest its tensors."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(job["out"], dtype=torch.bfloat16)
    return {"digest": _digest_state(model.state_dict())}


def child_dist(job: dict) -> "dict | None":
    """One rank of a torchrun launch (or the one process): disk to disk on the first blocks, timed."""
    import torch.distributed as dist

    from prunekit.io.hf_shards import ShardedWeights
    from prunekit.oneshot import oneshot_folder

    group = None
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        dist.init_process_group("gloo")
        group = True
    ids = _calibration()
    batches = [{"input_ids": ids[i:i + 1]} for i in range(ids.shape[0])]
    blocks = [f"model.layers.{i}" for i in range(job["blocks"])]
    t0 = time.perf_counter()
    report = oneshot_folder(job["folder"], job["out"], batches, method="sparsegpt", sparsity=0.5, blocks=blocks,
                            group=group)
    seconds = time.perf_counter() - t0
    out = {"seconds": seconds, "solve_s": sum(r.seconds for r in report.layers)}
    if group is not None:
        rank = dist.get_rank()
        dist.destroy_process_group()
        if rank != 0:
            return None  # rank 0 reports
    from prunekit.io.plain import tensor_bytes

    with ShardedWeights(job["out"]) as w:
        out["digest"] = {n: hashlib.sha256(tensor_bytes(w.read(n))).hexdigest()[:16]
                         for n in w.names() if n.startswith(tuple(b + "." for b in blocks))}
    return out


CHILDREN = {"build": child_build, "prunekit": child_prunekit, "llmc": child_llmc, "limited": child_limited,
            "verify": child_verify, "dist": child_dist}


# ----------------------------------------------------------------------------- the parent
def run(python: str, job: dict, nproc: int = 1, timeout: float = 7200) -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS=str(job.get("threads", 1)), PRUNEKIT_BENCH_CHILD="1",
               TOKENIZERS_PARALLELISM="false")
    if python == sys.executable:
        env["PYTHONPATH"] = os.pathsep.join([os.path.abspath(SRC), env.get("PYTHONPATH", "")])
    argv = [python, os.path.abspath(__file__), "--child", json.dumps(job)]
    if nproc > 1:
        argv = [python, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"] + argv[1:]
    p = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=timeout)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if p.returncode != 0 or not lines:
        text = (p.stderr or p.stdout).splitlines()
        why = [ln for ln in text if "Error" in ln or "error" in ln] or text[-1:] or ["no output"]
        return {"error": f"exit {p.returncode}: {why[-1].strip()[:300]}"}
    return json.loads(lines[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--hidden", type=int, default=1536)
    ap.add_argument("--inter", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--workdir", default=os.path.join("/tmp", "prunekit-bench-scale"))
    ap.add_argument("--limit", type=float, default=0.5, help="address space above the code, x the weights' bytes")
    ap.add_argument("--dist-blocks", type=int, default=4)
    ap.add_argument("--llmc-python", default=os.environ.get("PRUNEKIT_LLMC_PYTHON", "/work/venvs/llmc/bin/python"))
    ap.add_argument("--skip", default="", help="comma-separated rows to leave out: keep,llmc,limited,dist")
    args = ap.parse_args()
    if args.child:
        job = json.loads(args.child)
        result = CHILDREN[job["kind"]](job)
        if result is not None:
            print(json.dumps(result))
        return
    skip = set(filter(None, args.skip.split(",")))
    os.makedirs(args.workdir, exist_ok=True)
    folder = os.path.join(args.workdir, f"llama-{args.hidden}-{args.inter}-{args.layers}")
    built = run(sys.executable, {"kind": "build", "folder": folder + ".new", "hidden": args.hidden,
                                 "inter": args.inter, "layers": args.layers}) if not os.path.isdir(folder) else None
    if built is not None:
        if "error" in built:
            raise SystemExit(built["error"])
        os.replace(folder + ".new", folder)
    tiny = os.path.join(args.workdir, "tiny")
    if not os.path.isdir(tiny):
        run(sys.executable, {"kind": "build", "folder": tiny, "hidden": 64, "inter": 128, "layers": 1})
    weights = sum(os.path.getsize(os.path.join(folder, n)) for n in os.listdir(folder) if n.endswith(".safetensors"))
    print(f"model {folder}: {weights / MIB:.0f} MiB of safetensors")
    print(f"load at start: {load_note()}")

    def fresh(name: str) -> str:
        p = os.path.join(args.workdir, name)
        shutil.rmtree(p, ignore_errors=True)
        return p

    rows, results = [], {}
    jobs = [("prunekit in memory, masks='bake'", sys.executable, {"kind": "prunekit", "mode": "bake"}),
            ("prunekit in memory, masks='keep'", sys.executable, {"kind": "prunekit", "mode": "keep"}),
            ("prunekit disk to disk", sys.executable, {"kind": "prunekit", "mode": "folder", "out": fresh("out-folder")}),
            ("llm-compressor 0.14 (sequential)", args.llmc_python, {"kind": "llmc"})]
    for label, python, job in jobs:
        if ("keep" in label and "keep" in skip) or ("llm" in label and ("llmc" in skip or not os.path.exists(python))):
            rows.append([label, "not run", "", "", "", ""])
            continue
        r = run(python, dict(job, folder=folder))
        results[label] = r
        print(f"  {label}: {json.dumps({k: v for k, v in r.items() if k != 'digest'})[:400]}", flush=True)
        if "error" in r:
            rows.append([label, "failed", "", "", "", r["error"][:100]])
            continue
        rows.append([label, f"{r['peak_bytes'] / MIB:,.0f}", f"{r['peak_bytes'] / weights:.2f}x",
                     f"{r['load_s']:.1f}", f"{r['prune_s']:.1f}", f"{r['prune_s'] / r['blocks']:.2f}"])
    print(table(["run", "peak MiB (model included)", "x weights", "load s", "prune s", "s per block"], rows,
                title=f"SparseGPT 50% on a {weights / MIB:.0f} MiB bfloat16 Llama ({args.layers} blocks), 8 x 128 "
                      f"tokens; {load_note()}"))
    if "prunekit disk to disk" in results and "digest" in results.get("prunekit in memory, masks='bake'", {}):
        v = run(sys.executable, {"kind": "verify", "out": os.path.join(args.workdir, "out-folder")})
        same = v.get("digest") == results["prunekit in memory, masks='bake'"]["digest"]
        print(f"disk to disk output loaded with transformers, every tensor equal to the in-memory result: {same}")
    if "limited" not in skip:
        headroom = int(args.limit * weights)
        fresh("tiny-pruned")
        r = run(sys.executable, {"kind": "limited", "folder": folder, "out": fresh("out-limited"),
                                 "warm": tiny, "headroom": headroom,
                                 "weights_bytes": weights})
        v = run(sys.executable, {"kind": "verify", "out": os.path.join(args.workdir, "out-limited")}) \
            if "error" not in r else {"error": "no output"}
        ref = results.get("prunekit in memory, masks='bake'", {}).get("digest")
        same = "digest" in v and v["digest"] == ref
        print(table(["address space above the code", "the model fits in it", "prune s", "output loads",
                     "equal to in memory"],
                    [[f"{headroom / MIB:,.0f} MiB ({args.limit:g}x weights) above {r.get('base', 0) / MIB:,.0f} MiB",
                      "no" if r.get("bound") else ("yes" if "bound" in r else "?"), f"{r.get('prune_s', 0):.1f}",
                      "yes" if "digest" in v else r.get("error", v.get("error", ""))[:100], "yes" if same else "no"]],
                    title="disk to disk under RLIMIT_AS (glibc mmap threshold 1 MiB), output compared with the "
                          "in-memory result"))
    if "dist" not in skip:
        drows, base = [], None
        for n in (1, 2, 4):
            r = run(sys.executable, {"kind": "dist", "folder": folder, "out": fresh(f"out-dist{n}"),
                                     "blocks": args.dist_blocks}, nproc=n)
            if "error" in r:
                drows.append([n, "failed", "", "", r["error"][:100]])
                continue
            base = base or r
            drows.append([n, f"{r['seconds']:.1f}", f"{base['seconds'] / r['seconds']:.2f}x",
                          "yes" if r["digest"] == base["digest"] else "NO", f"{r['solve_s']:.1f}"])
        print(table(["processes", "wall s", "speed-up", "same tensors as 1 process", "solve s (sum over layers)"],
                    drows, title=f"disk to disk on {args.dist_blocks} blocks, gloo on {os.cpu_count()} cores; "
                                 f"{load_note()}"))
    print(f"load at end: {load_note()}")


if __name__ == "__main__":
    main()
