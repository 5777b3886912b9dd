"""Failure atomicity: a public function that changes a model, when it fails, leaves it exactly as it was.

One harness for every mutating public function. For each *case* (a function
called on a small model built fresh for every trial) it first runs the call
once, counting the places where a failure can strike, then reruns it once per
place with a failure injected there, and after each failed call compares the
WHOLE state against the state before the call (:func:`capture`): every
module's class, ``__dict__`` keys, parameters (by identity, dtype, shape,
bit-exact value, ``requires_grad``, ``.grad``), buffers (the same, plus which
are persistent), every hook dictionary in order (forward pre/post, backward,
state-dict and load hooks: keys, hook objects, a ``PruningContainer``'s
methods), the training flag, and the optimizer's param groups and state.

Injected failures (the ``KINDS``):

* ``interrupt@line`` / ``error@line``: ``KeyboardInterrupt`` / ``RuntimeError``
  raised before the *n*-th Python line executed in the traced sources
  (prunekit's package, plus what a case adds, e.g. ``torch/nn/modules/module.py``
  where torch copies a state dict) -- every step of the call, one per trial,
  exactly where Ctrl-C can land;
* ``interrupt@op`` / ``error@op``: the *n*-th tensor operation called from
  Python (a ``TorchFunctionMode``) raises instead of running -- a refused
  ``copy_``, a failing ``masked_fill_``, ``mul_``, ``clone``, ...;
* the case's own ``faults``: named set-ups of user code that fails (an
  importance function, a pruning method's ``compute_mask``, a hook).

A call that absorbs an injected failure and completes is not compared (it
succeeded); a call that raises must leave everything as it was.

Add a case for a function you own: append a :class:`Case` to ``CASES``::

    Case(
        "prune_groups",                      # test id
        setup=lambda: {"model": make_cnn()}, # a fresh env per trial; "model" required,
                                             # "optimizer" optional (its state is compared too)
        call=lambda env: prune_groups(env["model"], torch.randn(1, 3, 8, 8), 0.5),
        faults={"importance": lambda env: env.update(importance=boom)},  # optional
        trace=("prunekit",),                 # optional: more source trees to inject into
    )

Keep the model tiny (a few layers of a few units): the call runs once per
injection point. ``python tests/test_atomicity.py`` prints the number of
injected failures per case and in total.
"""

from __future__ import annotations

import copy
import dataclasses
import linecache
import os
import sys
import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

import prunekit
from prunekit import reparam

PRUNEKIT_DIR = os.path.dirname(prunekit.__file__) + os.sep
TORCH_MODULE_PY = os.path.join(os.path.dirname(torch.nn.modules.module.__file__), "module.py")
# Injection points per kind and case in the test suite (an even spread that keeps the first and the
# last); `python tests/test_atomicity.py --all` injects at every point.
MAX_POINTS = {"interrupt@line": 120, "error@line": 40, "interrupt@op": 60, "error@op": 30}


# --------------------------------------------------------------------- state
def _value(t: Optional[torch.Tensor]) -> Any:
    """A bit-exact copy of a tensor's value (NaN payloads and -0.0 included)."""
    if t is None:
        return None
    t = t.detach()
    return (t.dtype, tuple(t.shape), t.stride(), t.clone().contiguous().view(-1).view(torch.uint8)
            if t.numel() and t.dtype != torch.bool else t.clone())


def _tensor_state(t: Optional[torch.Tensor]) -> Any:
    if t is None:
        return None
    return (id(t), type(t), t.requires_grad, _value(t), id(t.grad) if t.grad is not None else None,
            _value(t.grad))


def _hooks(d: Dict[Any, Any]) -> List[Tuple[Any, int, Tuple[int, ...]]]:
    return [(k, id(h), tuple(id(x) for x in getattr(h, "_pruning_methods", ()))) for k, h in d.items()]


_HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks", "_backward_hooks", "_backward_pre_hooks",
               "_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
               "_load_state_dict_post_hooks", "_forward_hooks_with_kwargs", "_forward_pre_hooks_with_kwargs",
               "_forward_hooks_always_called")


# derived data a read may create, never state: the pruned tensors' no-grad cache (reparam's). Instead of
# its key, `capture` compares the value every pruned name serves, so a stale cache is still caught.
_DERIVED_KEYS = frozenset({"_prunekit_cache"})


def capture(model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None) -> Dict[Any, Any]:
    """Everything a failed call must leave alone, in comparable form."""
    out: Dict[Any, Any] = {}
    for name, m in model.named_modules(remove_duplicate=False):
        out[name, "class"] = type(m)
        out[name, "dict"] = sorted(k for k in m.__dict__ if k not in _DERIVED_KEYS)
        with torch.no_grad():
            out[name, "served"] = [(k, _value(getattr(m, k))) for k in sorted(reparam.pruned_names(m))]
        out[name, "training"] = m.training
        out[name, "params"] = [(k, _tensor_state(v)) for k, v in m._parameters.items()]
        out[name, "buffers"] = [(k, _tensor_state(v)) for k, v in m._buffers.items()]
        out[name, "non_persistent"] = sorted(m._non_persistent_buffers_set)
        out[name, "modules"] = [(k, id(v)) for k, v in m._modules.items()]
        for h in _HOOK_DICTS:
            d = m.__dict__.get(h)
            out[name, h] = _hooks(d) if isinstance(d, dict) else d
    if optimizer is not None:
        out["optimizer", "groups"] = [
            ([id(p) for p in g["params"]], sorted((k, repr(v)) for k, v in g.items() if k != "params"))
            for g in optimizer.param_groups
        ]
        out["optimizer", "state"] = sorted(
            (id(p), sorted((k, _value(v) if isinstance(v, torch.Tensor) else v) for k, v in s.items()))
            for p, s in optimizer.state.items()
        )
    return out


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype and \
            a.shape == b.shape and bool(torch.equal(a, b))
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


def differences(before: Dict[Any, Any], after: Dict[Any, Any]) -> List[str]:
    """The keys whose state differs (empty when nothing changed)."""
    keys = list(dict.fromkeys(list(before) + list(after)))
    return [f"{k}" for k in keys if k not in before or k not in after or not _equal(before[k], after[k])]


# --------------------------------------------------------------- injection
class Injected(RuntimeError):
    """The error the harness raises (``KeyboardInterrupt`` is raised as itself)."""


def _make(kind: str) -> BaseException:
    return KeyboardInterrupt() if kind.startswith("interrupt") else Injected(f"injected {kind}")


_WITH: Dict[Tuple[str, int], bool] = {}


def _is_with(filename: str, lineno: int) -> bool:
    """Lines where a tracer's exception models nothing real: never inject there.

    * a ``with`` line: CPython reports it again when the block ends, and an exception raised by a
      tracer *there* skips ``__exit__``;
    * a ``try:`` line: it compiles to a ``NOP``, where a real ``KeyboardInterrupt`` is never
      delivered (signals are handled at calls and backward jumps), and CPython 3.11 leaves the
      ``NOP`` of a ``try`` that opens a ``with`` block outside the block's exception table, so a
      tracer's exception there skips ``__exit__`` too (``with torch.no_grad(): try: ...`` would
      "leave" grad mode off, which no interrupt can do).
    """
    key = (filename, lineno)
    hit = _WITH.get(key)
    if hit is None:
        line = linecache.getline(filename, lineno).strip()
        hit = _WITH[key] = line.startswith(("with ", "async with ")) or line == "try:"
    return hit


def _run_by_finalizer(frame) -> bool:
    """Whether ``frame`` is a ``weakref.finalize`` callback: the garbage collector runs those at any line and
    Python ignores (prints) what they raise, so a failure injected there reaches no caller."""
    caller = frame.f_back
    return caller is not None and caller.f_code is weakref.finalize.__call__.__code__


class _LineInjector:
    """``sys.settrace``: count line events in the traced sources, or raise before the ``at``-th."""

    def __init__(self, roots: Sequence[str], at: Optional[int], kind: str) -> None:
        self.roots, self.at, self.kind, self.n = tuple(roots), at, kind, 0
        self.fired = False

    def _traced(self, filename: str) -> bool:
        return filename.startswith(self.roots) or filename in self.roots

    def global_trace(self, frame, event, arg):
        if event == "call" and self._traced(frame.f_code.co_filename) and not _run_by_finalizer(frame):
            return self.local_trace
        return None

    def local_trace(self, frame, event, arg):
        if event == "line" and not self.fired and not _is_with(frame.f_code.co_filename, frame.f_lineno):
            if self.n == self.at:
                self.fired = True
                self.n += 1
                raise _make(self.kind)
            self.n += 1
        return self.local_trace

    def __enter__(self):
        sys.settrace(self.global_trace)
        return self

    def __exit__(self, *exc):
        sys.settrace(None)
        return False


# attribute access (.grad, .shape) and the grad-mode switches of `with torch.no_grad()` (an exception
# raised inside __exit__'s switch would leave grad mode off for the whole process) are not ops
_NOT_OPS = frozenset({"__get__", "__set__", "_set_grad_enabled", "set_grad_enabled", "is_grad_enabled",
                      "_enter_inference_mode", "_exit_inference_mode", "is_inference_mode_enabled"})


class _OpInjector(TorchFunctionMode):
    """Count tensor operations called from Python, or make the ``at``-th raise instead of running."""

    def __init__(self, at: Optional[int], kind: str) -> None:
        super().__init__()
        self.at, self.kind, self.n, self.fired = at, kind, 0, False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name not in _NOT_OPS and not self.fired:
            if self.n == self.at:
                self.fired = True
                self.n += 1
                raise _make(self.kind)
            self.n += 1
        return func(*args, **kwargs)


@dataclasses.dataclass
class Case:
    """One mutating public function on one small model (see the module docstring)."""

    name: str
    setup: Callable[[], Dict[str, Any]]
    call: Callable[[Dict[str, Any]], Any]
    faults: Dict[str, Callable[[Dict[str, Any]], None]] = dataclasses.field(default_factory=dict)
    trace: Tuple[str, ...] = ()
    expect_success: bool = True  # the call succeeds when nothing is injected
    scale: float = 1.0  # share of MAX_POINTS injected in the suite (slow calls: tracing, calibration)

    def roots(self) -> Tuple[str, ...]:
        return (PRUNEKIT_DIR,) + tuple(self.trace)


def _injector(case: Case, kind: str, at: Optional[int]):
    return _OpInjector(at, kind) if kind.endswith("@op") else _LineInjector(case.roots(), at, kind)


def _points(n: int, cap: Optional[int]) -> List[int]:
    if cap is None or n <= cap:
        return list(range(n))
    step = (n - 1) / (cap - 1)
    return sorted({round(i * step) for i in range(cap)})


KINDS = ("interrupt@line", "error@line", "interrupt@op", "error@op")


def _global_modes() -> Tuple[bool, bool, int]:
    """Grad mode, inference mode and the depth of the torch-function mode stack."""
    return torch.is_grad_enabled(), torch.is_inference_mode_enabled(), torch._C._len_torch_function_stack()


def run_case(case: Case, kind: str, exhaustive: bool = False) -> Tuple[int, int, List[str]]:
    """``(failures injected, calls that absorbed theirs, problems)`` for one kind of failure."""
    try:  # warm-up: a first call imports modules and fills caches, steps the counted calls don't take
        case.call(case.setup())
    except Exception:  # noqa: BLE001 - the counted call below reports it
        pass
    env = case.setup()
    capture(env["model"], env.get("optimizer"))  # as before every injected call (capture reads the pruned names)
    with _injector(case, kind, None) as counter:
        result_error = None
        try:
            case.call(env)
        except Exception as e:  # noqa: BLE001 - reported below
            result_error = e
    if case.expect_success and result_error is not None:
        return 0, 0, [f"{case.name}: the call fails without injection: {result_error!r}"]
    total = counter.n
    problems: List[str] = []
    injected = absorbed = 0
    for at in _points(total, None if exhaustive else max(2, round(MAX_POINTS[kind] * case.scale))):
        env = case.setup()
        before = capture(env["model"], env.get("optimizer"))
        modes = _global_modes()
        inj = _injector(case, kind, at)
        raised: Optional[BaseException] = None
        with inj:
            try:
                case.call(env)
            except BaseException as e:  # noqa: BLE001 - KeyboardInterrupt included, on purpose
                raised = e
        if _global_modes() != modes:  # process-wide state is state too (grad mode leaking into the next call)
            problems.append(f"{case.name} [{kind} #{at} of {total}]: left {_global_modes()} (was {modes})")
            torch.set_grad_enabled(modes[0])
        if not inj.fired:
            continue
        injected += 1
        if raised is None:
            absorbed += 1
            continue
        diff = differences(before, capture(env["model"], env.get("optimizer")))
        if diff:
            problems.append(f"{case.name} [{kind} #{at} of {total}] {type(raised).__name__}: changed {diff[:4]}")
    return injected, absorbed, problems


def run_fault(case: Case, fault: str) -> List[str]:
    env = case.setup()
    case.faults[fault](env)
    before = capture(env["model"], env.get("optimizer"))
    try:
        case.call(env)
    except BaseException:  # noqa: BLE001
        diff = differences(before, capture(env["model"], env.get("optimizer")))
        return [f"{case.name} [fault {fault}]: changed {diff[:4]}"] if diff else []
    return [f"{case.name} [fault {fault}]: the faulty user code did not make the call fail"]


# ------------------------------------------------------------------- models
def _net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(2, 3, 3), nn.BatchNorm2d(3), nn.Flatten(), nn.Linear(12, 4), nn.Linear(4, 2))


_TEMPLATES: Dict[Any, Dict[str, Any]] = {}


def _env(pre: Optional[Callable[[nn.Module], None]] = None, optimizer: bool = True) -> Dict[str, Any]:
    """A fresh copy of a small trained model (with its SGD-momentum state), ``pre`` applied."""
    key = (pre, optimizer)
    if key not in _TEMPLATES:
        _TEMPLATES[key] = _build_env(pre, optimizer)
    return copy.deepcopy(_TEMPLATES[key])


def _build_env(pre: Optional[Callable[[nn.Module], None]], optimizer: bool) -> Dict[str, Any]:
    m = _net()
    if pre is not None:
        pre(m)
    env: Dict[str, Any] = {"model": m}
    if optimizer:
        opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
        m(torch.randn(2, 2, 4, 4)).sum().backward()
        opt.step()
        env["optimizer"] = opt
    return env


def _prepruned(m: nn.Module) -> None:
    prunekit.l1_unstructured(m[3], "weight", 0.25)
    prunekit.ln_structured(m[0], "weight", 1, n=2, dim=0)


def _raise(*args: Any, **kwargs: Any) -> Any:
    raise ValueError("user code failed")


class _UserMethod(prunekit.BasePruningMethod):
    """A user's pruning method: keeps entries whose score is above the median (or fails on demand)."""

    PRUNING_TYPE = "unstructured"
    fail = False

    def compute_mask(self, t: torch.Tensor, default_mask: torch.Tensor) -> torch.Tensor:
        if self.fail:
            raise ValueError("user compute_mask failed")
        return default_mask * (t.abs() > t.abs().median()).to(default_mask.dtype)


def _user_fails(env: Dict[str, Any]) -> None:
    _UserMethod.fail = True
    env["cleanup"] = lambda: setattr(_UserMethod, "fail", False)


def _load_env(src_pre: Callable[[nn.Module], None], dst_pre: Optional[Callable[[nn.Module], None]]) -> Dict[str, Any]:
    src = _net(1)
    src_pre(src)
    env = _env(dst_pre)
    env["sd"] = src.state_dict()
    return env


def _hook_fails(env: Dict[str, Any]) -> None:
    env["model"][4].register_load_state_dict_pre_hook(lambda *a, **k: _raise())


def _importance_fails(env: Dict[str, Any]) -> None:
    env["importance"] = _raise


def _bad_scores(env: Dict[str, Any]) -> None:
    m = env["model"]
    env["scores"] = {(m[4], "weight"): torch.full_like(m[4].weight, float("nan"))}


CORE_CASES: List[Case] = [
    Case("identity", lambda: _env(), lambda e: prunekit.identity(e["model"][3], "weight")),
    Case("random_unstructured", lambda: _env(), lambda e: prunekit.random_unstructured(e["model"][3], "weight", 0.5)),
    Case("l1_unstructured", lambda: _env(), lambda e: prunekit.l1_unstructured(e["model"][3], "weight", 0.5)),
    Case("l1_unstructured on a pruned tensor", lambda: _env(_prepruned),
         lambda e: prunekit.l1_unstructured(e["model"][3], "weight", 0.5, mask_dtype=None)),
    Case("l1_unstructured importance_scores", lambda: _env(),
         lambda e: prunekit.l1_unstructured(e["model"][4], "weight", 2,
                                            importance_scores=e.get("scores", {}).get("w", torch.arange(8.0).view(2, 4))),
         faults={"NaN scores": lambda e: e.update(scores={"w": torch.full((2, 4), float("nan"))})}),
    Case("random_structured", lambda: _env(), lambda e: prunekit.random_structured(e["model"][0], "weight", 1, dim=0)),
    Case("ln_structured", lambda: _env(_prepruned),
         lambda e: prunekit.ln_structured(e["model"][0], "weight", 1, n=1, dim=1)),
    Case("custom_from_mask", lambda: _env(_prepruned),
         lambda e: prunekit.custom_from_mask(e["model"][3], "weight", torch.ones(4, 12).tril())),
    Case("user method .apply", lambda: _env(_prepruned),
         lambda e: (_UserMethod.apply(e["model"][3], "weight"), e.get("cleanup", lambda: None)()),
         faults={"compute_mask": _user_fails}),
    Case("remove", lambda: _env(_prepruned), lambda e: prunekit.remove(e["model"][3], "weight")),
    Case("global_unstructured", lambda: _env(_prepruned),
         lambda e: prunekit.global_unstructured(
             [(e["model"][0], "weight"), (e["model"][3], "weight"), (e["model"][4], "weight")],
             prunekit.L1Unstructured, importance_scores=e.get("scores"), amount=0.5),
         faults={"NaN scores for the last tensor": _bad_scores}),
    Case("global_unstructured random", lambda: _env(),
         lambda e: prunekit.global_unstructured([(e["model"][3], "weight"), (e["model"][4], "bias")],
                                                prunekit.RandomUnstructured, amount=3)),
    Case("load_state_dict pruned into dense", lambda: _load_env(_prepruned, None),
         lambda e: prunekit.load_state_dict(e["model"], e["sd"]),
         faults={"load hook": _hook_fails}, trace=(TORCH_MODULE_PY,)),
    Case("load_state_dict dense into pruned", lambda: _load_env(lambda m: None, _prepruned),
         lambda e: prunekit.load_state_dict(e["model"], e["sd"]),
         faults={"load hook": _hook_fails}, trace=(TORCH_MODULE_PY,)),
    Case("load_state_dict pruned into empty (assign=True)", lambda: _load_env(_prepruned, None),
         lambda e: prunekit.load_state_dict(e["model"], e["sd"], assign=True),
         faults={"load hook": _hook_fails}, trace=(TORCH_MODULE_PY,)),
    Case("unmask (undo)", lambda: _env(_prepruned), lambda e: reparam.unmask(e["model"][3], "weight", bake=False)),
    Case("apply_mask", lambda: _env(_prepruned),
         lambda e: prunekit.methods.apply_mask(e["model"][4], "weight", torch.tensor([[1, 0, 1, 0], [0, 1, 1, 1]]))),
]


# ------------------------------------------------ the packages' mutating public functions
def _sparse_pre(m: nn.Module) -> None:
    prunekit.l1_unstructured(m[3], "weight", 0.75)
    prunekit.l1_unstructured(m[4], "weight", 0.75)


def _sparsified(m: nn.Module) -> None:
    _sparse_pre(m)
    prunekit.sparsify_for_inference(m, measure=False, policies=["csr-torch"])


class _Blocks(nn.Module):
    """An embedding layer and two repeated blocks (what ``prunekit.oneshot`` walks)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(4, 8)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.layers:
            x = block(x)
        return x


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))


_CALIBRATION = [torch.randn(16, 4, generator=torch.Generator().manual_seed(1))]
_X4 = torch.randn(2, 4, generator=torch.Generator().manual_seed(2))
_GRADUAL = {"prune_type": "magnitude", "pattern": "1x1", "target_sparsity": 0.5, "end_step": 2}


def _once(key: str, build: Callable[[], Any]) -> Any:
    """A fresh deep copy of what ``build`` makes, built once (a setup runs once per trial)."""
    if key not in _TEMPLATES:
        _TEMPLATES[key] = build()
    return copy.deepcopy(_TEMPLATES[key])


def _channel_masked_mlp() -> nn.Module:
    m = _mlp()
    prunekit.prune_groups(m, _X4, 0.5)
    return m


def _channel_masked() -> Dict[str, Any]:
    return {"model": _once("channel_masked", _channel_masked_mlp)}


def _compacted_files() -> Dict[str, Any]:
    from prunekit.compact import compact, compaction_description

    small = compact(_channel_masked_mlp(), _X4)
    return {"sd": small.state_dict(), "desc": compaction_description(small)}


def _compacted() -> Dict[str, Any]:
    return {"model": _mlp(), **_once("compacted", _compacted_files)}


def _fusable() -> nn.Module:
    m = _net()
    prunekit.l1_unstructured(m[0], "weight", 0.5)
    prunekit.l1_unstructured(m[3], "weight", 0.5)
    m.add_module("5", nn.ReLU())
    return m.eval()


PACKAGE_CASES: List[Case] = [
    Case("sparsify_for_inference", lambda: _env(_sparse_pre, optimizer=False),
         lambda e: prunekit.sparsify_for_inference(e["model"], measure=False, policies=["csr-torch"])),
    Case("restore_dense", lambda: _env(_sparsified, optimizer=False), lambda e: prunekit.restore_dense(e["model"])),
    Case("oneshot", lambda: {"model": _Blocks()},
         lambda e: prunekit.oneshot(e["model"], _CALIBRATION, sparsity=0.5, method="wanda")),
    Case("oneshot sparsegpt 2:4", lambda: {"model": _Blocks()},
         lambda e: prunekit.oneshot(e["model"], _CALIBRATION, pattern="2:4", method="sparsegpt"), scale=0.5),
    Case("prune_groups", lambda: {"model": _mlp()}, lambda e: prunekit.prune_groups(e["model"], _X4, 0.5, importance=e.get("importance", "l1")),
         faults={"importance": lambda e: e.update(importance=_raise)}, scale=0.4),
    Case("prune_with_calibration", lambda: {"model": _mlp()},
         lambda e: prunekit.compact.prune_with_calibration(e["model"], _CALIBRATION, 0.5), scale=0.4),
    Case("compact(inplace=True)", _channel_masked,
         lambda e: prunekit.compact.compact(e["model"], _X4, inplace=True), scale=0.4),
    Case("load_compacted", _compacted,
         lambda e: prunekit.compact.load_compacted(e["model"], e["sd"], e["desc"]), scale=0.4),
    Case("fuse_modules(inplace=True)", lambda: {"model": _once("fusable", _fusable)},
         lambda e: prunekit.fuse_modules(e["model"], [["0", "1"], ["4", "5"]], inplace=True)),
    Case("prepare_pruning", lambda: _env(),
         lambda e: prunekit.prepare_pruning(e["model"], _GRADUAL, e["optimizer"])),
]

#: every case; other packages append theirs below (one entry per mutating public function)
CASES: List[Case] = list(CORE_CASES) + PACKAGE_CASES


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_a_failure_anywhere_leaves_everything_as_it_was(case: Case, kind: str) -> None:
    injected, absorbed, problems = run_case(case, kind)
    assert not problems, "\n".join(problems[:10]) + (f"\n... {len(problems)} in all" if len(problems) > 10 else "")
    if kind.endswith("@line") or injected:  # (a call may run no tensor op at all: nothing to inject then)
        assert injected > absorbed, f"{case.name}: no injected {kind} made the call fail"


@pytest.mark.parametrize("case,fault", [(c, f) for c in CASES for f in c.faults],
                         ids=lambda x: x.name if isinstance(x, Case) else x)
def test_a_failing_user_function_leaves_everything_as_it_was(case: Case, fault: str) -> None:
    try:
        problems = run_fault(case, fault)
    finally:
        _UserMethod.fail = False
    assert not problems, problems


def test_the_harness_sees_a_half_done_change() -> None:
    """The comparison is not blind: a call that changes one value, one hook or one key is caught."""
    env = _env(_prepruned)
    before = capture(env["model"], env["optimizer"])
    with torch.no_grad():
        env["model"][3].weight_orig[0, 0] += 1
    assert differences(before, capture(env["model"], env["optimizer"])) == ["('3', 'served')", "('3', 'params')"]
    env = _env(_prepruned)
    before = capture(env["model"], env["optimizer"])
    env["model"][4].register_forward_pre_hook(lambda *a: None)
    env["optimizer"].state[env["model"][4].weight]["momentum_buffer"].zero_()
    assert differences(before, capture(env["model"], env["optimizer"])) == [
        "('4', '_forward_pre_hooks')", "('optimizer', 'state')"]


def main() -> int:
    exhaustive = "--all" in sys.argv
    total = 0
    bad = 0
    for case in CASES:
        counts = []
        for kind in KINDS:
            injected, absorbed, problems = run_case(case, kind, exhaustive)
            counts.append(injected)
            bad += len(problems)
            for p in problems[:3]:
                print("  PROBLEM", p)
        for fault in case.faults:
            counts.append(1)
            bad += len(run_fault(case, fault))
        total += sum(counts)
        print(f"{case.name:45s} {sum(counts):6d} injected failures ({', '.join(map(str, counts))})")
    print(f"total: {total} injected failures, {bad} left the model changed")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
