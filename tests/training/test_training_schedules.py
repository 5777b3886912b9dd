import math

import pytest
from hypothesis import given, settings, strategies as st

from prunekit.training.schedules import IterativeScheduler, OneshotScheduler, decay, get_scheduler

FORMULAS = {
    "linear": lambda s0, sf, p: s0 + (sf - s0) * p,
    "cos": lambda s0, sf, p: s0 + (sf - s0) * (1 - math.cos(math.pi * p)) / 2,
    "cube": lambda s0, sf, p: sf + (s0 - sf) * (1 - p) ** 3,
    "exp": lambda s0, sf, p: 1 - (1 - s0) * ((1 - sf) / (1 - s0)) ** p,
}


@pytest.mark.parametrize("kind", sorted(FORMULAS))
def test_values_follow_formula_and_end_exactly(kind):
    s = IterativeScheduler(10, 110, 0.9, initial_sparsity=0.1, decay_type=kind)
    for step in range(10, 111):
        p = (step - 10) / 100
        assert s.sparsity(step) == pytest.approx(FORMULAS[kind](0.1, 0.9, p), abs=1e-12)
    assert s.sparsity(110) == 0.9  # exactly, not approximately
    assert s.sparsity(500) == 0.9
    assert s.sparsity(0) == 0.1


def test_cube_is_zhu_gupta():
    # s_t = s_f + (s_0 - s_f) (1 - progress)^3 ; at progress 0.5 with s0=0, sf=0.8: 0.8 - 0.8/8 = 0.7
    assert decay("cube", 0.0, 0.8, 0.5) == pytest.approx(0.7, abs=1e-15)
    # the cube schedule prunes fast early: at 10 % progress it is above the linear schedule
    assert decay("cube", 0.0, 0.8, 0.1) > decay("linear", 0.0, 0.8, 0.1)
    assert decay("cube", 0.0, 0.8, 0.1) == pytest.approx(0.8 * (1 - 0.9 ** 3))


@settings(max_examples=40, deadline=None)
@given(
    start=st.integers(0, 50),
    span=st.integers(1, 200),
    freq=st.integers(1, 37),
    target=st.floats(0.0, 0.99),
    kind=st.sampled_from(sorted(FORMULAS)),
)
def test_every_schedule_updates_at_end_step_with_exact_target(start, span, freq, target, kind):
    s = IterativeScheduler(start, start + span, target, update_frequency_on_step=freq, decay_type=kind)
    steps = s.update_steps()
    assert steps[0] == start and steps[-1] == start + span
    assert s.sparsity(steps[-1]) == target
    values = [s.sparsity(t) for t in steps]
    assert all(a <= b + 1e-12 for a, b in zip(values, values[1:]))  # never decreases
    assert not s.is_update_step(start - 1) and not s.is_update_step(start + span + 1)


def test_update_steps_with_frequency():
    assert IterativeScheduler(2, 12, 0.5, update_frequency_on_step=3).update_steps() == [2, 5, 8, 11, 12]


def test_oneshot():
    s = get_scheduler(4, 4, 0.6)
    assert isinstance(s, OneshotScheduler)
    assert s.update_steps() == [4]
    assert [s.sparsity(t) for t in (3, 4, 5)] == [0.0, 0.6, 0.6]


def test_bad_schedule_arguments():
    with pytest.raises(ValueError, match=r"sparsity_decay_type='cubic'.*\['cos', 'cube', 'exp', 'linear'\]"):
        get_scheduler(0, 10, 0.5, decay_type="cubic")
    with pytest.raises(ValueError, match="end_step=3 is before start_step=5"):
        get_scheduler(5, 3, 0.5)
