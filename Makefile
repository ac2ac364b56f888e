# HyAtlas Memory: `make run` starts every service, `make test` runs the tests.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PB := shared/pb
PROTOS := $(wildcard protos/*.proto)

.PHONY: run test protos lint bench venv clean

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

test: protos
	$(PY) -m pytest -q

lint: protos
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

bench: protos
	$(PY) -m bench.embedder
	$(PY) -m bench.locomo_retrieval

clean:
	rm -rf $(PB) .pytest_cache
