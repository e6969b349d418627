# `make run`: the main job on the embedded default model.  `make test`: the test suite.
# Both create .venv from nothing on a fresh machine.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test venv clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e ".[test]"
	touch $(STAMP)

venv: $(STAMP)

run: $(STAMP)
	$(BIN)/inkling-generate

# two pytest workers (pytest-xdist), one test file per worker at a time: most tests are
# bound by single-threaded XLA compiles, so 2 cores run the suite in ~2/3 of the time
TEST_WORKERS ?= 2

# ruff first: a lint finding fails in a second, before the 10-minute suite
test: $(STAMP)
	$(BIN)/ruff check .
	JAX_PLATFORMS=cpu $(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
