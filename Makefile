# `make serve`: install and serve the embedded model. `make run`: generate offline.
# `make test`: install and run the tests (CI runs this).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PROMPT ?= ROMEO:

.PHONY: install run serve test lint bench-cpu clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[test]"
	touch $@

install: $(VENV)/.installed

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
	rm -rf $(VENV) .pytest_cache .ruff_cache
