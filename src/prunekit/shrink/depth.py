"""Depth: whole transformer blocks ranked on calibration data, skipped for scoring, and removed.

* :func:`block_influence` -- each block's ``1 - cos(input, output)`` of the hidden state, averaged
  over the real tokens of the calibration batches (ShortGPT's block influence; Minitron's depth
  metric). A block that leaves the stream unchanged scores 0: the first to remove.
* :func:`layer_loss_importance` -- how much the calibration :class:`~prunekit.shrink.calibration.Objective`
  (next-token loss of a language model, ``1 - cosine`` to the dense outputs otherwise) rises when
  that one block alone is skipped (the loss-based variant).
* :func:`skipped_layers` -- a context manager under which the given blocks pass their input hidden
  state through unchanged. The kept blocks run the same operations on the same inputs as after
  :func:`remove_layers` of the same indices, so the model's output is equal bit for bit (only the
  skipped blocks' results are thrown away; they still run, so a KV cache keeps one entry per
  block, and per-block extras such as attention weights or router logits still count every block).
* :func:`remove_layers` -- the blocks taken out of the model in place, failure-atomic.

Rules :func:`remove_layers` keeps (checked before anything changes; a removal the config cannot
express is a ``ValueError`` and the model is left as it was):

* the block ``nn.ModuleList`` keeps the kept blocks in order; the config's layer count
  (``HFFamily.layers_key``) and an equal count on the list's owner (DistilBERT's ``n_layers``)
  become the new count; every ``layer_idx`` attribute in a kept block (the KV-cache slot) is
  renumbered ``0..n-1``;
* per-layer config lists (``layer_types``, ``mlp_layer_types``, ``no_rope_layers``, a per-layer
  ``sliding_window``) keep the entries of the kept blocks; lists of layer indices
  (``mlp_only_layers``) are renumbered and lose the removed blocks;
* ``max_window_layers`` (Qwen: blocks from that index on use sliding windows) becomes the number of
  kept blocks below it, so each kept block keeps its kind; left as it is when it covers every block;
* ``decoder_sparse_step`` (Qwen-MoE: block ``i`` is sparse when ``(i + 1) % step == 0`` and ``i``
  is not in ``mlp_only_layers``) stays when the renumbered blocks keep their kind under it, else
  becomes 1 with every kept dense block listed in ``mlp_only_layers`` -- always expressible;
* GPT-2 with ``scale_attn_by_inverse_layer_idx`` scales block ``i``'s attention by ``1/(i+1)``:
  only removals that renumber no kept block (the last blocks) are allowed;
* any other list in the config whose key names layers is refused (its meaning is unknown here).
"""

from __future__ import annotations

import contextlib
import logging
import operator
from collections import OrderedDict
from typing import Any, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..transaction import Transaction, atomic, finish, run_then_clean
from .calibration import Objective, as_batches, forward, token_mask
from .families import family_of, layer_list

__all__ = ["block_influence", "layer_loss_importance", "remove_layers", "skipped_layers"]

logger = logging.getLogger(__name__)

#: config keys holding one entry per block: the kept blocks' entries stay
_PER_LAYER = ("layer_types", "mlp_layer_types", "no_rope_layers", "sliding_window")
#: config keys holding block indices: renumbered, removed blocks dropped
_INDEX_LISTS = ("mlp_only_layers",)
#: attributes of the block list's owner that repeat the block count
_COUNT_ATTRS = ("n_layers", "n_layer", "num_layers", "num_hidden_layers")


# ------------------------------------------------------------------ indices
def _indices(indices: Iterable[Any], n: int, name: str, what: str, allow_all: bool = False) -> Tuple[int, ...]:
    """``indices`` checked against a list of ``n`` blocks: sorted, unique ints in range."""
    if isinstance(indices, (int, str, bytes, Tensor)) and not (isinstance(indices, Tensor) and indices.dim() == 1):
        raise TypeError(f"{what}: indices must be a list of block indices, got {indices!r}; write e.g. [1, 2] "
                        "(a list even for one block)")
    try:
        items = list(indices)
    except TypeError:
        raise TypeError(f"{what}: indices must be a list of block indices, got {type(indices).__name__}; "
                        "write e.g. [1, 2]") from None
    seen: List[int] = []
    for item in items:
        try:
            if isinstance(item, bool):
                raise TypeError
            i = operator.index(item)
        except TypeError:
            raise TypeError(f"{what}: block index {item!r} ({type(item).__name__}) is not an int; write the "
                            f"blocks of {name} as ints 0..{n - 1}, e.g. [1, 2]") from None
        if not 0 <= i < n:
            raise IndexError(f"{what}: block index {i} is out of range: {name} has {n} blocks; write indices "
                             f"0..{n - 1}" + (f" ({n + i} for {i})" if -n <= i < 0 else ""))
        if i in seen:
            raise ValueError(f"{what}: block index {i} is given twice in {items!r}; name each block once")
        seen.append(i)
    if len(seen) == n and not allow_all:
        raise ValueError(f"{what}: removing all {n} blocks of {name} leaves none; keep at least one (name at most "
                         f"{n - 1} of them)")
    return tuple(sorted(seen))


# ------------------------------------------------------------------ hidden states of a block
def _hidden_in(args: Tuple[Any, ...], kwargs: Dict[str, Any], block: nn.Module) -> Tensor:
    """The hidden state a block was called with: its first argument or ``hidden_states=``."""
    x = args[0] if args else kwargs.get("hidden_states")
    if not isinstance(x, Tensor):
        raise TypeError(f"prunekit.shrink: block {type(block).__name__} was not called with a hidden-state tensor "
                        "(first argument or hidden_states=); its family's layout is not supported for depth")
    return x


def _hidden_out(output: Any, block: nn.Module) -> Tensor:
    """The hidden state a block returned: the tensor, or the first item of its tuple."""
    y = output[0] if isinstance(output, (tuple, list)) and output else output
    if not isinstance(y, Tensor):
        raise TypeError(f"prunekit.shrink: block {type(block).__name__} returned {type(output).__name__}, not a "
                        "hidden-state tensor or a tuple starting with one")
    return y


def _pass_through(block: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any], output: Any) -> Any:
    """Forward hook: the block's output with its hidden state replaced by its input (extras kept)."""
    x = _hidden_in(args, kwargs, block)
    if isinstance(output, Tensor):
        return x
    _hidden_out(output, block)
    return type(output)([x, *output[1:]]) if isinstance(output, list) else (x, *output[1:])


@contextlib.contextmanager
def skipped_layers(model: nn.Module, indices: Iterable[int]) -> Iterator[nn.Module]:
    """Within the block, the model runs as if blocks ``indices`` were removed (they pass their input on).

    A forward hook on each named block replaces its output hidden state (a tensor, or the first item
    of a tuple; other items are kept) by its input. The output equals, bit for bit, that of the model
    after :func:`remove_layers` of the same indices: the kept blocks see the same inputs and run the
    same operations. Hooks are removed however the block ends. Yields the model. Indices are
    checked as :func:`remove_layers` checks them; a removal its config cannot express (see the
    module docstring) is refused only by :func:`remove_layers`, so scores stay available for it.

    Examples:
        >>> import torch, transformers
        >>> cfg = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
        ...                                num_hidden_layers=3, num_attention_heads=2)
        >>> torch.manual_seed(0); model = transformers.LlamaForCausalLM(cfg).eval()
        <torch._C.Generator object at ...>
        >>> ids = torch.tensor([[1, 5, 7, 2]])
        >>> with skipped_layers(model, [1]):
        ...     skipped = model(input_ids=ids).logits
        >>> remove_layers(model, [1])
        >>> torch.equal(skipped, model(input_ids=ids).logits)
        True
    """
    name, blocks = layer_list(model, "prunekit.shrink.skipped_layers")
    chosen = _indices(indices, len(blocks), name, "prunekit.shrink.skipped_layers")
    handles: List[Any] = []

    def cleanup() -> None:
        while handles:
            handles.pop().remove()

    try:
        for i in chosen:
            handles.append(blocks[i].register_forward_hook(_pass_through, with_kwargs=True))
        yield model
    finally:
        finish(cleanup)


# ------------------------------------------------------------------ importance
def _in_eval(model: nn.Module, body: Any) -> Any:
    """``body()`` with the model in eval mode; every module's train/eval flag restored after."""
    modes = [(m, m.training) for m in model.modules()]

    def restore() -> None:
        for m, training in modes:
            m.training = training

    def run() -> Any:
        model.eval()
        return body()

    return run_then_clean(run, restore)


def block_influence(model: nn.Module, calibration: Iterable[Any]) -> Tensor:
    """Each block's ``1 - cos(input, output)`` of the hidden state, averaged over real tokens (float64).

    Shape ``[num_blocks]``; higher means the block changes the residual stream more. Tokens whose
    ``attention_mask`` is 0 are left out. One forward pass per batch, in eval mode (the train/eval
    flags are restored), with forward hooks on the blocks that are removed however the call ends.

    Examples:
        >>> import torch, transformers
        >>> cfg = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
        ...                                num_hidden_layers=3, num_attention_heads=2)
        >>> torch.manual_seed(0); model = transformers.LlamaForCausalLM(cfg)
        <torch._C.Generator object at ...>
        >>> scores = block_influence(model, [{"input_ids": torch.tensor([[1, 5, 7, 2]])}])
        >>> scores.shape, scores.dtype, bool(torch.isfinite(scores).all())
        (torch.Size([3]), torch.float64, True)
    """
    what = "prunekit.shrink.block_influence"
    batches = as_batches(calibration, what)
    name, blocks = layer_list(model, what)
    n = len(blocks)
    sums = torch.zeros(n, dtype=torch.float64)
    counts = torch.zeros(n, dtype=torch.float64)
    mask: List[Any] = [None]
    handles: List[Any] = []

    def hook(i: int) -> Any:
        def record(block: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any], output: Any) -> None:
            x, y = _hidden_in(args, kwargs, block), _hidden_out(output, block)
            with torch.no_grad():
                lost = 1.0 - F.cosine_similarity(x.detach().double(), y.detach().double(), dim=-1)
                keep = mask[0]
                if keep is not None and keep.shape == lost.shape:
                    lost = lost[keep.to(lost.device)]
                sums[i] += float(lost.sum())
                counts[i] += lost.numel()
        return record

    def cleanup() -> None:
        while handles:
            handles.pop().remove()

    def run() -> None:
        for i, block in enumerate(blocks):
            handles.append(block.register_forward_hook(hook(i), with_kwargs=True))
        for batch in batches:
            mask[0] = token_mask(batch)
            forward(model, batch)

    _in_eval(model, lambda: run_then_clean(run, cleanup))
    if bool((counts == 0).any()):
        missing = [i for i in range(n) if counts[i] == 0]
        raise ValueError(f"{what}: blocks {missing} of {name} saw no real token on the calibration batches; give "
                         "batches whose attention_mask has ones")
    return sums / counts


def layer_loss_importance(model: nn.Module, calibration: Iterable[Any]) -> Tensor:
    """How much the calibration objective rises when each block alone is skipped (float64, ``[num_blocks]``).

    The :class:`~prunekit.shrink.calibration.Objective` is built once from the model as it is (next-
    token cross-entropy for a language model, ``1 - cosine`` to its own outputs otherwise); block
    ``i`` scores ``objective(model with block i skipped) - objective(model)``. Higher means the
    block matters more. Runs in eval mode; the train/eval flags are restored.

    Examples:
        >>> import torch, transformers
        >>> cfg = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
        ...                                num_hidden_layers=3, num_attention_heads=2)
        >>> torch.manual_seed(0); model = transformers.LlamaForCausalLM(cfg)
        <torch._C.Generator object at ...>
        >>> scores = layer_loss_importance(model, [{"input_ids": torch.tensor([[1, 5, 7, 2]])}])
        >>> scores.shape, scores.dtype
        (torch.Size([3]), torch.float64)
    """
    what = "prunekit.shrink.layer_loss_importance"
    batches = as_batches(calibration, what)
    _, blocks = layer_list(model, what)

    def run() -> List[float]:
        objective = Objective(model, batches)
        base = objective(model)
        scores = []
        for i in range(len(blocks)):
            with skipped_layers(model, [i]):
                scores.append(objective(model) - base)
        return scores

    return torch.tensor(_in_eval(model, run), dtype=torch.float64)


# ------------------------------------------------------------------ removal: the config
def _renumber(kept: Sequence[int]) -> Dict[int, int]:
    return {old: new for new, old in enumerate(kept)}


def _qwen_sparse_step(config: Any, n: int, kept: Sequence[int], updates: Dict[str, Any]) -> None:
    """Keep which kept blocks are sparse MoE (``decoder_sparse_step`` / ``mlp_only_layers``) expressible."""
    step = getattr(config, "decoder_sparse_step", None)
    experts = getattr(config, "num_experts", None)
    if not isinstance(step, int) or isinstance(step, bool) or step < 1 or not isinstance(experts, int):
        return
    only = set(getattr(config, "mlp_only_layers", None) or ())

    def sparse(i: int, step: int, only: Any) -> bool:
        return i not in only and experts > 0 and (i + 1) % step == 0

    was = [sparse(i, step, only) for i in kept]
    new_only = updates.get("mlp_only_layers", getattr(config, "mlp_only_layers", None)) or []
    if [sparse(j, step, set(new_only)) for j in range(len(kept))] == was:
        return
    updates["decoder_sparse_step"] = 1
    updates["mlp_only_layers"] = [j for j, s in enumerate(was) if not s]


def _config_updates(model: nn.Module, name: str, n: int, kept: Sequence[int], what: str) -> Dict[str, Any]:
    """The config values that change when only blocks ``kept`` (of ``n``) stay; ValueError if inexpressible."""
    config = model.config
    _, family = family_of(model, what)
    updates: Dict[str, Any] = {family.layers_key: len(kept)}
    new_index = _renumber(kept)
    renumbers = list(kept) != list(range(len(kept)))
    handled = set(_PER_LAYER) | set(_INDEX_LISTS)
    for key in _PER_LAYER:
        value = getattr(config, key, None)
        if isinstance(value, (list, tuple)):
            if len(value) != n:
                raise ValueError(f"{what}: config.{key} has {len(value)} entries for the {n} blocks of {name}; "
                                 f"make it one entry per block before removing blocks")
            updates[key] = type(value)(value[i] for i in kept)
    for key in _INDEX_LISTS:
        value = getattr(config, key, None)
        if isinstance(value, (list, tuple)):
            updates[key] = type(value)(new_index[i] for i in value if i in new_index)
    window = getattr(config, "max_window_layers", None)
    if isinstance(window, int) and not isinstance(window, bool) and window < n:
        updates["max_window_layers"] = sum(1 for i in kept if i < window)
    _qwen_sparse_step(config, n, kept, updates)
    if getattr(config, "scale_attn_by_inverse_layer_idx", False) and renumbers:
        moved = {i: j for i, j in new_index.items() if i != j}
        raise ValueError(f"{what}: config.scale_attn_by_inverse_layer_idx scales the attention of block i by "
                         f"1/(i+1), and this removal renumbers blocks {moved} (old -> new), which the config "
                         f"cannot express; remove only the last blocks of {name}, or set "
                         "scale_attn_by_inverse_layer_idx=False on a model trained without it")
    for key in _config_keys(config):
        value = getattr(config, key, None)
        if key not in handled and "layer" in key and isinstance(value, (list, tuple)):
            raise ValueError(f"{what}: config.{key} = {value!r} may describe blocks one by one, and prunekit does "
                             f"not know how to keep it consistent when blocks of {name} are removed; add its rule "
                             "to prunekit.shrink.depth")
    return updates


def _config_keys(config: Any) -> List[str]:
    """The config's attribute names (public ones, as saved)."""
    return [k for k in vars(config) if not k.startswith("_")]


def _set_config(txn: Transaction, config: Any, updates: Dict[str, Any]) -> None:
    """Write ``updates`` to ``config``; the transaction puts its attribute dict back on rollback."""
    saved = dict(config.__dict__)

    def restore() -> None:
        attrs = config.__dict__
        for key in [k for k in attrs if k not in saved]:
            del attrs[key]
        attrs.update(saved)

    txn.add(restore)
    for key, value in updates.items():
        setattr(config, key, value)
    check = getattr(config, "validate_layer_type", None)
    if callable(check):
        check()


# ------------------------------------------------------------------ removal: the modules
def _owner(model: nn.Module, name: str) -> nn.Module:
    return model.get_submodule(name.rpartition(".")[0]) if "." in name else model


def remove_layers(model: nn.Module, indices: Iterable[int], *, journal: Optional[Transaction] = None) -> None:
    """Remove whole blocks ``indices`` from a Hugging Face model, in place; the config follows.

    The block list shrinks, the config's layer count and per-layer settings follow the kept blocks,
    and every kept block's ``layer_idx`` (its KV-cache slot) is renumbered ``0..n-1`` (the rules are
    in this module's docstring). The model's output equals that under :func:`skipped_layers` of the
    same indices, and ``save_pretrained`` / ``from_pretrained`` give it back. Bad indices (not ints,
    out of range, repeated, all blocks) and removals the config cannot express raise before anything
    changes; any failure -- ``KeyboardInterrupt`` included -- leaves the model as it was. With
    ``journal``, the changes are recorded there (a larger change that fails later undoes them too).

    Examples:
        >>> import torch, transformers
        >>> cfg = transformers.GPT2Config(vocab_size=32, n_embd=16, n_layer=4, n_head=2, bos_token_id=0,
        ...                               eos_token_id=0)
        >>> model = transformers.GPT2LMHeadModel(cfg)
        >>> remove_layers(model, [1, 2])
        >>> len(model.transformer.h), model.config.n_layer, [b.attn.layer_idx for b in model.transformer.h]
        (2, 2, [0, 1])
    """
    what = "prunekit.shrink.remove_layers"
    name, blocks = layer_list(model, what)
    n = len(blocks)
    removed = _indices(indices, n, name, what)
    if not removed:
        return
    kept = [i for i in range(n) if i not in removed]
    updates = _config_updates(model, name, n, kept, what)
    owner = _owner(model, name)
    modules = [blocks[i] for i in kept]
    with atomic(journal) as txn:
        txn.module(blocks)
        blocks._modules.clear()
        blocks._modules.update(OrderedDict((str(j), m) for j, m in enumerate(modules)))
        for j, block in enumerate(modules):
            for sub in block.modules():
                if isinstance(sub.__dict__.get("layer_idx"), int) and sub.layer_idx != j:
                    txn.module(sub)
                    setattr(sub, "layer_idx", j)  # a transformers attention's own index
        txn.module(owner)
        for attr in _COUNT_ATTRS:
            if owner.__dict__.get(attr) == n:
                setattr(owner, attr, len(kept))
        if isinstance(owner.__dict__.get("has_sliding_layers"), bool) and "layer_types" in updates:
            setattr(owner, "has_sliding_layers", "sliding_attention" in updates["layer_types"])
        _set_config(txn, model.config, updates)
    logger.info("removed blocks %s of %s: %d of %d kept", list(removed), name, len(kept), n)
