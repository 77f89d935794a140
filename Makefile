# Two commands: `make demo` and `make test` (the whole suite; `make test-quick` runs one test per module). They create
# .venv and install the project with its test extra when missing or when pyproject.toml changed.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-quick install clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/testbed demo

# Two worker processes (pytest-xdist): most tests are single-threaded XLA compiles, so on CI's 2 cores
# two workers halve the wall time; each worker starts its own 8 emulated devices (tests/conftest.py).
TEST_WORKERS ?= 2

# `make test` (and .ci/run) runs the whole suite; `make test-quick` runs one test per module (tests/conftest.py's
# --quick: those marked `quick`, else the module's first test not marked `slow`), the inner loop.
TEST_MARKERS ?=

test: $(STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) $(if $(TEST_MARKERS),-m "$(TEST_MARKERS)") $(PYTEST_ARGS)

test-quick: $(STAMP)
	$(MAKE) test PYTEST_ARGS="--quick $(PYTEST_ARGS)"

clean:
	rm -rf $(VENV) testbed-out .pytest_cache .hypothesis
