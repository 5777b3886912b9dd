# Set-up commands from the README. Both build .venv on a machine with only Python 3 and make.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
# The CPU build of torch 2.13.0 is pinned here (not in the library's requirements, which say torch>=2.2).
TORCH  := torch==2.13.0
STAMP  := $(VENV)/.installed
# prunekit's compiled sparse kernels (optional for the library, built for this machine's CPU)
KERNEL_SRC   := src/prunekit/sparse/csrc/linear.cpp
KERNEL_STAMP := src/prunekit/sparse/csrc/build/.built

.PHONY: test lint demo bench clean kernels

$(STAMP): pyproject.toml setup.py Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q $(TORCH)
	$(PIP) install -q -e ".[test]" "$(TORCH)"
	touch $(STAMP)

# Static checks (configured in pyproject.toml); `make test` runs them first, so CI does too.
lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks examples tools setup.py
	$(VENV)/bin/lint-imports --no-cache
	$(PY) tools/check_private_imports.py src/prunekit

$(KERNEL_STAMP): $(STAMP) $(KERNEL_SRC) src/prunekit/sparse/native.py
	$(PY) -c "from prunekit.sparse import native; print('built', native.build())"
	touch $(KERNEL_STAMP)

kernels: $(KERNEL_STAMP)

test: lint $(KERNEL_STAMP)
	$(PY) -m pytest tests

demo: $(STAMP)
	$(PY) examples/quickstart.py
	$(PY) examples/tensorplay_quickstart.py
	$(VENV)/bin/prunekit demo --out demo-out

bench: $(STAMP)
	$(PY) benchmarks/bench_core.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis src/prunekit/sparse/csrc/build
