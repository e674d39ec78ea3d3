# Two commands a newcomer needs: `make demo` and `make test`. Both install from scratch into .venv.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install test demo bench clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# torch pinned to 2.13.0: the local CPU wheel (a bare `torch` pulls a multi-GB CUDA build)
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest -n 2 -q tests

demo: $(STAMP)
	$(BIN)/moekit demo --overwrite

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache
