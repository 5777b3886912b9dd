"""prunekit.transaction: the one rollback mechanism (module states, tensor values, hooks)."""

import signal
from unittest import mock

import pytest
import torch
from torch import nn

import prunekit
from prunekit import reparam
from prunekit.compact.surgery.journal import Journal
from prunekit.training._undo import UndoLog
from prunekit.transaction import ModuleState, Transaction, atomic


def _state(m):
    return (type(m), dict(m.__dict__), dict(m._parameters), dict(m._buffers), dict(m._modules),
            dict(m._forward_pre_hooks), set(m._non_persistent_buffers_set))


def _same(a, b):
    """Equal structure, the very same objects."""
    assert a[0] is b[0]
    for x, y in zip(a[1:6], b[1:6]):
        assert list(x) == list(y)
        assert all(x[k] is y[k] for k in x)
    assert a[6] == b[6]


def _mutate(m):
    m.weight = nn.Parameter(torch.zeros(5, 5))
    m.bias = None
    m.register_buffer("extra", torch.ones(2), persistent=False)
    m.add_module("child", nn.ReLU())
    m.register_forward_pre_hook(lambda mod, args: None)
    m.flag = True
    with torch.no_grad():
        m.weight.add_(1)


@pytest.mark.parametrize("exc", [RuntimeError("boom"), KeyboardInterrupt()])
def test_atomic_restores_structure_and_values_after_failure(exc):
    torch.manual_seed(0)
    m = nn.Linear(4, 3)
    before, w, values = _state(m), m.weight, m.weight.detach().clone()
    with pytest.raises(type(exc)):
        with atomic() as txn:
            txn.module(m)
            txn.tensor(m.weight)
            with torch.no_grad():
                m.weight.mul_(-1)
            _mutate(m)
            raise exc
    _same(_state(m), before)
    assert m.weight is w and torch.equal(m.weight, values)
    assert len(txn) == 0


def test_success_keeps_changes_and_runs_no_rollback():
    m, seen = nn.Linear(2, 2), []
    with atomic() as txn:
        txn.module(m)
        txn.on_rollback(lambda: seen.append("rollback"))
        m.bias = None
    assert m.bias is None and seen == []


def test_hooks_run_once():
    seen = []
    txn = Transaction()
    txn.on_commit(lambda: seen.append("commit"))
    txn.on_rollback(lambda: seen.append("rollback"))
    txn.add(lambda: seen.append("undo"))
    txn.rollback()
    txn.rollback()
    txn.commit()
    assert seen == ["undo", "rollback"]

    seen.clear()
    with atomic() as txn:
        txn.on_commit(lambda: seen.append("commit"))
        txn.on_rollback(lambda: seen.append("rollback"))
    txn.commit()
    txn.rollback()
    assert seen == ["commit"]


def test_after_restore_runs_once_per_restore():
    calls = []
    m = nn.Linear(2, 2)
    txn = Transaction(lambda mod, state: calls.append((mod, state.module)))
    txn.module(m)
    txn.module(m)  # the first record counts
    txn.rollback()
    assert calls == [(m, m)]


def test_undo_steps_run_newest_first_each_once():
    t = torch.tensor([1.0, -2.0, float("nan"), -0.0])
    ref = t.clone()
    txn = Transaction()
    where = t != 1
    txn.entries(t, where)
    with torch.no_grad():
        t[where] = 5
    txn.entries(t)
    with torch.no_grad():
        t.fill_(7)
    txn.rollback()
    assert torch.equal(t.isnan(), ref.isnan())
    assert t[:2].tolist() == [1.0, -2.0] and torch.signbit(t[3])


def test_no_copy_of_tensors_that_are_not_mutated():
    m = nn.Linear(3, 2)
    w, b = m.weight, m.bias
    with mock.patch.object(torch.Tensor, "clone", side_effect=AssertionError("a tensor was copied")):
        state = ModuleState(m)
        txn = Transaction()
        txn.module(m)
        txn.entries(m.bias, torch.tensor([True, False]))  # the selected entries only, no clone
        m.weight = nn.Parameter(torch.zeros(2, 3))
        txn.rollback()
    assert state.params["weight"] is w and state.params["bias"] is b
    assert m.weight is w and m.bias is b


def test_entries_keep_only_the_selected_values():
    t = torch.arange(6.0)
    where = torch.tensor([True, False, False, True, False, False])
    txn = Transaction()
    txn.entries(t, where)
    cells = [c.cell_contents for c in txn._steps[0].__closure__]
    saved = [c for c in cells if isinstance(c, torch.Tensor) and c.dtype == t.dtype]
    assert sorted(s.numel() for s in saved) == [2, 6]  # the 2 kept values, and `t` itself (no copy of it)
    assert any(s is t for s in saved)


def test_tensor_copy_written_back_only_if_changed():
    t = torch.ones(3)
    txn = Transaction()
    txn.tensor(t)
    txn.tensor(t)  # the first call counts
    assert len(txn) == 1
    version = t._version
    txn.rollback()
    assert t._version == version  # unchanged: not written


def test_pruning_container_restored():
    m = nn.Linear(4, 1, bias=False)
    prunekit.l1_unstructured(m, "weight", 1)
    prunekit.l1_unstructured(m, "weight", 1)
    container = next(h for h in m._forward_pre_hooks.values() if hasattr(h, "_pruning_methods"))
    before = tuple(container._pruning_methods)
    state = ModuleState(m)
    prunekit.l1_unstructured(m, "weight", 1)
    assert len(container._pruning_methods) == 3
    state.restore()
    assert tuple(container._pruning_methods) == before


def test_journal_rollback_refreshes_rnn_flat_weights():
    lstm = nn.LSTM(2, 3)
    w = lstm.weight_ih_l0
    j = Journal()
    j.module(lstm)
    lstm.weight_ih_l0 = nn.Parameter(torch.zeros(12, 2))
    assert lstm._flat_weights[0] is not w
    j.rollback()
    assert lstm.weight_ih_l0 is w and lstm._flat_weights[0] is w


def test_undo_log_and_snapshot_are_the_transaction_types():
    assert issubclass(UndoLog, Transaction) and issubclass(Journal, Transaction)
    assert issubclass(reparam.Snapshot, ModuleState)
    m = nn.Linear(2, 2)
    prunekit.l1_unstructured(m, "weight", 1)
    snap = reparam.Snapshot(m)
    prunekit.remove(m, "weight")
    snap.restore()
    assert reparam.is_masked(m, "weight") and int((m.weight == 0).sum()) == 1


def test_interrupt_during_rollback_is_held_until_it_is_done():
    seen = []
    txn = Transaction()
    txn.add(lambda: seen.append("oldest"))
    # raise_signal delivers to this thread: os.kill(getpid()) may land on another of the process's threads, and
    # Python then runs the handler in the main thread at some later point, after the rollback may have ended
    txn.add(lambda: (signal.raise_signal(signal.SIGINT), seen.append("newest")))
    # Python's own handler, whatever the process inherited (a job started in the background ignores SIGINT)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            txn.rollback()
    finally:
        signal.signal(signal.SIGINT, previous)
    assert seen == ["newest", "oldest"]
