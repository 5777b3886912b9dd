"""Calibration batches as shrinking reads them, and the objective that scores a smaller model.

* :func:`as_batches` -- the calibration as a list, checked to be non-empty;
* :func:`forward` -- one batch through the model (a dict is keyword inputs), no gradients;
* :func:`token_mask` -- which tokens of a batch are real (its 2-D ``attention_mask``), or None;
* :func:`input_moments` -- the second moment of layers' inputs (with a constant 1) as the model runs;
* :func:`scoring_split` -- the batches a search refits on and the ones it scores on;
* :class:`Objective` -- how far a model (pruned, or running with some layers skipped) is from
  what the dense model did on the calibration batches; lower is better. A language model is
  scored by its next-token cross-entropy on the batches' ``input_ids``; any other model by
  ``1 - cosine`` of its output vectors (logits or last hidden state) to the dense model's,
  token by token, padding left out.
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..compact.trace.inputs import split_inputs
from ..transaction import run_then_clean

__all__ = ["Objective", "as_batches", "forward", "input_moments", "output_vectors", "scoring_split", "token_mask",
           "token_rows"]


def as_batches(calibration: Iterable[Any], what: str = "prunekit.shrink") -> List[Any]:
    """The calibration batches as a list; ``ValueError`` when there are none.

    Examples:
        >>> import torch
        >>> len(as_batches(iter([torch.zeros(1, 4), torch.zeros(1, 4)])))
        2
    """
    if isinstance(calibration, (Tensor, dict)):
        raise TypeError(f"{what}: calibration must be an iterable of batches, got one {type(calibration).__name__}; "
                        "write [batch] for a single batch")
    try:
        batches = list(calibration)
    except TypeError:
        raise TypeError(f"{what}: calibration must be an iterable of batches (a list of dicts of input_ids/"
                        f"attention_mask, or of tensors), got {type(calibration).__name__}") from None
    if not batches:
        raise ValueError(f"{what}: calibration is empty; give at least one batch the model accepts, e.g. "
                         "[tokenizer(texts, return_tensors='pt', padding=True)]")
    return batches


def scoring_split(batches: List[Any]) -> Tuple[List[Any], List[Any]]:
    """``(fit, score)``: every fourth batch scores (the last one when there are two or three), the others
    are fitted on; a single batch does both.

    A search that refits each candidate and scores it on the batches it was refitted on prefers the
    candidate that fits them best, not the one that generalises: the refit has more freedom in some
    candidates than in others. Scoring on batches the refit did not see compares what users get.

    Examples:
        >>> scoring_split(list(range(8)))
        ([0, 1, 2, 4, 5, 6], [3, 7])
        >>> scoring_split([0, 1]), scoring_split([0])
        (([0], [1]), ([0], [0]))
    """
    if len(batches) < 2:
        return list(batches), list(batches)
    if len(batches) < 4:
        return list(batches[:-1]), [batches[-1]]
    return [b for i, b in enumerate(batches) if i % 4 != 3], [b for i, b in enumerate(batches) if i % 4 == 3]


def forward(model: nn.Module, batch: Any) -> Any:
    """``model(batch)`` under ``torch.no_grad()``: a dict is keyword inputs, a tuple positional ones.

    Examples:
        >>> import torch
        >>> forward(torch.nn.Linear(2, 1, bias=False), torch.zeros(1, 2)).tolist()
        [[0.0]]
    """
    args, kwargs = split_inputs(batch)
    with torch.no_grad():
        return model(*args, **kwargs)


def token_mask(batch: Any) -> Optional[Tensor]:
    """The batch's real tokens (its 2-D ``attention_mask`` as booleans), or None when it has none.

    Examples:
        >>> import torch
        >>> token_mask({"attention_mask": torch.tensor([[1, 0]])}).tolist()
        [[True, False]]
    """
    mask = batch.get("attention_mask") if isinstance(batch, dict) else None
    return mask.bool() if isinstance(mask, Tensor) and mask.dim() == 2 else None


def token_rows(t: Tensor, mask: Optional[Tensor]) -> Tensor:
    """``t`` as float64 rows of its last dimension, the padding of ``mask`` (a batch's :func:`token_mask`) left out.

    Examples:
        >>> import torch
        >>> token_rows(torch.ones(1, 2, 3), torch.tensor([[True, False]])).shape
        torch.Size([1, 3])
    """
    if mask is not None and t.dim() == 3 and tuple(t.shape[:2]) == tuple(mask.shape):
        t = t[mask.to(t.device)]
    return t.reshape(-1, t.shape[-1]).double()


def output_vectors(output: Any) -> Tensor:
    """What a model's output is compared by: its ``logits``, else its ``last_hidden_state``, else the tensor.

    Examples:
        >>> import torch
        >>> output_vectors({"last_hidden_state": torch.ones(1, 2, 3)}).shape
        torch.Size([1, 2, 3])
    """
    for key in ("logits", "last_hidden_state"):
        value = output.get(key) if isinstance(output, dict) else getattr(output, key, None)
        if isinstance(value, Tensor):
            return value
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], Tensor):
        return output[0]
    if isinstance(output, Tensor):
        return output
    raise TypeError(f"prunekit.shrink: cannot find the output tensor in a {type(output).__name__} (expected logits, "
                    "last_hidden_state or a tensor)")


def _is_language_model(model: nn.Module, batch: Any, out: Tensor) -> bool:
    ids = batch.get("input_ids") if isinstance(batch, dict) else None
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    causal = type(model).__name__.endswith(("ForCausalLM", "LMHeadModel"))
    return causal and isinstance(ids, Tensor) and out.dim() == 3 and out.shape[-1] == vocab


class Objective:
    """How far a model is from the dense one on the calibration batches (lower is better).

    Built from the dense model; calling it on the model after a change gives the score of the
    change. Language models (``*ForCausalLM``/``*LMHeadModel`` given ``input_ids``) are scored by
    their mean next-token cross-entropy over real tokens (nothing is stored); other models by
    ``1 - cosine`` between their output vectors and the dense model's, averaged over real tokens
    (the dense outputs are kept, one tensor per batch).

    Examples:
        >>> import torch
        >>> torch.manual_seed(0); m = torch.nn.Linear(4, 4)
        <torch._C.Generator object at ...>
        >>> objective = Objective(m, [torch.randn(3, 4)])
        >>> abs(round(objective(m), 6)), objective.kind
        (0.0, 'cosine')
    """

    def __init__(self, model: nn.Module, batches: List[Any]) -> None:
        self.batches = batches
        first = output_vectors(forward(model, batches[0]))
        self.kind = "loss" if _is_language_model(model, batches[0], first) else "cosine"
        self.reference: List[Tensor] = []
        if self.kind == "cosine":
            self.reference = [first.float()] + [output_vectors(forward(model, b)).float() for b in batches[1:]]

    def __call__(self, model: nn.Module) -> float:
        total, count = 0.0, 0
        for i, batch in enumerate(self.batches):
            out = output_vectors(forward(model, batch)).float()
            mask = token_mask(batch)
            if self.kind == "loss":
                ids = batch["input_ids"]
                losses = F.cross_entropy(out[:, :-1].flatten(0, 1), ids[:, 1:].flatten(), reduction="none")
                keep = mask[:, 1:].flatten() if mask is not None else torch.ones_like(losses, dtype=torch.bool)
            else:
                ref = self.reference[i]
                if ref.shape != out.shape:
                    raise ValueError(f"prunekit.shrink: the model's output changed shape ({tuple(ref.shape)} -> "
                                     f"{tuple(out.shape)}): its output is a hidden state, so its width cannot be "
                                     "pruned; leave 'hidden' out of axes")
                losses = 1.0 - F.cosine_similarity(out, ref, dim=-1).flatten()
                real = mask.flatten() if mask is not None and mask.numel() == losses.numel() else None
                keep = real if real is not None else torch.ones_like(losses, dtype=torch.bool)
            total += float(losses[keep].double().sum())
            count += int(keep.sum())
        return total / max(count, 1)


class _Stop(Exception):
    """Every layer asked about has seen its input: the rest of the model need not run."""


def input_moments(model: nn.Module, batches: List[Any], layers: List[nn.Module]) -> Dict[int, Tuple[Tensor, int]]:
    """``id(layer) -> (X^T X, rows)`` of each layer's inputs with a constant 1 appended (float64), padding left out.

    The model runs as it is now (hooks included: these see a layer's input before its other
    forward pre-hooks do); a batch stops once every layer has seen its input.

    Examples:
        >>> import torch
        >>> lin = torch.nn.Linear(2, 1)
        >>> xtx, rows = input_moments(lin, [torch.ones(3, 2)], [lin])[id(lin)]
        >>> xtx.tolist(), rows
        ([[3.0, 3.0, 3.0], [3.0, 3.0, 3.0], [3.0, 3.0, 3.0]], 3)
    """
    stats: Dict[int, List[Any]] = {id(r): [None, 0] for r in layers}
    seen: set = set()
    current: List[Optional[Tensor]] = [None]

    def hook(module: nn.Module, args: Tuple[Any, ...]) -> None:
        x = token_rows(args[0].detach(), current[0])
        x = torch.cat([x, torch.ones(x.shape[0], 1, dtype=x.dtype, device=x.device)], 1)
        s = stats[id(module)]
        s[0] = x.T @ x if s[0] is None else s[0].add_(x.T @ x)
        s[1] += x.shape[0]
        seen.add(id(module))
        if len(seen) == len(stats):
            raise _Stop

    handles: List[Any] = []

    def body() -> None:
        for r in layers:
            handles.append(r.register_forward_pre_hook(hook, prepend=True))
        for batch in batches:
            seen.clear()
            current[0] = token_mask(batch)
            try:
                forward(model, batch)
            except _Stop:
                pass

    run_then_clean(body, lambda: [handles.pop().remove() for _ in list(handles)])
    return {k: (v[0], v[1]) for k, v in stats.items()}
