"""prunekit.oneshot.oneshot_folder: a Hugging Face folder pruned into a new one, one block in memory, bit for bit
the in-memory result; bad folders refused by name; nothing written on failure; the source never touched."""

import hashlib
import json
import os
import subprocess
import sys

import pytest
import torch

import prunekit
from prunekit.io import UnreadableFileError
from prunekit.oneshot import oneshot_folder

transformers = pytest.importorskip("transformers", reason="transformers is not installed")
pytest.importorskip("accelerate", reason="accelerate is not installed")
pytestmark = pytest.mark.hf

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.join(HERE, "..", "..", "src")


def _save_llama(folder, *, layers=3, hidden=32, inter=64, vocab=64, shard="20KB", dtype=torch.bfloat16, seed=0):
    cfg = transformers.LlamaConfig(num_hidden_layers=layers, hidden_size=hidden, intermediate_size=inter,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=vocab,
                                   max_position_embeddings=64, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg).to(dtype)
    model.save_pretrained(folder, max_shard_size=shard)
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:  # a file beside the weights, copied as is
        json.dump({"model_max_length": 64}, f)
    return folder


def _batches(n=3, vocab=64, tokens=12, seed=1):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        mask = torch.ones(2, tokens, dtype=torch.long)
        mask[1, -3:] = 0  # padding, left out of the statistics
        out.append({"input_ids": torch.randint(0, vocab, (2, tokens), generator=g), "attention_mask": mask})
    return out


def _digest(folder):
    return {n: hashlib.sha256(open(os.path.join(folder, n), "rb").read()).hexdigest() for n in sorted(os.listdir(folder))}


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    folder = _save_llama(str(tmp_path_factory.mktemp("src") / "llama"))
    assert sum(n.endswith(".safetensors") for n in os.listdir(folder)) >= 3  # sharded, with an index
    return folder


@pytest.mark.parametrize("method", ["magnitude", "wanda", "sparsegpt", "prunekit"])
def test_disk_to_disk_is_the_in_memory_result_bit_for_bit(src, tmp_path, method):
    before = _digest(src)
    out = str(tmp_path / "pruned")
    rd = oneshot_folder(src, out, _batches(), sparsity=0.5, method=method)
    model = transformers.LlamaForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
    rm = prunekit.oneshot(model, _batches(), sparsity=0.5, method=method, masks="bake")
    assert _digest(src) == before  # the source is only read
    assert [(r.name, r.pruned, r.error) for r in rd.layers] == [(r.name, r.pruned, r.error) for r in rm.layers]
    assert len(rd.layers) == 21 and (rd.samples, rd.tokens) == (rm.samples, rm.tokens)
    loaded = transformers.LlamaForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
    want, got = model.state_dict(), loaded.state_dict()
    assert list(got) == list(want)
    for k in want:
        assert torch.equal(got[k].view(torch.int16), want[k].view(torch.int16)), k  # bit for bit
    # the same files, shard layout and index; only the pruned tensors' bytes differ
    assert sorted(os.listdir(out)) == sorted(os.listdir(src))
    for name in ("config.json", "tokenizer_config.json", "model.safetensors.index.json"):
        assert open(os.path.join(out, name), "rb").read() == open(os.path.join(src, name), "rb").read()


def test_the_writing_rank_builds_the_folder_beside_its_place_and_leaves_nothing_on_failure(src, tmp_path, monkeypatch):
    from prunekit.oneshot import folder

    calls = {"n": 0}
    real = folder.ShardPatcher.write

    def failing(self, name, t):
        calls["n"] += 1
        if calls["n"] == 10:  # the second block
            raise KeyboardInterrupt
        return real(self, name, t)

    monkeypatch.setattr(folder.ShardPatcher, "write", failing)
    before = _digest(src)
    with pytest.raises(KeyboardInterrupt):
        oneshot_folder(src, str(tmp_path / "pruned"), _batches(), method="wanda")
    assert os.listdir(tmp_path) == [] and _digest(src) == before


def test_bad_folders_are_refused_by_name_and_nothing_is_written(src, tmp_path):
    import shutil

    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(FileExistsError, match="never replaces one"):
        oneshot_folder(src, str(out), _batches())
    assert os.listdir(out) == []
    with pytest.raises(ValueError, match="lies inside the source folder"):
        oneshot_folder(src, os.path.join(src, "pruned"), _batches())

    def copy(name):
        d = str(tmp_path / name)
        shutil.copytree(src, d)
        return d

    no_weights = copy("no-weights")
    for n in os.listdir(no_weights):
        if "safetensors" in n:
            os.remove(os.path.join(no_weights, n))
    with pytest.raises(UnreadableFileError, match="no model.safetensors and no model.safetensors.index.json"):
        oneshot_folder(no_weights, str(tmp_path / "a"), _batches())

    truncated = copy("truncated")
    shard = os.path.join(truncated, sorted(n for n in os.listdir(truncated) if n.endswith(".safetensors"))[1])
    with open(shard, "r+b") as f:
        f.truncate(os.path.getsize(shard) - 100)
    with pytest.raises(UnreadableFileError, match=rf"{shard}: .*(truncated|buffer)"):
        oneshot_folder(truncated, str(tmp_path / "b"), _batches())

    lying = copy("lying")
    shard = os.path.join(lying, sorted(n for n in os.listdir(lying) if n.endswith(".safetensors"))[0])
    raw = open(shard, "rb").read()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    first = next(k for k in header if k != "__metadata__")
    header[first]["shape"] = [s * 2 for s in header[first]["shape"]]  # the header claims more than it holds
    text = json.dumps(header).encode()
    text += b" " * (n - len(text)) if len(text) <= n else b""
    with open(shard, "wb") as f:
        f.write(len(text).to_bytes(8, "little") + text + raw[8 + n:])
    with pytest.raises(UnreadableFileError, match=rf"{shard}: tensor {first!r}"):
        oneshot_folder(lying, str(tmp_path / "c"), _batches())

    index = copy("index-lies")
    path = os.path.join(index, "model.safetensors.index.json")
    data = json.load(open(path))
    key = next(iter(data["weight_map"]))
    data["weight_map"][key] = "model-elsewhere.safetensors"
    json.dump(data, open(path, "w"))
    with pytest.raises((UnreadableFileError, FileNotFoundError), match="model-elsewhere.safetensors"):
        oneshot_folder(index, str(tmp_path / "d"), _batches())

    other = str(tmp_path / "other-class")  # the weights of the bare LlamaModel under a LlamaForCausalLM config
    transformers.LlamaForCausalLM.from_pretrained(src).model.save_pretrained(other)
    cfg = json.load(open(os.path.join(other, "config.json")))
    cfg["architectures"] = ["LlamaForCausalLM"]
    json.dump(cfg, open(os.path.join(other, "config.json"), "w"))
    with pytest.raises(ValueError, match="has tensor 'model.layers.0.self_attn.q_proj.weight', which the safetensors"):
        oneshot_folder(other, str(tmp_path / "e"), _batches())

    with pytest.raises(ValueError, match="no module of that class"):
        oneshot_folder(src, str(tmp_path / "f"), _batches(), blocks="NotABlock")
    assert sorted(os.listdir(tmp_path)) == ["index-lies", "lying", "no-weights", "other-class", "out", "truncated"]


@pytest.mark.parametrize("family", ["gpt2", "opt", "qwen3", "phi3", "gemma2", "bert", "mixtral"])
def test_other_families_or_a_clear_refusal(tmp_path, family):
    from helpers.shrink_models import batches, build

    model = build(family)
    model.save_pretrained(tmp_path / "src")
    if family == "mixtral":  # transformers stores its fused experts per expert: other names than the model's
        with pytest.raises(ValueError, match="has tensor 'model.layers.0.mlp.gate.weight', which the safetensors"):
            oneshot_folder(tmp_path / "src", tmp_path / "out", batches(family), method="wanda")
        assert sorted(os.listdir(tmp_path)) == ["src"]
        return
    rd = oneshot_folder(tmp_path / "src", tmp_path / "out", batches(family), method="wanda")
    ref = type(model).from_pretrained(tmp_path / "src")
    rm = prunekit.oneshot(ref, batches(family), method="wanda", masks="bake")
    assert [(r.name, r.pruned) for r in rd.layers] == [(r.name, r.pruned) for r in rm.layers] and rd.layers
    got = type(model).from_pretrained(tmp_path / "out").state_dict()
    assert all(torch.equal(got[k], v) for k, v in ref.state_dict().items())


_LIMITED = """
import os, resource, sys, torch
sys.path.insert(0, {tests!r})
from test_oneshot_folder import _batches
import transformers, accelerate, safetensors
from prunekit.oneshot import oneshot_folder
torch.set_num_threads(1)

def status(key):
    return int(next(l for l in open("/proc/self/status") if l.startswith(key)).split()[1]) * 1024

def report(at_limit):  # what held the address space when an allocation failed
    resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    maps = []
    for line in open("/proc/self/maps"):
        parts = line.split()
        lo, hi = (int(x, 16) for x in parts[0].split("-"))
        maps.append((hi - lo, parts[1], parts[5] if len(parts) > 5 else "[anon]"))
    big = ", ".join(f"{{n >> 10}} KiB {{perm}} {{name}}" for n, perm, name in sorted(maps, reverse=True)[:8])
    print(f"VmSize at the limit {{at_limit >> 20}} MiB, now {{status('VmSize') >> 20}} MiB, "
          f"threads {{len(os.listdir('/proc/self/task'))}}; largest mappings: {{big}}", file=sys.stderr)

# every code path imported (transformers imports lazily) before the limit: it bounds data, not code
oneshot_folder({warm!r}, {warm!r} + "-pruned", _batches(4, vocab=256, tokens=16), method="sparsegpt")
at_limit = status("VmSize")
resource.setrlimit(resource.RLIMIT_AS, (at_limit + {headroom}, resource.RLIM_INFINITY))
try:
    torch.empty({model_bytes} // 4, dtype=torch.float32)  # the model's bytes cannot be had at once
    print("the limit does not bind")
    sys.exit(3)
except (MemoryError, RuntimeError):
    pass
try:
    oneshot_folder({src!r}, {out!r}, _batches(4, vocab=256, tokens=16), method="sparsegpt")
except BaseException:
    report(at_limit)
    raise
print("peak", status("VmPeak") - at_limit)
"""

# RLIMIT_AS counts address space, not resident memory. glibc's allocator is pinned so that the count follows the
# data: one arena (no per-thread 64 MiB reservations), every block of 64 KiB and more mapped and unmapped on
# its own (the threshold fixed, not adaptive), freed heap given back. The settings hold from the first
# allocation on, in the warm-up as under the limit; an allocator preloaded in the environment is left out.
_MALLOC = {"MALLOC_ARENA_MAX": "1", "MALLOC_MMAP_THRESHOLD_": str(64 * 1024), "MALLOC_TRIM_THRESHOLD_": str(128 * 1024)}


@pytest.mark.slow
@pytest.mark.usefixtures("one_thread")  # as the limited process computes: the same sums in the same order
def test_a_model_larger_than_the_memory_the_process_may_use_is_pruned_disk_to_disk(tmp_path):
    src = _save_llama(str(tmp_path / "big"), layers=48, hidden=256, inter=704, vocab=256, shard="8MB")
    model_bytes = sum(os.path.getsize(os.path.join(src, n)) for n in os.listdir(src) if n.endswith(".safetensors"))
    headroom = 40 * 2 ** 20  # what the process may allocate beyond what it holds once its code is loaded
    assert model_bytes > headroom * 1.5
    warm = _save_llama(str(tmp_path / "warm-up"), layers=1, hidden=64, inter=128, vocab=256)
    out = str(tmp_path / "pruned")
    code = _LIMITED.format(tests=HERE, warm=warm, headroom=headroom, model_bytes=model_bytes, src=src, out=out)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=SRC, HF_HUB_OFFLINE="1", PYTHONHASHSEED="0", **_MALLOC)
    env.pop("LD_PRELOAD", None)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=900)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    model = transformers.LlamaForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
    prunekit.oneshot(model, _batches(4, vocab=256, tokens=16), method="sparsegpt", masks="bake")
    loaded = transformers.LlamaForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
    want, got = model.state_dict(), loaded.state_dict()
    assert all(torch.equal(got[k].view(torch.int16), want[k].view(torch.int16)) for k in want)
