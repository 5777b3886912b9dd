# Set-up commands from the README. Both build .venv on a machine with only Python 3 and make.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
# The CPU build of torch 2.13.0 is pinned here (not in the library's requirements, which say torch>=2.2).
TORCH  := torch==2.13.0
STAMP  := $(VENV)/.installed
# torchvision and timm for the model-zoo matrices (see test-zoo below)
ZOO    := .zoo
# prunekit's compiled sparse kernels (optional for the library, built for this machine's CPU)
KERNEL_SRC   := src/prunekit/sparse/csrc/linear.cpp
KERNEL_STAMP := src/prunekit/sparse/csrc/build/.built

.PHONY: test test-fast test-zoo lint demo bench clean kernels docs docs-check

$(STAMP): pyproject.toml setup.py Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q $(TORCH)
	$(PIP) install -q -e ".[test]" "$(TORCH)"
	touch $(STAMP)

# Static checks (configured in pyproject.toml): ruff, the import contracts, the private-name check, the
# size limits (tools/check_sizes.py) and the type checker; `make test` runs them first, so CI does too.
lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks examples tools setup.py
	$(VENV)/bin/lint-imports --no-cache
	$(PY) tools/check_private_imports.py src/prunekit
	$(PY) tools/check_sizes.py src/prunekit
	$(VENV)/bin/mypy src/prunekit

$(KERNEL_STAMP): $(STAMP) $(KERNEL_SRC) src/prunekit/sparse/native.py
	$(PY) -c "from prunekit.sparse import native; print('built', native.build())"
	touch $(KERNEL_STAMP)

kernels: $(KERNEL_STAMP)

# Everything CI runs: lint, the docs site and its browser check, every test (markers: pyproject.toml)
test: lint docs-check $(KERNEL_STAMP)
	$(PY) -m pytest tests

# The quick selection while working: no slow or multi-process tests
test-fast: $(STAMP)
	$(PY) -m pytest tests -m "not slow and not distributed"

# The model-zoo matrices (pytest -m zoo: every torchvision classifier, a list of timm families, the
# transformers families). torchvision and timm go into $(ZOO), beside the environment and not in it: the
# registry's torchvision wheel is a CUDA build whose compiled ops do not load beside the CPU torch, and
# transformers imports torchvision whenever it is installed (tests/helpers/vision_models.py defines the two op
# schemas it needs before importing it; nothing outside the tests would). --no-deps keeps torch as it is.
$(ZOO)/.installed: $(STAMP)
	$(PIP) install -q --no-deps --upgrade --target $(ZOO) "torchvision==0.28.*" "timm==1.0.31"
	touch $@

# The matrices alone; their table goes to docs/data/zoo.json, which the docs' supported-models page shows
test-zoo: $(ZOO)/.installed
	PYTHONPATH=$(ZOO) $(PY) -m pytest tests -m zoo --zoo-table docs/data/zoo.json

demo: $(STAMP)
	$(PY) examples/quickstart.py
	$(PY) examples/tensorplay_quickstart.py
	$(PY) examples/shrink_minilm.py demo-out/minilm-shrunk
	$(VENV)/bin/prunekit demo --out demo-out

# The documentation site, built with --strict (mkdocs.yml): build/site
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet

# Every page of the built site opened in headless Chromium (Debian's package, installed here when
# missing and apt-get is usable): fails on a console error, a failed request, a broken image or link.
# Screenshots go to build/site-shots.
docs-check: docs
	command -v chromium >/dev/null || { command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ] && \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null); } || true
	$(PY) tools/check_site.py build/site --shots build/site-shots

bench: $(STAMP)
	$(PY) benchmarks/bench_core.py

clean:
	rm -rf $(VENV) $(ZOO) .pytest_cache .hypothesis src/prunekit/sparse/csrc/build
