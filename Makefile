# Two commands a newcomer needs: `make demo` and `make test`. Both install from scratch into .venv.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install sysdeps clients test demo docs bench clean gpu-wheels
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
SYSDEPS := espeak-ng flite sox

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# torch pinned to 2.13.0: the local CPU wheel (a bare `torch` pulls a multi-GB CUDA build)
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[test]'
	touch $(STAMP)

install: $(STAMP) sysdeps

# speech synthesis for the speech corpora (moekit.speech): Debian packages, installed once
sysdeps:
	@command -v espeak-ng >/dev/null && command -v flite >/dev/null && command -v sox >/dev/null || \
	  { $(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq $(SYSDEPS); }

# the other readers tests/test_clients.py runs (transformers 4.57.6, llama.cpp's converter): a venv and the
# llama-cpp-python sdist from the package registries, built once (about 2-3 minutes) and cached under ~/.cache
clients: $(STAMP)
	$(BIN)/python tests/clients_env.py

# loadgroup: the documentation walkthrough's pages (tests/test_readme.py, one xdist group) run on one worker, in order
test: $(STAMP) sysdeps clients
	$(BIN)/python -m pytest -n 2 --dist loadgroup -q tests

# the documentation site (mkdocs.yml, docs/) into site/; strict: a broken link or reference fails the build
docs: $(STAMP)
	$(BIN)/python -m mkdocs build --strict

demo: $(STAMP) sysdeps
	$(BIN)/moekit demo --overwrite

# what bench/gpu.sh installs on a lent GPU machine (Python 3.12; torch and Triton in its image, this project's pins
# not): wheels without their dependencies into .whl/, about 20 MB, carried with the run (docs/guides/distributed.md)
GPU_WHEELS := transformers==5.23.0 pydantic==2.14.3 pydantic-core==2.50.4 annotated-types typing-inspection \
  typing-extensions>=4.16 gguf==0.19.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 jiwer==4.0.0 rapidfuzz \
  liger-kernel==0.8.5
gpu-wheels:
	$(PY) -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 -d .whl \
	  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
	  $(foreach w,$(GPU_WHEELS),'$(w)')

clean:
	rm -rf $(VENV) build site src/*.egg-info .pytest_cache
