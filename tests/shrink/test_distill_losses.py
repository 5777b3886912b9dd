"""The distillation losses: exact values against references written out by hand, padding left out."""

from __future__ import annotations

import math
from types import SimpleNamespace as Out

import pytest
import torch

from prunekit.shrink.distill_losses import (DistillLoss, intermediate_mse, layer_pairs, logit_kl, pool, state_loss,
                                            token_mask)


def _kl_reference(student, teacher, mask, temperature):
    """KL(teacher || student) of the softened distributions, one token at a time in float64, times T^2."""
    total, count = 0.0, 0
    for b in range(student.shape[0]):
        for t in range(student.shape[1]):
            if mask is not None and not mask[b, t]:
                continue
            s = [float(x) / temperature for x in student[b, t]]
            q = [float(x) / temperature for x in teacher[b, t]]
            ls, lq = math.log(sum(math.exp(x) for x in s)), math.log(sum(math.exp(x) for x in q))
            total += sum(math.exp(y - lq) * ((y - lq) - (x - ls)) for x, y in zip(s, q))
            count += 1
    return total / count * temperature ** 2


@pytest.mark.parametrize("temperature", [1.0, 2.0, 0.5])
def test_logit_kl_equals_the_hand_computed_value(temperature):
    g = torch.Generator().manual_seed(0)
    s, t = torch.randn(2, 5, 7, generator=g), torch.randn(2, 5, 7, generator=g) * 2
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]).bool()
    got = float(logit_kl(s, t, mask, temperature))
    assert got == pytest.approx(_kl_reference(s, t, mask, temperature), rel=1e-5)
    assert float(logit_kl(s, t, None, temperature)) == pytest.approx(_kl_reference(s, t, None, temperature), rel=1e-5)
    assert float(logit_kl(t, t, mask, temperature)) == pytest.approx(0.0, abs=1e-6)


def test_padding_never_counts():
    g = torch.Generator().manual_seed(1)
    s, t = torch.randn(2, 4, 6, generator=g), torch.randn(2, 4, 6, generator=g)
    batch = {"attention_mask": torch.tensor([[1, 1, 0, 0], [1, 1, 1, 0]])}
    mask = token_mask(batch, (2, 4))
    s2, t2 = s.clone(), t.clone()
    s2[~mask], t2[~mask] = 100.0, -50.0  # garbage where the batch is padding
    assert torch.equal(logit_kl(s, t, mask), logit_kl(s2, t2, mask))
    assert not torch.equal(logit_kl(s, t), logit_kl(s2, t2))  # the mask is what keeps it out
    h, h2 = s.clone(), s2.clone()
    for kind in ("mse", "cosine"):
        assert torch.equal(state_loss(h, t, kind, mask), state_loss(h2, t2, kind, mask))
    assert torch.equal(pool(h, mask, "mean"), pool(h2, mask, "mean"))
    loss = DistillLoss("cosine", pooling="mean")
    assert torch.equal(loss(Out(last_hidden_state=h), Out(last_hidden_state=t), batch),
                       loss(Out(last_hidden_state=h2), Out(last_hidden_state=t2), batch))


def test_token_mask_only_when_it_fits():
    batch = {"attention_mask": torch.ones(2, 3, dtype=torch.long)}
    assert token_mask(batch, (2, 3)).dtype == torch.bool
    assert token_mask(batch, (2,)) is None  # a sequence classifier's logits: no token axis
    assert token_mask((torch.ones(2, 3),), (2, 3)) is None


def test_state_losses_and_pooling_by_hand():
    s = torch.tensor([[[1.0, 0.0], [0.0, 1.0], [5.0, 5.0]]])
    t = torch.tensor([[[2.0, 0.0], [1.0, 1.0], [0.0, 0.0]]])
    mask = torch.tensor([[True, True, False]])
    assert pool(s, mask, "mean").tolist() == [[0.5, 0.5]]
    assert pool(s, mask, "cls").tolist() == [[1.0, 0.0]]
    # token 0: diff (1, 0) -> mean sq 0.5; token 1: (1, 0) -> 0.5; token 2 is padding
    assert float(state_loss(s, t, "mse", mask)) == 0.5
    # token 0: cos 1; token 1: cos 1/sqrt(2)
    assert float(state_loss(s, t, "cosine", mask)) == pytest.approx((0 + 1 - 1 / math.sqrt(2)) / 2, abs=1e-7)


def test_layers_are_paired_by_relative_depth():
    assert layer_pairs(2, 4) == [2, 4]
    assert layer_pairs(3, 12) == [4, 8, 12]
    assert layer_pairs(4, 6) == [2, 3, 4, 6]
    assert layer_pairs(6, 3) == [1, 1, 2, 2, 2, 3]
    s = tuple(torch.full((1, 2, 3), float(i)) for i in range(3))  # embeddings, layer 1, layer 2
    t = tuple(torch.full((1, 2, 3), 10.0 * i) for i in range(5))
    # student layer 1 <-> teacher layer 2 (20), student layer 2 <-> teacher layer 4 (40)
    assert float(intermediate_mse(s, t)) == ((20 - 1) ** 2 + (40 - 2) ** 2) / 2


def test_check_resolves_auto_and_names_mismatches():
    logits, hidden = Out(logits=torch.zeros(1, 2, 8)), Out(last_hidden_state=torch.zeros(1, 2, 4))
    assert DistillLoss("auto").check(logits, logits, {}).kind == "kl"
    auto = DistillLoss("auto").check(hidden, hidden, {})
    assert (auto.kind, auto.pooling, auto.name) == ("cosine", "mean", "cosine, pooling='mean'")
    assert DistillLoss("cosine").check(hidden, hidden, {}).pooling == "tokens"  # pooled only when asked
    assert DistillLoss("cosine", pooling="cls").check(hidden, hidden, {}).pooling == "cls"
    with pytest.raises(ValueError, match=r"the student's logits is 1x2x6 and the teacher's 1x2x8: KL needs the same "
                                         r"vocabulary \(the last axis: 6 vs 8\).*write loss='cosine'"):
        DistillLoss("kl").check(Out(logits=torch.zeros(1, 2, 6)), logits, {})
    with pytest.raises(ValueError, match=r"the student's last_hidden_state is 1x2x3 and the teacher's 1x2x4: mse "
                                         r"compares the states element by element, so their widths must match \(3 vs 4\)"):
        DistillLoss("mse").check(Out(last_hidden_state=torch.zeros(1, 2, 3)), hidden, {})
    with pytest.raises(ValueError, match=r"the student's mean-pooled last_hidden_state is 1x3 and the teacher's 1x4"):
        DistillLoss("cosine", pooling="mean").check(Out(last_hidden_state=torch.zeros(1, 2, 3)), hidden, {})
    with pytest.raises(ValueError, match=r"loss='kl' compares the models' logits, and the student's output "
                                         r"\(SimpleNamespace\) has none; write loss='cosine'"):
        DistillLoss("kl").check(hidden, hidden, {})
    with pytest.raises(ValueError, match=r"loss='auto' cannot tell what the models' plain tensor outputs are; write "
                                         r"loss='kl'"):
        DistillLoss("auto").check(torch.zeros(2, 3), torch.zeros(2, 3), {})
    with pytest.raises(ValueError, match=r"intermediate=1 needs the same hidden size \(student 3, teacher 4\)"):
        DistillLoss("kl", intermediate=1.0).check(
            Out(logits=torch.zeros(1, 2, 8), hidden_states=(torch.zeros(1, 2, 3),) * 2),
            Out(logits=torch.zeros(1, 2, 8), hidden_states=(torch.zeros(1, 2, 4),) * 3), {})


def test_plain_tensor_outputs_with_a_named_loss():
    s, t = torch.tensor([[1.0, 2.0]]), torch.tensor([[1.0, 4.0]])
    assert float(DistillLoss("mse").check(s, t, {})(s, t, {})) == 2.0
    assert float(DistillLoss("kl").check(s, t, {})(s, t, {})) == pytest.approx(_kl_reference(s[None], t[None], None, 1))
