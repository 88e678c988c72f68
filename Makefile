# The two commands of the README: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# The demo needs the package alone; the tests and lint also need the dev extras (pytest, the
# Hugging Face oracles with the CPU torch wheel, the linters), about a minute more to install.
CORE_STAMP := $(VENV)/.installed-core
DEV_STAMP := $(VENV)/.installed-dev

.PHONY: demo test lint install clean-venv

$(CORE_STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e .
	touch $@

$(DEV_STAMP): $(CORE_STAMP)
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $@

install: $(DEV_STAMP)

demo: $(CORE_STAMP)
	$(PY) -m experiments.demo --workdir=runs/demo

# The layer contracts of pyproject.toml ([tool.importlinter]): a broken layer or an import cycle
# fails; then ruff's lint rules and its formatting ([tool.ruff]).
lint: $(DEV_STAMP)
	$(VENV)/bin/lint-imports
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# Then the expert-parallel tests, in a process of 8 simulated CPU devices (tests/conftest.py).
test: lint
	$(PY) -m pytest -q -n 2 --dist loadfile tests
	MOESPEC_TEST_MESH=1 $(PY) -m pytest -q tests/mesh

clean-venv:
	rm -rf $(VENV)
