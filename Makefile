# Crescent. `make demo` runs the main job, `make test` the tests; both set up .venv first.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: setup test demo bench proto clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

setup: $(STAMP)

test: setup
	$(PY) -m pytest -q -p no:cacheprovider tests

demo: setup
	$(PY) -m engine.serve.demo

# Redis is a baseline in the store benchmark when Debian's redis-server is present.
bench: setup
	-command -v redis-server >/dev/null || { apt-get -qq update && apt-get -qq install -y redis-server; } >/dev/null 2>&1
	$(PY) bench/store_bench.py

proto: setup
	$(PY) -m grpc_tools.protoc -I . --python_out=. --pyi_out=. --grpc_python_out=. proto/crescent/v1/*.proto

clean:
	rm -rf $(VENV) build *.egg-info
