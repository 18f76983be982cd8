# `make serve`: install and serve the embedded model. `make run`: generate offline.
# `make test`: install and run the tests (CI runs this).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PROMPT ?= ROMEO:

.PHONY: install run serve test lint bench-cpu clean

# torch, ninja and setuptools first: the package's install builds the compiled kernels of csrc/
# against that torch (setup.py; --no-build-isolation so the build sees it)
$(VENV)/.installed: pyproject.toml setup.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0 ninja "setuptools>=77"
	$(PY) -m pip install -q --no-build-isolation -e ".[test,ray]"
	touch $@

# the kernels again after csrc/ changes (prints what it built or skipped, and why)
$(VENV)/.kernels: $(VENV)/.installed $(wildcard csrc/*)
	-$(PY) -m pagedserve.kernels.build
	touch $@

install: $(VENV)/.kernels

run: install
	$(VENV)/bin/pagedserve generate "$(PROMPT)"

serve: install
	$(VENV)/bin/pagedserve serve

test: install
	$(VENV)/bin/ruff check pagedserve tests scripts
	$(PY) -m pytest -q -x --durations=15

lint: install
	$(VENV)/bin/ruff check pagedserve tests scripts
	$(VENV)/bin/ruff format --check pagedserve tests scripts

bench-cpu: install
	$(PY) scripts/bench_cpu_throughput.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache pagedserve/kernels/_built
