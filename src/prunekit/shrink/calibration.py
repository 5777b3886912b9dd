"""Calibration batches as shrinking reads them, and the objective that scores a smaller model.

* :func:`as_batches` -- the calibration as a list, checked to be non-empty;
* :func:`forward` -- one batch through the model (a dict is keyword inputs), no gradients;
* :func:`token_mask` -- which tokens of a batch are real (its 2-D ``attention_mask``), or None;
* :class:`Objective` -- how far a model (pruned, or running with some layers skipped) is from
  what the dense model did on the calibration batches; lower is better. A language model is
  scored by its next-token cross-entropy on the batches' ``input_ids``; any other model by
  ``1 - cosine`` of its output vectors (logits or last hidden state) to the dense model's,
  token by token, padding left out.
"""

from __future__ import annotations

from typing import Any, Iterable, List, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..compact.trace.inputs import split_inputs

__all__ = ["Objective", "as_batches", "forward", "output_vectors", "token_mask"]


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
                keep = mask.flatten() if mask is not None and mask.numel() == losses.numel() else None
                keep = keep if keep is not None else torch.ones_like(losses, dtype=torch.bool)
            total += float(losses[keep].double().sum())
            count += int(keep.sum())
        return total / max(count, 1)
