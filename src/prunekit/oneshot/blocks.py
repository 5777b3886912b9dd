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
  block's inputs;
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
    "find_blocks",
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
    outermost modules of a class named in :data:`KNOWN_BLOCKS`. ``blocks``
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


def _token_mask(batch: Any) -> Optional[Tensor]:
    if isinstance(batch, dict):
        m = batch.get("attention_mask")
        if isinstance(m, Tensor) and m.dim() == 2:
            return m != 0
    return None


def capture_block_inputs(
    model: nn.Module,
    block: nn.Module,
    batches: Iterable[Any],
    device: Any = None,
) -> List[BlockInput]:
    """Run ``model`` on each batch up to ``block`` and return what ``block`` received.

    The model stops at the block (nothing after it runs). Each batch's tensors
    are moved to the device of the model's first parameter (not on ``meta``); the captured
    inputs are moved to ``device`` when given. A dict batch's 2-D
    ``attention_mask`` becomes the input's ``token_mask``.

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
    with pre_hooks([(block, hook)], with_kwargs=True):
        with torch.no_grad():
            for batch in batches:
                seen.clear()
                try:
                    call_model(model, to_device(batch, model_device))
                except _Stop:
                    pass
                if not seen:
                    raise ValueError(f"the model never called the block {type(block).__name__} on a calibration batch")
                args, kwargs = seen[0]
                item = BlockInput(tuple(args), kwargs, _token_mask(batch))
                out.append(item.to(device) if device is not None else item)
    return out


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
              each: Optional[Callable[[int, BlockInput], None]] = None) -> List[BlockInput]:
    """Run ``block`` on every input (no grad); the results, as the next block's inputs.

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
            out.append(inp.with_hidden(block_output(block(*inp.args, **inp.kwargs))))
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
