"""prepare_pruning and the pruner callbacks are failure-atomic: on any exception, KeyboardInterrupt
included, the model (parameters, buffers, hooks, classes), the gradients, the optimizer (state and
step hooks) and the pruners' own state are bit for bit what they were; a retry then gives what an
uninterrupted run gives."""

import os
import sys

import pytest
import torch
from torch import nn

import prunekit as prune
from prunekit.training import PruningCallbacks, prepare_pruning
from prunekit.training import pruners as pruners_mod


pytestmark = pytest.mark.usefixtures("one_thread")


def bits(t):
    """A tensor's exact bits (-0.0 and NaN payloads included)."""
    t = t.detach()
    return t.reshape(-1).contiguous().view(torch.uint8).clone() if t.is_floating_point() else t.clone()


def snapshot(model, optimizer=None, callbacks=None):
    out = {}
    for qual, m in model.named_modules():
        out[qual, "class"] = type(m)
        out[qual, "params"] = [(k, id(v), bits(v), None if v.grad is None else bits(v.grad))
                               for k, v in m._parameters.items()]
        out[qual, "buffers"] = [(k, id(v), bits(v)) for k, v in m._buffers.items()]
        out[qual, "hooks"] = [(k, id(h)) for k, h in m._forward_pre_hooks.items()]
    if optimizer is not None:
        out["opt_state"] = {id(p): {k: bits(v) if torch.is_tensor(v) else v for k, v in s.items()}
                            for p, s in optimizer.state.items()}
        out["opt_hooks"] = (list(optimizer._optimizer_step_pre_hooks), list(optimizer._optimizer_step_post_hooks))
    if callbacks is not None:
        for i, p in enumerate(callbacks.pruners):
            out["pruner", i] = ({k: getattr(p, k) for k in p._SCALARS},
                                {n: bits(s) for n, s in p.scores.items()},
                                {n: id(s) for n, s in p.scores.items()})
        out["local_step"] = callbacks._local_step
    return out


def assert_same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        x, y = a[k], b[k]
        assert _eq(x, y), k


def _eq(x, y):
    if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
        return isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y)
    if isinstance(x, dict):
        return isinstance(y, dict) and x.keys() == y.keys() and all(_eq(x[k], y[k]) for k in x)
    if isinstance(x, (list, tuple)):
        return type(x) is type(y) and len(x) == len(y) and all(_eq(u, v) for u, v in zip(x, y))
    return x == y


def model_and_opt(seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    return model, opt


def train_step(model, opt, seed):
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(8, 12, generator=g), torch.randint(0, 4, (8,), generator=g)
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()


CONFIG = {"prune_type": "snip_momentum", "pattern": "1x1", "target_sparsity": 0.75, "start_step": 1,
          "end_step": 5, "pruners": [{"names": ["^0$", "^2$"]}, {"names": ["^4$"], "prune_type": "magnitude",
                                                                  "pattern": "4x1", "target_sparsity": 0.5}]}


class Boom(KeyboardInterrupt):
    pass


def inject(mp, owner, attr, n, when):
    """Make the ``n``-th call of ``owner.attr`` raise a KeyboardInterrupt, before or after its work.
    Returns the call counter."""
    real = getattr(owner, attr)
    calls = {"n": 0}

    def wrapped(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == n and when == "before":
            raise Boom(f"{attr} #{n} before")
        out = real(*args, **kwargs)
        if calls["n"] == n and when == "after":
            raise Boom(f"{attr} #{n} after")
        return out

    mp.setattr(owner, attr, wrapped)
    return calls


def prepared_model():
    """A model with one layer already pruned (its weight_orig keeps non-zero values at pruned entries),
    gradients, and an Adam optimizer with state."""
    model, opt = model_and_opt()
    train_step(model, opt, 0)
    opt.step()
    prune.l1_unstructured(model[2], "weight", 0.25)
    with torch.no_grad():
        model[2].weight_orig.neg_()  # negative values at pruned entries: re-masking would leave -0.0
    train_step(model, opt, 1)
    return model, opt


WIRING = __import__("prunekit.training.wiring", fromlist=["wiring"])
PREPARE_POINTS = [(pruners_mod, "zero_where_"), (WIRING, "get_pruner"), (PruningCallbacks, "wire"),
                  (pruners_mod.Pruner, "on_train_begin"), (pruners_mod, "_ensure_mask"),
                  (pruners_mod.Pruner, "_check_target"), (pruners_mod, "get_scheduler")]


def test_prepare_pruning_interrupted_anywhere_changes_nothing(monkeypatch):
    injected = 0
    for owner, attr in PREPARE_POINTS:
        for n in range(1, 10):
            fired = False
            for when in ("before", "after"):
                model, opt = prepared_model()
                before = snapshot(model, opt)
                with monkeypatch.context() as mp:
                    calls = inject(mp, owner, attr, n, when)
                    try:
                        prepare_pruning(model, CONFIG, opt)
                    except Boom:
                        fired = True
                        injected += 1
                        assert_same(before, snapshot(model, opt))
                assert calls["n"] > 0, f"{attr} is never called: the injection point is stale"
            if not fired:
                break
    assert injected >= 25, injected
    # and a run that is not interrupted prepares as usual
    model, opt = prepared_model()
    cb = prepare_pruning(model, CONFIG, opt)
    assert cb.wired and int((model[2].weight_mask == 0).sum()) == 64
    assert torch.equal(model[2].weight_orig[model[2].weight_mask == 0], torch.zeros(64))


STEP_POINTS = [(pruners_mod.Pruner, "_set_mask"), (pruners_mod, "zero_where_"), (pruners_mod, "select_lowest"),
               (pruners_mod.Pruner, "update_scores"), (pruners_mod.Pruner, "update_masks"),
               (pruners_mod, "clear_pruned_state_"), (pruners_mod, "fill_second_moments_")]


def _phase(mp_factory, cb, model, opt, event, point, counter):
    """Run ``event`` until it goes through, interrupting it at the n-th call of ``point`` for n = 1, 2, ...;
    after each interruption everything must be as before."""
    owner, attr = point
    for n in range(1, 100):
        before = snapshot(model, opt, cb)
        with mp_factory() as mp:
            inject(mp, owner, attr, n, "before" if n % 2 else "after")
            try:
                getattr(cb, event)()
                return
            except Boom:
                counter["failures"] += 1
                assert_same(before, snapshot(model, opt, cb))
    raise AssertionError("never went through")


@pytest.mark.parametrize("point", STEP_POINTS, ids=[a for _, a in STEP_POINTS])
def test_pruner_callbacks_interrupted_anywhere_roll_back_and_a_retry_gives_the_same_run(monkeypatch, point):
    def run(interrupt):
        model, opt = model_and_opt()
        cb = prepare_pruning(model, CONFIG)
        cb.attach_optimizer(opt)
        counter = {"failures": 0}
        for s in range(7):
            train_step(model, opt, 100 + s)
            cb.on_step_begin()
            if interrupt:
                _phase(monkeypatch.context, cb, model, opt, "on_before_optimizer_step", point, counter)
            else:
                cb.on_before_optimizer_step()
            opt.step()
            if interrupt:
                _phase(monkeypatch.context, cb, model, opt, "on_step_end", point, counter)
            else:
                cb.on_step_end()
        return {k: bits(v) for k, v in model.state_dict().items()}, opt, counter["failures"]

    reference, ref_opt, _ = run(False)
    got, opt, failures = run(True)
    assert failures > 0
    assert reference.keys() == got.keys()
    for k in reference:
        assert torch.equal(reference[k], got[k]), k
    assert int((got["0.weight_mask"] == 0).sum()) > 0
    for p, q in zip(ref_opt.state.values(), opt.state.values()):
        for k in p:
            assert torch.equal(torch.as_tensor(p[k]), torch.as_tensor(q[k])), k


def test_one_pruner_failing_rolls_back_the_others(monkeypatch):
    model, opt = model_and_opt()
    cb = prepare_pruning(model, dict(CONFIG, start_step=0), opt)
    train_step(model, opt, 0)
    cb.on_before_optimizer_step()
    opt.step()
    before = snapshot(model, opt, cb)

    def fail(step):
        raise Boom("second pruner")

    monkeypatch.setattr(cb.pruners[1], "update_masks", fail)
    with pytest.raises(Boom):
        cb.on_step_end()
    assert_same(before, snapshot(model, opt, cb))
    assert int((model[0].weight_mask == 0).sum()) == 0  # the first pruner's update was undone
    monkeypatch.undo()
    cb.on_step_end()
    assert int((model[0].weight_mask == 0).sum()) > 0


def test_load_state_dict_is_all_or_nothing():
    model, opt = model_and_opt()
    cb = prepare_pruning(model, dict(CONFIG, start_step=0, end_step=0), opt)
    train_step(model, opt, 0)
    opt.step()
    state = cb.state_dict()
    model2, opt2 = model_and_opt(1)
    cb2 = prepare_pruning(model2, dict(CONFIG, start_step=0, end_step=0), opt2)
    before = snapshot(model2, opt2, cb2)
    bad = {"pruners": [state["pruners"][0], dict(state["pruners"][1], masks={"4": torch.ones(3, 3)})]}
    with pytest.raises(ValueError, match="mask of '4' has shape"):
        cb2.load_state_dict(bad)
    assert_same(before, snapshot(model2, opt2, cb2))
    cb2.load_state_dict(state)
    for n in ("0", "2", "4"):
        assert torch.equal(model2.get_submodule(n).weight_mask, model.get_submodule(n).weight_mask)


# ------------------------------------------------------------------ an interrupt at any line
PRUNEKIT_DIR = os.path.dirname(prune.__file__) + os.sep


def _run_interrupted(fn, at):
    """Run ``fn()`` raising a KeyboardInterrupt before the ``at``-th line executed in prunekit's sources
    (``at=None``: only count them). Returns the number of lines seen."""
    seen = [0]

    def local(frame, event, arg):
        if event == "line":
            seen[0] += 1
            if seen[0] == at:
                raise Boom(f"line {at}: {frame.f_code.co_filename}:{frame.f_lineno}")
        return local

    def tracer(frame, event, arg):
        return local if frame.f_code.co_filename.startswith(PRUNEKIT_DIR) else None

    sys.settrace(tracer)
    try:
        fn()
    finally:
        sys.settrace(None)
    return seen[0]


def _points(total, count=40):
    return sorted({1 + round(i * (total - 1) / (count - 1)) for i in range(count)})


def _step_env():
    """An Adam-trained model mid-schedule, gradients ready: the next on_step_end updates masks."""
    model, opt = model_and_opt()
    cb = prepare_pruning(model, dict(CONFIG, start_step=0, end_step=4, update_frequency_on_step=2), opt)
    for s in range(2):
        train_step(model, opt, s)
        opt.step()
    train_step(model, opt, 2)
    cb.pruners[0].on_before_optimizer_step()  # scores for this step (the optimizer is not stepped here)
    cb.unwire()
    cb.attach_optimizer(opt)
    return model, opt, cb


@pytest.mark.parametrize("what", ["prepare_pruning", "on_step_end", "load_state_dict"])
def test_an_interrupt_at_any_line_changes_nothing(what):
    def env():
        if what == "prepare_pruning":
            model, opt = prepared_model()
            return model, opt, None, lambda: prepare_pruning(model, CONFIG, opt)
        model, opt, cb = _step_env()
        if what == "on_step_end":
            return model, opt, cb, cb.on_step_end
        other, other_opt, other_cb = _step_env()
        other_cb.on_step_end()
        state = other_cb.state_dict()
        return model, opt, cb, lambda: cb.load_state_dict(state)

    model, opt, cb, call = env()
    total = _run_interrupted(call, None)
    assert total > 50
    interrupted = 0
    for at in _points(total):
        model, opt, cb, call = env()
        before = snapshot(model, opt, cb)
        try:
            _run_interrupted(call, at)
        except Boom:
            interrupted += 1
            assert_same(before, snapshot(model, opt, cb))
            assert torch.is_grad_enabled()  # even when the interrupt skipped a `with no_grad()`'s __exit__
    assert interrupted >= 30
