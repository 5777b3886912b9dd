"""One-shot pruning from disk to disk: a Hugging Face model folder in, a pruned copy out, one block in memory.

:func:`oneshot_folder` builds the model on the ``meta`` device (no weight in
memory; buffers computed as usual), then walks it block by block as
:func:`~prunekit.oneshot.oneshot` does with ``masks="bake"``: each block's
weights are read from the source's safetensors shards as the block enters
(:class:`~prunekit.io.hf_shards.ShardedWeights`: headers validated up front,
then one tensor at a time, never memory-mapped), pruned, written over the
same tensors of the output's shards as it leaves
(:class:`~prunekit.io.hf_shards.ShardPatcher`), and dropped. The modules
before the first block (the embeddings) are read when the calibration first
calls them and dropped before the first block; the output head is never read.

The output folder is a copy of the source's files -- config, tokenizer,
index, shards: the same shard layout, headers and index byte for byte --
with the pruned weights in place, which plain ``transformers`` loads. It is
built beside its final place and appears complete or not at all
(:func:`prunekit.io.folders.atomic_folder`); the source is only read.

With ``group=`` every rank reads the blocks and the ranks share the work as
:mod:`prunekit.oneshot.parallel` says; rank 0 writes the folder.

The folder's tensor names must be the model's own state-dict names (Llama,
Mistral, Qwen2/3, Gemma 1-3, Phi-3, GPT-2, OPT, BERT, RoBERTa, DistilBERT
...). Folders that ``transformers`` converts as it loads them -- its fused
mixture-of-experts tensors (Mixtral, Qwen-MoE), renamed keys (ViT) -- are
refused with the first missing name.
"""

from __future__ import annotations

import errno
import logging
import os
import time
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from ..io.folders import atomic_folder
from ..io.hf_shards import ShardedWeights, ShardPatcher, copy_model_files
from .api import plan_walk, run_walk
from .blocks import pre_hooks
from .layers import Patterns, Target
from .report import OneshotReport
from .walk import BlockCycle

__all__ = ["oneshot_folder", "empty_model"]

logger = logging.getLogger(__name__)


def oneshot_folder(
    src: Any, out: Any, calibration: Iterable[Any], *, sparsity: float = 0.5, pattern: str = "unstructured",
    method: str = "prunekit", targets: Patterns = None, ignore: Patterns = None, tokenizer: Any = "auto",
    blocks: Any = None, device: Any = None, batch_size: int = 16, max_length: int = 128,
    options: Optional[Dict[str, Any]] = None, progress: Optional[Callable[[int, int, str], None]] = None,
    group: Any = None,
) -> OneshotReport:
    """Prune the Hugging Face model folder ``src`` into the new folder ``out``, reading and writing one block
    at a time: the weights of the model are never all in memory.

    The arguments are :func:`~prunekit.oneshot.oneshot`'s (the result is its ``masks="bake"``: plain weights
    with zeros, bit for bit what the in-memory call gives the model ``from_pretrained`` loads from ``src``).
    ``tokenizer="auto"`` loads ``src``'s tokenizer when the calibration is text.

    Raises ``FileExistsError`` when ``out`` exists (nothing is written over a folder), ``ValueError``
    (:class:`~prunekit.io.UnreadableFileError`) naming the file when ``src`` holds no safetensors weights,
    a shard is truncated or its header or the index lies, and ``ValueError`` when the model has no
    repeated blocks or its tensors do not match the files. On any failure ``out`` does not exist.

    Examples:
        >>> import os, tempfile, torch, transformers, prunekit
        >>> from prunekit.oneshot import oneshot_folder
        >>> cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64,
        ...                                num_attention_heads=4, vocab_size=64)
        >>> src, out = tempfile.mkdtemp(), os.path.join(tempfile.mkdtemp(), "pruned")
        >>> transformers.LlamaForCausalLM(cfg).save_pretrained(src)
        >>> calibration = [{"input_ids": torch.randint(0, 64, (2, 16))} for _ in range(2)]
        >>> report = oneshot_folder(src, out, calibration, method="sparsegpt")
        >>> pruned = transformers.LlamaForCausalLM.from_pretrained(out)
        >>> len(report.layers), float((pruned.model.layers[1].mlp.up_proj.weight == 0).float().mean())
        (14, 0.5)
    """
    t_start = time.perf_counter()
    src_s, out_s = os.fspath(src), os.fspath(out)
    _check_out(src_s, out_s)
    with ShardedWeights(src_s) as weights:
        model = empty_model(src_s)
        if tokenizer == "auto":
            tokenizer = _tokenizer_for(src_s, calibration)
        plan = plan_walk(model, calibration, sparsity=sparsity, pattern=pattern, method=method, targets=targets,
                         ignore=ignore, tokenizer=tokenizer, blocks=blocks, device=device, batch_size=batch_size,
                         max_length=max_length, options=options, progress=progress, group=group)
        _check_names(model, plan.blocks, weights)
        walk = plan.walk
        walk.bake = True
        writer = walk.par.rank == 0
        if writer:
            with atomic_folder(out_s) as tmp:
                copy_model_files(src_s, tmp)
                with ShardPatcher(tmp, weights) as patcher:
                    _walk_from_disk(model, plan, weights, patcher)
        else:
            _walk_from_disk(model, plan, weights, None)
        walk.par.sum_int(1)  # every rank returns once the folder is in place
    walk.report.seconds = time.perf_counter() - t_start
    logger.info("%s", walk.report)
    return walk.report


def _check_out(src: str, out: str) -> None:
    if os.path.lexists(out):
        raise FileExistsError(errno.EEXIST, "exists; oneshot writes a new folder and never replaces one: give a "
                              "new name or remove it first", out)
    real_src, real_parent = os.path.realpath(src), os.path.realpath(os.path.dirname(os.path.abspath(out)))
    if real_parent == real_src or real_parent.startswith(real_src + os.sep):
        raise ValueError(f"out={out!r} lies inside the source folder {src!r}; write the pruned model elsewhere")


def empty_model(folder: str) -> nn.Module:
    """The model of the Hugging Face folder ``folder`` built from its config without any weight: parameters on
    the ``meta`` device, buffers computed on the CPU as ``from_pretrained`` computes them.

    The class is the config's first ``architectures`` entry (else ``AutoModelForCausalLM``, else ``AutoModel``).
    """
    try:
        import transformers
        from accelerate import init_empty_weights
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("oneshot_folder needs transformers and accelerate: pip install 'prunekit[hf]'") from e
    config = transformers.AutoConfig.from_pretrained(folder)
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    arch = (getattr(config, "architectures", None) or [None])[0]
    cls = getattr(transformers, arch, None) if isinstance(arch, str) else None
    kwargs = {"dtype": dtype} if isinstance(dtype, torch.dtype) else {}
    with init_empty_weights(include_buffers=False):
        if cls is not None:
            return cls._from_config(config, **kwargs)
        try:
            return transformers.AutoModelForCausalLM.from_config(config, **kwargs)
        except ValueError:
            return transformers.AutoModel.from_config(config, **kwargs)


def _tokenizer_for(folder: str, calibration: Iterable[Any]) -> Any:
    if not isinstance(calibration, (list, tuple)) or not calibration or not all(isinstance(x, str) for x in calibration):
        return None
    import transformers

    return transformers.AutoTokenizer.from_pretrained(folder)


#: one tensor of a module read from the shards: (module, its key on the module, its name in the files, a parameter?)
Item = Tuple[nn.Module, str, str, bool]


def _tensors(module: nn.Module, prefix: str, weights: ShardedWeights) -> List[Item]:
    """``(owner module, attribute, full name, is parameter)`` of every parameter under ``module`` and every
    persistent buffer the folder's files hold (a shared tensor once)."""
    out, seen = [], set()
    for mname, m in module.named_modules(prefix=prefix):
        for key, p in m._parameters.items():
            if p is not None and id(p) not in seen:
                seen.add(id(p))
                out.append((m, key, f"{mname}.{key}" if mname else key, True))
        for key, b in m._buffers.items():
            full = f"{mname}.{key}" if mname else key
            if b is not None and key not in m._non_persistent_buffers_set and id(b) not in seen and full in weights:
                seen.add(id(b))
                out.append((m, key, full, False))
    return out


def _check_names(model: nn.Module, block_list: List[Tuple[str, nn.Module]], weights: ShardedWeights) -> None:
    """Every tensor of every block is in the folder's files, with its shape."""
    for bname, block in block_list:
        for m, key, full, _ in _tensors(block, bname, weights):
            if full not in weights:
                raise ValueError(f"{type(model).__name__} has tensor {full!r}, which the safetensors files of "
                                 f"{weights.folder} do not hold: the files name the model's tensors otherwise (a "
                                 "folder of another class, or a layout transformers converts as it loads -- fused "
                                 "mixture-of-experts weights, renamed keys); oneshot_folder reads folders whose "
                                 "tensor names are the model's own: prune the model from_pretrained loads instead")
            shape = weights.entry(full)[1]
            t = getattr(m, key)
            if list(t.shape) != shape:
                raise ValueError(f"{weights.folder}: tensor {full!r} has shape {shape}; {type(model).__name__} "
                                 f"expects {list(t.shape)}")


def _current(m: nn.Module, key: str, is_param: bool) -> Tensor:
    t = m._parameters[key] if is_param else m._buffers[key]
    if t is None:
        raise ValueError(f"{type(m).__name__}.{key} is None: the folder holds a tensor the module does not have")
    return t


def _load(items: Sequence[Item], weights: ShardedWeights) -> None:
    for m, key, full, is_param in items:
        t = weights.read(full)
        if is_param:
            m._parameters[key] = nn.Parameter(t, requires_grad=_current(m, key, True).requires_grad)
        else:
            m._buffers[key] = t


def _drop(items: Sequence[Item]) -> None:
    for m, key, _, is_param in items:
        old = _current(m, key, is_param)
        empty = torch.empty(old.shape, dtype=old.dtype, device="meta")
        if is_param:
            m._parameters[key] = nn.Parameter(empty, requires_grad=old.requires_grad)
        else:
            m._buffers[key] = empty


class FolderCycle(BlockCycle):
    """A block read from the source's shards as it enters; written to the output's shards (``patcher``, on the
    writing rank) and dropped as it leaves. The modules outside the blocks read for the calibration are
    dropped as the first block enters."""

    def __init__(self, weights: ShardedWeights, patcher: Optional[ShardPatcher], outside: List[Any]) -> None:
        self.weights, self.patcher, self.outside = weights, patcher, outside
        self.items: List[Item] = []

    def enter(self, index: int, name: str, block: nn.Module, mine: List[Target]) -> None:
        while self.outside:
            _drop(self.outside.pop())
        self.items = _tensors(block, name, self.weights)
        _load(self.items, self.weights)

    def leave(self, index: int, name: str, block: nn.Module, mine: List[Target]) -> None:
        if self.patcher is not None:
            params: Dict[str, Tensor] = {}
            for t in mine:  # an expert's slice: its whole 3-D parameter, written once
                params.setdefault(t.key, t.param)
            for key, p in params.items():
                self.patcher.write(key, p.detach())
        _drop(self.items)
        self.items = []


def _walk_from_disk(model: nn.Module, plan: Any, weights: ShardedWeights, patcher: Optional[ShardPatcher]) -> None:
    in_blocks = {id(m) for _, b in plan.blocks for m in b.modules()}
    names = {id(m): n for n, m in model.named_modules()}
    loaded: List[Any] = []

    def loader(m: nn.Module) -> Callable[..., None]:
        def hook(_m: nn.Module, _args: Any) -> None:
            items = [(o, k, f, p) for o, k, f, p in _tensors(m, names[id(m)], weights) if o is m and p
                     and _current(o, k, True).device.type == "meta"]
            if items:
                _load(items, weights)
                loaded.append(items)
        return hook

    # modules outside the blocks with weights of their own: read when the calibration first calls them
    outside = [m for m in model.modules() if id(m) not in in_blocks
               and any(p is not None and p.device.type == "meta" for p in m._parameters.values())]
    plan.walk.cycle = FolderCycle(weights, patcher, loaded)
    try:
        with pre_hooks([(m, loader(m)) for m in outside]):
            run_walk(model, plan.blocks, plan.layers, plan.batches, plan.walk)
    finally:
        while loaded:
            _drop(loaded.pop())
