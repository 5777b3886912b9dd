"""Finding a model's repeated blocks and walking them with their calibration inputs.

The reusable pieces of sequential (block-by-block) calibration, for one-shot
pruning and anything else that processes a model one block at a time:

* :func:`find_blocks` -- the blocks: an ``nn.ModuleList`` of identical blocks
  (BERT's ``encoder.layer``, GPT-2's ``h``, Llama's ``layers``, ...), or
  modules of a known block class;
* :func:`capture_block_inputs` -- run the model on calibration batches only as
  far as the first block and keep that block's inputs (positional and keyword
  arguments per batch);
* :func:`run_block` -- run one block on captured inputs, giving the next
  block's inputs (with a :class:`Chain`, found by :func:`find_chain`, the
  arguments the model hands from one block to the next besides the hidden
  states, such as T5's position biases);
* :func:`stack_starts` -- where a new stack of blocks begins (an
  encoder-decoder's decoder): its inputs are captured again from the model;
* :func:`on_device` -- a block moved to the working device for the time of a
  ``with``, and back (offloading: the model stays where it is; one block at a
  time is on the working device).

Examples:
    >>> import torch
    >>> from torch import nn
    >>> from prunekit.oneshot.blocks import find_blocks, capture_block_inputs, run_block
    >>> class Net(nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.emb = nn.Linear(4, 8)
    ...         self.layers = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(3))
    ...     def forward(self, x):
    ...         x = self.emb(x)
    ...         for layer in self.layers:
    ...             x = layer(x)
    ...         return x
    >>> net = Net()
    >>> [name for name, _ in find_blocks(net)]
    ['layers.0', 'layers.1', 'layers.2']
    >>> x = torch.randn(2, 4)
    >>> inputs = capture_block_inputs(net, net.layers[0], [x])
    >>> for block in net.layers:
    ...     inputs = run_block(block, inputs)
    >>> bool(torch.allclose(inputs[0].hidden, net(x)))   # block by block = the whole model
    True
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

__all__ = [
    "KNOWN_BLOCKS",
    "BlockInput",
    "Chain",
    "find_blocks",
    "find_chain",
    "stack_starts",
    "capture_block_inputs",
    "run_block",
    "call_model",
    "on_device",
    "pre_hooks",
    "to_device",
]

#: block classes recognised by name when no ModuleList of identical blocks is found
KNOWN_BLOCKS = (
    "BertLayer", "RobertaLayer", "GPT2Block", "LlamaDecoderLayer", "MistralDecoderLayer",
    "Qwen2DecoderLayer", "GPTNeoXLayer", "OPTDecoderLayer", "PhiDecoderLayer", "GemmaDecoderLayer",
)


@dataclass
class BlockInput:
    """One calibration batch as a block receives it: ``block(*args, **kwargs)``.

    ``token_mask`` (``(batch, tokens)``, true = a real token) marks padding
    that activation statistics skip; ``None`` counts every position.
    """

    args: Tuple[Any, ...]
    kwargs: Dict[str, Any] = field(default_factory=dict)
    token_mask: Optional[Tensor] = None

    @property
    def hidden(self) -> Tensor:
        """The hidden states the block transforms (first positional argument, or ``hidden_states``)."""
        if self.args:
            return self.args[0]
        return self.kwargs["hidden_states"]

    def chained(self, out: Any, chain: Optional["Chain"]) -> "BlockInput":
        """The same call with what the previous block returned (``out``) where ``chain`` puts it (without a
        chain: the hidden states only)."""
        if chain is None:
            return self.with_hidden(block_output(out))
        items = list(out) if isinstance(out, (tuple, list)) else [out]
        args = list(self.args)
        for k, j in chain.args.items():
            args[k] = items[j]
        kwargs = dict(self.kwargs)
        for key, j in chain.kwargs.items():
            kwargs[key] = items[j]
        return BlockInput(tuple(args), kwargs, self.token_mask)

    def with_hidden(self, hidden: Tensor) -> "BlockInput":
        """The same call with other hidden states (the previous block's output)."""
        if self.args:
            return BlockInput((hidden,) + tuple(self.args[1:]), self.kwargs, self.token_mask)
        kw = dict(self.kwargs)
        kw["hidden_states"] = hidden
        return BlockInput((), kw, self.token_mask)

    def to(self, device: Any) -> "BlockInput":
        """A copy with every tensor moved to ``device``."""
        return BlockInput(to_device(self.args, device), to_device(self.kwargs, device),
                          None if self.token_mask is None else self.token_mask.to(device))


def to_device(obj: Any, device: Any) -> Any:
    """``obj`` with every tensor inside (tuples, lists, dicts) moved to ``device``.

    Examples:
        >>> import torch
        >>> to_device({"a": (torch.ones(1),)}, "cpu")["a"][0].device.type
        'cpu'
    """
    if isinstance(obj, Tensor):
        return obj.to(device)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(to_device(o, device) for o in obj))
    if isinstance(obj, (tuple, list)):
        return type(obj)(to_device(o, device) for o in obj)
    if isinstance(obj, dict):
        return {k: to_device(v, device) for k, v in obj.items()}
    return obj


def _has_linear(module: nn.Module) -> bool:
    return any(isinstance(m, nn.Linear) for m in module.modules())


def _numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def find_blocks(model: nn.Module, blocks: Optional[Any] = None) -> List[Tuple[str, nn.Module]]:
    """``[(qualified name, block)]`` in execution order.

    By default: the largest ``nn.ModuleList`` (by parameters) whose children
    all share one class and hold ``Linear`` layers; failing that, the
    outermost modules of a class named in :data:`KNOWN_BLOCKS`. An
    encoder-decoder (``config.is_encoder_decoder`` with ``get_encoder``/``get_decoder``):
    the encoder's blocks, then the decoder's. ``blocks``
    overrides the search: a class name, a class, or a list of module names.

    Examples:
        >>> from torch import nn
        >>> net = nn.Sequential(nn.Linear(2, 4), nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)]))
        >>> [n for n, _ in find_blocks(net)]
        ['1.0', '1.1']
    """
    named = dict(model.named_modules())
    if blocks is not None:
        if isinstance(blocks, (str, type)):
            want = blocks if isinstance(blocks, str) else blocks.__name__
            found = _outermost([(n, m) for n, m in named.items()
                                if any(c.__name__ == want for c in type(m).__mro__)])
            if not found:
                raise ValueError(f"blocks={want!r}: no module of that class in {type(model).__name__}")
            return found
        out = []
        for n in blocks:
            if n not in named:
                raise ValueError(f"blocks: {type(model).__name__} has no module named {n!r}")
            out.append((n, named[n]))
        return out
    stacks = _encoder_decoder(model)
    if stacks:
        names = {id(m): n for n, m in named.items()}
        return [(f"{names[id(stack)]}.{n}", b) for stack in stacks for n, b in find_blocks(stack)]
    best: Optional[Tuple[int, str, nn.ModuleList]] = None
    for name, m in named.items():
        if isinstance(m, nn.ModuleList) and len(m) > 0:
            kinds = {type(c) for c in m}
            if len(kinds) == 1 and all(_has_linear(c) for c in m):
                size = _numel(m)
                if best is None or size > best[0]:
                    best = (size, name, m)
    if best is not None:
        _, name, ml = best
        prefix = f"{name}." if name else ""
        return [(f"{prefix}{i}", c) for i, c in enumerate(ml)]
    found = _outermost([(n, m) for n, m in named.items() if type(m).__name__ in KNOWN_BLOCKS])
    if found:
        return found
    raise ValueError(
        f"no repeated blocks found in {type(model).__name__}: no nn.ModuleList of identical blocks with Linear "
        f"layers and no module of a known block class ({', '.join(KNOWN_BLOCKS)}); pass blocks=<class name or "
        "list of module names>"
    )


def _encoder_decoder(model: nn.Module) -> List[nn.Module]:
    """``[encoder, decoder]`` of an encoder-decoder model, else ``[]``."""
    if not getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        return []
    try:
        stacks = [model.get_encoder(), model.get_decoder()]  # type: ignore[operator]
    except (AttributeError, TypeError, NotImplementedError):
        return []
    mods = {id(m) for m in model.modules()}
    if not all(isinstance(s, nn.Module) and id(s) in mods and s is not model for s in stacks) or stacks[0] is stacks[1]:
        return []
    return stacks


def stack_starts(block_list: Sequence[Tuple[str, nn.Module]]) -> List[int]:
    """The indices of the blocks that begin a stack: the first, and each whose container differs from the
    previous block's (an encoder-decoder's first decoder block). A stack's first block gets its inputs from
    the model, the others from the block before.

    Examples:
        >>> from torch import nn
        >>> stack_starts([("encoder.block.0", nn.Identity()), ("encoder.block.1", nn.Identity()),
        ...               ("decoder.block.0", nn.Identity())])
        [0, 2]
    """
    parents = [n.rsplit(".", 1)[0] if "." in n else "" for n, _ in block_list]
    return [i for i in range(len(parents)) if i == 0 or parents[i] != parents[i - 1]]


@dataclass
class Chain:
    """What the model hands the next block from a block's output: positional argument ``k`` (``args``)
    or keyword ``key`` (``kwargs``) <- item ``j`` of the output (``0`` for a bare tensor)."""

    args: Dict[int, int] = field(default_factory=dict)
    kwargs: Dict[str, int] = field(default_factory=dict)


def find_chain(model: nn.Module, first: nn.Module, second: nn.Module, batch: Any) -> Optional[Chain]:
    """Run ``model`` on ``batch`` up to ``second`` and find which of its arguments are (the very objects)
    in ``first``'s output; ``None`` when the hidden states are not among them (then the hidden states
    alone are handed on).

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> net = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
        >>> find_chain(net, net[0], net[1], torch.ones(1, 2))
        Chain(args={0: 0}, kwargs={})
    """
    outs: List[Any] = []
    seen: List[Tuple[Tuple[Any, ...], Dict[str, Any]]] = []

    def keep(_m: nn.Module, _args: Any, out: Any) -> None:
        outs.append(out)

    def stop(_m: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
        seen.append((args, dict(kwargs)))
        raise _Stop

    model_device = next((p.device for p in model.parameters() if p.device.type != "meta"), torch.device("cpu"))
    handle = first.register_forward_hook(keep)
    try:
        with pre_hooks([(second, stop)], with_kwargs=True), torch.no_grad():
            try:
                call_model(model, to_device(batch, model_device))
            except _Stop:
                pass
    finally:
        handle.remove()
    if not outs or not seen:
        return None
    items = list(outs[-1]) if isinstance(outs[-1], (tuple, list)) else [outs[-1]]

    def source(v: Any) -> Optional[int]:
        return next((j for j, o in enumerate(items) if isinstance(v, Tensor) and o is v), None)

    args, kwargs = seen[0]
    chain = Chain({k: j for k, v in enumerate(args) if (j := source(v)) is not None},
                  {k: j for k, v in kwargs.items() if (j := source(v)) is not None})
    hidden_found = (0 in chain.args) if args else ("hidden_states" in chain.kwargs)
    return chain if hidden_found else None


def _outermost(found: List[Tuple[str, nn.Module]]) -> List[Tuple[str, nn.Module]]:
    names = [n for n, _ in found]
    return [(n, m) for n, m in found if not any(n != o and n.startswith(o + ".") for o in names)]


def call_model(model: nn.Module, batch: Any) -> Any:
    """Call ``model`` on a batch: a dict as ``model(**batch)``, a tuple/list as ``model(*batch)``, else ``model(batch)``.

    Examples:
        >>> import torch
        >>> call_model(torch.nn.Identity(), (torch.ones(1),)).tolist()
        [1.0]
    """
    if isinstance(batch, dict):
        return model(**batch)
    if isinstance(batch, (tuple, list)):
        return model(*batch)
    return model(batch)


class _Stop(Exception):
    """Raised by the capture hook: the rest of the model need not run."""


def _token_mask(batch: Any, key: str = "attention_mask") -> Optional[Tensor]:
    if isinstance(batch, dict):
        m = batch.get(key)
        if isinstance(m, Tensor) and m.dim() == 2:
            return m != 0
    return None


def capture_block_inputs(
    model: nn.Module,
    block: nn.Module,
    batches: Iterable[Any],
    device: Any = None,
    *,
    mask_key: str = "attention_mask",
    replace: Optional[Tuple[nn.Module, Sequence[Tensor]]] = None,
) -> List[BlockInput]:
    """Run ``model`` on each batch up to ``block`` and return what ``block`` received.

    The model stops at the block (nothing after it runs). Each batch's tensors
    are moved to the device of the model's first parameter (not on ``meta``); the captured
    inputs are moved to ``device`` when given. A dict batch's 2-D ``mask_key``
    (``attention_mask``; a decoder's: ``decoder_attention_mask``) becomes the input's
    ``token_mask``. ``replace=(module, hidden)``: the hidden states ``module`` returns on batch
    ``i`` are replaced by ``hidden[i]`` (a dense model's stream through a pruned one).

    Examples:
        >>> import torch
        >>> net = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Linear(3, 3))
        >>> got = capture_block_inputs(net, net[1], [torch.ones(4, 2)])
        >>> got[0].hidden.shape
        torch.Size([4, 3])
    """
    seen: List[Tuple[Tuple[Any, ...], Dict[str, Any]]] = []

    def hook(_m: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
        seen.append((args, dict(kwargs)))
        raise _Stop

    # where the model computes: its first parameter's device (not "meta": a model whose weights load as they
    # are used, block by block, computes on the CPU)
    model_device = next((p.device for p in model.parameters() if p.device.type != "meta"), torch.device("cpu"))
    out: List[BlockInput] = []
    current: List[Tensor] = []

    def substitute(_m: nn.Module, _args: Any, result: Any) -> Any:
        return _with_output_hidden(result, current[0].to(block_output(result).device))

    handle = replace[0].register_forward_hook(substitute) if replace is not None else None
    try:
        with pre_hooks([(block, hook)], with_kwargs=True):
            with torch.no_grad():
                for i, batch in enumerate(batches):
                    seen.clear()
                    current[:] = [replace[1][i]] if replace is not None else []
                    try:
                        call_model(model, to_device(batch, model_device))
                    except _Stop:
                        pass
                    if not seen:
                        raise ValueError(f"the model never called the block {type(block).__name__} on a "
                                         "calibration batch")
                    args, kwargs = seen[0]
                    item = BlockInput(tuple(args), kwargs, _token_mask(batch, mask_key))
                    out.append(item.to(device) if device is not None else item)
    finally:
        if handle is not None:
            handle.remove()
    return out


def _with_output_hidden(out: Any, hidden: Tensor) -> Any:
    """A block's return value with other hidden states (a tensor, or the first item of a tuple)."""
    if isinstance(out, Tensor):
        return hidden
    if isinstance(out, tuple) and out and isinstance(out[0], Tensor):
        return (hidden,) + tuple(out[1:])
    raise TypeError(f"cannot replace the hidden states in a block's output of type {type(out).__name__}")


def block_output(out: Any) -> Tensor:
    """The hidden states in a block's return value (a tensor, or the first item of a tuple)."""
    if isinstance(out, Tensor):
        return out
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], Tensor):
        return out[0]
    hidden = getattr(out, "last_hidden_state", None)
    if isinstance(hidden, Tensor):
        return hidden
    raise TypeError(f"cannot find the hidden states in a block's output of type {type(out).__name__}")


def run_block(block: nn.Module, inputs: Sequence[BlockInput],
              each: Optional[Callable[[int, BlockInput], None]] = None, chain: Optional[Chain] = None
              ) -> List[BlockInput]:
    """Run ``block`` on every input (no grad); the results, as the next block's inputs (see :class:`Chain`).

    ``each(i, input)`` is called before batch ``i`` runs (to set up per-batch
    hooks, e.g. the token mask of activation statistics).

    Examples:
        >>> import torch
        >>> nxt = run_block(torch.nn.Linear(2, 2, bias=False), [BlockInput((torch.zeros(1, 2),))])
        >>> nxt[0].hidden.tolist()
        [[0.0, 0.0]]
    """
    out = []
    with torch.no_grad():
        for i, inp in enumerate(inputs):
            if each is not None:
                each(i, inp)
            out.append(inp.chained(block(*inp.args, **inp.kwargs), chain))
    return out


@contextlib.contextmanager
def pre_hooks(pairs: Iterable[Tuple[nn.Module, Callable[..., Any]]], *, with_kwargs: bool = False) -> Iterator[None]:
    """Forward pre-hooks ``(module, hook)`` installed for the ``with`` body only.

    Installed inside the protected region and removed by a cleanup that runs again if an
    interrupt cuts it short, so no hook outlives the block (``KeyboardInterrupt`` included).

    Examples:
        >>> import torch
        >>> lin = torch.nn.Linear(2, 2)
        >>> with pre_hooks([(lin, lambda m, args: None)]):
        ...     len(lin._forward_pre_hooks)
        1
        >>> len(lin._forward_pre_hooks)
        0
    """
    handles: List[Any] = []

    def remove() -> None:
        while handles:
            handles[-1].remove()
            handles.pop()

    try:
        for module, hook in pairs:
            handles.append(module.register_forward_pre_hook(hook, with_kwargs=with_kwargs))
        yield
    finally:
        try:
            remove()
        except BaseException:
            remove()
            raise


@contextlib.contextmanager
def on_device(module: nn.Module, device: Any) -> Iterator[nn.Module]:
    """Move ``module`` to ``device`` for the ``with`` body, then back to where each tensor was.

    With ``device=None`` nothing moves. Parameters keep their identity (data is
    moved in place), so masks, hooks and optimizers see the same objects.

    Examples:
        >>> import torch
        >>> lin = torch.nn.Linear(2, 2)
        >>> with on_device(lin, "cpu") as m:
        ...     m.weight.device.type
        'cpu'
    """
    if device is None:
        yield module
        return
    device = torch.device(device)
    homes: List[Tuple[Tensor, torch.device]] = []
    for t in list(module.parameters()) + list(module.buffers()):
        homes.append((t, t.device))
    try:
        for t, home in homes:
            if home != device:
                t.data = t.data.to(device)
        yield module
    finally:
        for t, home in homes:
            if t.device != home:
                t.data = t.data.to(home)
