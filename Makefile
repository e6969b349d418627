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

test: $(STAMP)
	JAX_PLATFORMS=cpu $(BIN)/python -m pytest

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
