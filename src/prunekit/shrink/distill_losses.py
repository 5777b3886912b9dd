"""The losses of distillation: what a student is trained to match in its teacher's outputs.

Pure tensor math on model outputs, computed in float32 whatever the models' dtype:

* :func:`logit_kl` -- KL(teacher || student) of the softened token distributions, times T^2,
  averaged over the non-padding tokens (language models: ``.logits``);
* :func:`state_loss` -- mean squared error or ``1 - cosine`` between hidden states, token by
  token or of pooled sentence embeddings (:func:`pool`; encoders: ``.last_hidden_state``);
* :func:`layer_pairs` and :func:`intermediate_mse` -- intermediate hidden states matched by
  relative depth (``output_hidden_states``), when student and teacher have the same width;
* :class:`DistillLoss` -- one of those chosen by name, checked once against a real pair of
  outputs (:meth:`DistillLoss.check`), then called as ``loss(student_out, teacher_out, batch)``.

Padding never counts: a batch's 2-D ``attention_mask`` (a dict key) marks the real tokens.
"""

from __future__ import annotations

import math
from typing import Any, List, Optional

import torch
from torch import Tensor

__all__ = ["DistillLoss", "LOSSES", "POOLINGS", "intermediate_mse", "is_finite_scalar", "layer_pairs", "logit_kl", "pool",
           "state_loss", "token_mask"]

#: the losses a name selects ("auto": KL when the models give logits, else cosine of pooled states)
LOSSES = ("auto", "kl", "mse", "cosine")
#: how hidden states are compared: "mean" (mean over real tokens), "cls" (first token), "pooler" (``pooler_output``),
#: "tokens" (every real token)
POOLINGS = ("mean", "cls", "pooler", "tokens")


def token_mask(batch: Any, shape: Any) -> Optional[Tensor]:
    """The batch's ``attention_mask`` as booleans when it has the leading ``shape`` of an output, else ``None``.

    Examples:
        >>> m = token_mask({"attention_mask": torch.tensor([[1, 1, 0]])}, (1, 3))
        >>> m.tolist(), token_mask(torch.ones(1, 3), (1, 3))
        ([[True, True, False]], None)
    """
    m = batch.get("attention_mask") if isinstance(batch, dict) else None
    if isinstance(m, Tensor) and tuple(m.shape) == tuple(shape):
        return m != 0
    return None


def _masked_mean(values: Tensor, mask: Optional[Tensor]) -> Tensor:
    """Mean of ``values`` (one per token) over the tokens where ``mask`` is true (all when ``None``)."""
    if mask is None:
        return values.mean()
    mask = mask.to(values.device)
    return values[mask].sum() / mask.sum().clamp(min=1)


def logit_kl(student: Tensor, teacher: Tensor, mask: Optional[Tensor] = None, temperature: float = 1.0) -> Tensor:
    """``T^2 * KL(softmax(teacher / T) || softmax(student / T))`` per position, averaged over ``mask``.

    ``student`` and ``teacher`` are ``[..., classes]`` logits; ``mask`` (``[...]``, true for real
    tokens) leaves padding out of the mean.

    Examples:
        >>> s, t = torch.zeros(1, 2, 3), torch.tensor([[[0.0, 0.0, 0.0], [2.0, 0.0, 0.0]]])
        >>> round(float(logit_kl(s, t, torch.tensor([[True, False]]))), 6)  # the second token is padding
        0.0
        >>> round(float(logit_kl(s, t)), 4)
        0.2165
    """
    s = torch.log_softmax(student.float() / temperature, dim=-1)
    t = torch.log_softmax(teacher.float().to(s.device) / temperature, dim=-1)
    per_token = (t.exp() * (t - s)).sum(-1)
    return _masked_mean(per_token, mask) * temperature ** 2


def pool(hidden: Tensor, mask: Optional[Tensor], how: str) -> Tensor:
    """Sentence embeddings ``[batch, width]`` of hidden states ``[batch, tokens, width]``: ``how`` is
    ``"mean"`` (mean over the real tokens of ``mask``) or ``"cls"`` (the first token).

    Examples:
        >>> h = torch.tensor([[[1.0], [3.0], [100.0]]])
        >>> pool(h, torch.tensor([[True, True, False]]), "mean").tolist(), pool(h, None, "cls").tolist()
        ([[2.0]], [[1.0]])
    """
    if how == "cls":
        return hidden[:, 0]
    if mask is None:
        return hidden.mean(1)
    m = mask.to(hidden.device).unsqueeze(-1).to(hidden.dtype)
    return (hidden * m).sum(1) / m.sum(1).clamp(min=1)


def state_loss(student: Tensor, teacher: Tensor, kind: str, mask: Optional[Tensor] = None) -> Tensor:
    """``kind="mse"``: mean squared difference; ``kind="cosine"``: mean of ``1 - cos`` over the last axis.

    Rows (vectors of the last axis) are averaged over ``mask`` when given (``[...]``, true for real tokens).

    Examples:
        >>> s, t = torch.tensor([[1.0, 0.0], [0.0, 2.0]]), torch.tensor([[2.0, 0.0], [0.0, 2.0]])
        >>> float(state_loss(s, t, "cosine")), float(state_loss(s, t, "mse"))
        (0.0, 0.25)
    """
    s, t = student.float(), teacher.float().to(student.device)
    if kind == "cosine":
        per_row = 1.0 - torch.nn.functional.cosine_similarity(s, t, dim=-1, eps=1e-8)
    else:
        per_row = (s - t).pow(2).mean(-1)
    return _masked_mean(per_row, mask)


def layer_pairs(student_layers: int, teacher_layers: int) -> List[int]:
    """For student layers ``1..n``, the teacher layer at the same relative depth (``round(i * m / n)``).

    Examples:
        >>> layer_pairs(3, 6), layer_pairs(4, 4)
        ([2, 4, 6], [1, 2, 3, 4])
    """
    return [max(1, round(i * teacher_layers / student_layers)) for i in range(1, student_layers + 1)]


def intermediate_mse(student_states: Any, teacher_states: Any, mask: Optional[Tensor] = None) -> Tensor:
    """Mean over student layers of the token-wise MSE to the teacher layer at the same depth.

    ``*_states`` are ``output_hidden_states`` tuples (the embeddings first, then one entry per layer).

    Examples:
        >>> s = (torch.zeros(1, 2, 4), torch.ones(1, 2, 4))
        >>> t = (torch.zeros(1, 2, 4), torch.zeros(1, 2, 4), torch.full((1, 2, 4), 3.0))
        >>> float(intermediate_mse(s, t))  # student layer 1 <-> teacher layer 2
        4.0
    """
    pairs = layer_pairs(len(student_states) - 1, len(teacher_states) - 1)
    parts = [state_loss(student_states[i], teacher_states[j], "mse", mask) for i, j in enumerate(pairs, start=1)]
    return torch.stack(parts).mean()


def _get(out: Any, key: str) -> Any:
    if isinstance(out, dict):
        return out.get(key)
    return getattr(out, key, None)


def _shape(t: Tensor) -> str:
    return "x".join(str(d) for d in t.shape)


class DistillLoss:
    """A named distillation loss: ``loss(student_out, teacher_out, batch) -> scalar tensor``.

    ``kind`` is one of :data:`LOSSES`, ``pooling`` one of :data:`POOLINGS` (``None``: ``"tokens"``
    for ``"mse"``/``"cosine"``, ``"mean"`` where ``"auto"`` falls back to cosine); :meth:`check`
    resolves both and verifies, on one real pair of outputs, that the outputs it compares exist and
    have the same shape.

    Examples:
        >>> from types import SimpleNamespace as Out
        >>> loss = DistillLoss("auto").check(Out(logits=torch.zeros(1, 2, 5)), Out(logits=torch.zeros(1, 2, 5)), {})
        >>> loss, float(loss(Out(logits=torch.zeros(1, 2, 5)), Out(logits=torch.zeros(1, 2, 5)), {}))
        (DistillLoss('kl', temperature=1), 0.0)
    """

    def __init__(self, kind: str, temperature: float = 1.0, pooling: Optional[str] = None, intermediate: float = 0.0,
                 what: str = "prunekit.distill") -> None:
        self.kind, self.temperature, self.pooling, self.intermediate, self.what = (
            kind, float(temperature), pooling, float(intermediate), what)

    @property
    def name(self) -> str:
        """The loss and its settings in words, e.g. ``"kl, temperature=2"``."""
        detail = f"temperature={self.temperature:g}" if self.kind == "kl" else f"pooling={self.pooling!r}"
        extra = f", intermediate={self.intermediate:g}" if self.intermediate else ""
        return f"{self.kind}, {detail}{extra}"

    def __repr__(self) -> str:
        return f"DistillLoss({self.kind!r}, {self.name.split(', ', 1)[1]})"

    @property
    def needs_hidden_states(self) -> bool:
        """Whether both models must be called with ``output_hidden_states=True``."""
        return self.intermediate > 0

    # ------------------------------------------------------------------ what is compared
    def _logits(self, out: Any) -> Any:
        return out if isinstance(out, Tensor) else _get(out, "logits")

    def _state(self, out: Any) -> Any:
        if isinstance(out, Tensor):
            return out
        return _get(out, "pooler_output" if self.pooling == "pooler" else "last_hidden_state")

    def _compared(self, out: Any, batch: Any) -> Any:
        """The tensor this loss compares, and the token mask that goes with it."""
        if self.kind == "kl":
            t = self._logits(out)
            return t, (token_mask(batch, t.shape[:-1]) if isinstance(t, Tensor) else None)
        t = self._state(out)
        if not isinstance(t, Tensor) or self.pooling == "pooler" or t.dim() < 3:
            return t, None
        mask = token_mask(batch, t.shape[:-1])
        if self.pooling in ("mean", "cls"):
            return pool(t, mask, self.pooling), None
        return t, mask

    # ------------------------------------------------------------------ checking once
    def check(self, student_out: Any, teacher_out: Any, batch: Any) -> "DistillLoss":
        """This loss with ``"auto"`` resolved, after checking that both outputs carry what it compares
        with equal shapes; ``ValueError`` naming the shapes and what to write instead."""
        kind = self.kind
        if kind == "auto":
            if isinstance(student_out, Tensor) or isinstance(teacher_out, Tensor):
                raise ValueError(f"{self.what}: loss='auto' cannot tell what the models' plain tensor outputs are; "
                                 "write loss='kl' (they are logits) or loss='mse' / loss='cosine' (hidden states)")
            has_logits = self._logits(student_out) is not None and self._logits(teacher_out) is not None
            kind = "kl" if has_logits else "cosine"
        pooling = self.pooling or ("mean" if self.kind == "auto" else "tokens")
        loss = DistillLoss(kind, self.temperature, pooling, self.intermediate, self.what)
        s, _ = loss._compared(student_out, batch)
        t, _ = loss._compared(teacher_out, batch)
        pooling = loss.pooling or ""
        field = "logits" if kind == "kl" else ("pooler_output" if pooling == "pooler" else "last_hidden_state")
        shown = f"{pooling}-pooled {field}" if kind != "kl" and pooling in ("mean", "cls") else field
        for who, v in (("student", s), ("teacher", t)):
            if not isinstance(v, Tensor):
                hint = ("loss='cosine' (hidden states)" if kind == "kl"
                        else "loss='kl' (logits)" if pooling != "pooler" else "pooling='mean'")
                raise ValueError(f"{self.what}: loss={kind!r} compares the models' {field}, and the {who}'s output "
                                 f"({type(student_out if who == 'student' else teacher_out).__name__}) has none; "
                                 f"write {hint}, or pass loss=function(student_out, teacher_out, batch)")
        if s.shape != t.shape:
            if kind == "kl":
                hint = (f"KL needs the same vocabulary (the last axis: {s.shape[-1]} vs {t.shape[-1]}); keep the "
                        "vocabulary when shrinking, or write loss='cosine' to match hidden states instead")
            else:
                hint = (f"{kind} compares the states element by element, so their widths must match "
                        f"({s.shape[-1]} vs {t.shape[-1]}); keep the hidden size when shrinking, or pass "
                        "loss=function(student_out, teacher_out, batch) that compares them through a projection")
            raise ValueError(f"{self.what}: the student's {shown} is {_shape(s)} and the teacher's {_shape(t)}: {hint}")
        if loss.needs_hidden_states:
            ss, ts = _get(student_out, "hidden_states"), _get(teacher_out, "hidden_states")
            if not isinstance(ss, (tuple, list)) or not isinstance(ts, (tuple, list)) or len(ss) < 2 or len(ts) < 2:
                raise ValueError(f"{self.what}: intermediate={self.intermediate:g} matches hidden states layer by "
                                 "layer, and the models returned none for output_hidden_states=True; write "
                                 "intermediate=0")
            if ss[-1].shape[-1] != ts[-1].shape[-1]:
                raise ValueError(f"{self.what}: intermediate={self.intermediate:g} needs the same hidden size "
                                 f"(student {ss[-1].shape[-1]}, teacher {ts[-1].shape[-1]}); write intermediate=0")
        return loss

    # ------------------------------------------------------------------ the loss
    def __call__(self, student_out: Any, teacher_out: Any, batch: Any) -> Tensor:
        """The loss of one batch (a scalar; float32)."""
        s, mask = self._compared(student_out, batch)
        t, _ = self._compared(teacher_out, batch)
        if self.kind == "kl":
            value = logit_kl(s, t, mask, self.temperature)
        else:
            value = state_loss(s, t, self.kind, mask)
        if self.needs_hidden_states:
            ss = _get(student_out, "hidden_states")
            hidden_mask = token_mask(batch, ss[-1].shape[:-1])
            value = value + self.intermediate * intermediate_mse(ss, _get(teacher_out, "hidden_states"), hidden_mask)
        return value


def is_finite_scalar(value: Any) -> bool:
    """Whether ``value`` is a one-element floating tensor (what a loss function must return).

    Examples:
        >>> is_finite_scalar(torch.tensor(1.0)), is_finite_scalar(torch.ones(2)), is_finite_scalar(1.0)
        (True, False, False)
    """
    return isinstance(value, Tensor) and value.numel() == 1 and value.is_floating_point() and math.isfinite(
        float(value.detach()))
