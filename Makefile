# Crescent. `make demo` runs the main job, `make test` the tests; both set up .venv first.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
# Installs keep pip's bytecode compilation (~25 s a venv here): where PYTHONDONTWRITEBYTECODE is set
# (this machine's CI), a venv installed with --no-compile compiles torch and vLLM again in every process.
# vLLM (CPU build) for the integration tests, in its own venv: it pulls many packages.
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed-stamp

# LMCache and SGLang for their integration tests, each in its own venv (.venv-lmcache, .venv-sglang).
INTEGRATION_REQS := tests/integrations/requirements

.PHONY: setup setup-vllm setup-lmcache setup-sglang setup-tools test demo bench proto clean rdma-setup gpu-wheels

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

setup: $(STAMP)

# promtool (Debian's prometheus) checks and unit-tests deploy/prometheus; etcd (Debian's etcd-server)
# backs the conductor high-availability tests; chromium and its driver load the conductor's web console
# in a real browser. Without them those tests skip (under CI they fail instead).
setup-tools:
	-command -v promtool >/dev/null || { apt-get -qq update && apt-get -qq install -y prometheus; } >/dev/null 2>&1
	-command -v etcd >/dev/null || { apt-get -qq update && apt-get -qq install -y etcd-server; } >/dev/null 2>&1
	-command -v chromedriver >/dev/null || { apt-get -qq update && apt-get -qq install -y chromium chromium-driver; } >/dev/null 2>&1

# torchvision/torchaudio/torchcodec come as CUDA builds that break `import vllm` on CPU;
# nothing here needs them. Offline, a failed install does not stop `make test`: the vLLM
# test then skips and prints the reason left in $(VLLM_VENV)/.unavailable. Under CI
# (CI=true) it fails the run, so that a broken dependency cannot land green.
$(VLLM_STAMP): pyproject.toml
	rm -f $(VLLM_VENV)/.unavailable
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q -e '.[vllm]'
	$(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_PY) -c "import vllm, transformers, kvstore.integrations.vllm"
	touch $(VLLM_STAMP)

setup-vllm:
	@$(MAKE) --no-print-directory $(VLLM_STAMP) && rm -f $(VLLM_VENV)/.unavailable || { \
	  if [ "$$CI" = true ]; then echo "make setup-vllm failed under CI: the vLLM integration cannot be tested" >&2; exit 1; fi; \
	  mkdir -p $(VLLM_VENV); \
	  echo "vLLM venv could not be created: make setup-vllm failed (see its output)" > $(VLLM_VENV)/.unavailable; }

# $(call integration-venv,NAME,PACKAGE==VERSION,EXTRAS): .venv-NAME with this project (CPU torch), the
# package without its declared dependencies (they name CUDA builds), then what it needs on CPU from
# $(INTEGRATION_REQS)/NAME.txt, torch held by constraints.txt. As with vLLM: outside CI a failed
# install leaves .venv-NAME/.unavailable and the tests skip with it (until a later make finds the venv
# whole again); under CI it fails the run.
define integration-venv
.venv-$(1)/.installed-stamp: pyproject.toml $(INTEGRATION_REQS)/$(1).txt $(INTEGRATION_REQS)/constraints.txt
	rm -f .venv-$(1)/.unavailable
	test -x .venv-$(1)/bin/python || $(PYTHON) -m venv .venv-$(1)
	.venv-$(1)/bin/python -m pip install -q -c $(INTEGRATION_REQS)/constraints.txt -e '.$(3)'
	.venv-$(1)/bin/python -m pip install -q --no-deps '$(2)'
	.venv-$(1)/bin/python -m pip install -q -c $(INTEGRATION_REQS)/constraints.txt -r $(INTEGRATION_REQS)/$(1).txt
	.venv-$(1)/bin/python -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__; import kvstore.integrations.$(1)"
	touch .venv-$(1)/.installed-stamp

setup-$(1):
	@$$(MAKE) --no-print-directory .venv-$(1)/.installed-stamp && rm -f .venv-$(1)/.unavailable || { \
	  if [ "$$$$CI" = true ]; then echo "make setup-$(1) failed under CI: the $(1) integration cannot be tested" >&2; exit 1; fi; \
	  mkdir -p .venv-$(1); \
	  echo "$(1) venv could not be created: make setup-$(1) failed (see its output)" > .venv-$(1)/.unavailable; }
endef
$(eval $(call integration-venv,lmcache,lmcache==0.5.6,))
$(eval $(call integration-venv,sglang,sglang==0.5.23,[kernels]))

# The four venvs and the tools build side by side (a fresh clone here: 2.7 min, against 6-7 one after
# another: pip waits on downloads and unpacking as much as on the CPU); each one's output shows when it is done.
test:
	@echo "building .venv, .venv-vllm, .venv-lmcache, .venv-sglang side by side (a few minutes on a fresh clone)"
	@$(MAKE) --no-print-directory -j5 --output-sync=target setup setup-vllm setup-lmcache setup-sglang setup-tools
	@$(MAKE) --no-print-directory rdma-setup
	$(PY) -m pytest -q -p no:cacheprovider --durations=25 tests

demo: setup
	$(PY) -m engine.serve.demo

# Redis is a baseline in the store benchmark when Debian's redis-server is present.
bench: setup
	-command -v redis-server >/dev/null || { apt-get -qq update && apt-get -qq install -y redis-server; } >/dev/null 2>&1
	$(PY) bench/store_bench.py
	$(PY) bench/prefix_reuse_bench.py
	$(PY) bench/serving_bench.py
	$(PY) bench/batch_bench.py
	$(PY) bench/replay_bench.py

# Best effort: Debian's python3-pyverbs, linked into .venv through a .pth file that
# names a folder holding only a link to the system package (no other system modules leak in).
rdma-setup: setup
	-dpkg -s python3-pyverbs >/dev/null 2>&1 || { apt-get -qq update && apt-get -qq install -y python3-pyverbs; } >/dev/null 2>&1
	-test -d /usr/lib/python3/dist-packages/pyverbs && mkdir -p $(VENV)/pyverbs-link && \
	  ln -sfn /usr/lib/python3/dist-packages/pyverbs $(VENV)/pyverbs-link/pyverbs && \
	  echo "$(abspath $(VENV))/pyverbs-link" > $$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/crescent-pyverbs.pth
	$(PY) -c 'from kvstore.transport.rdma import probe; print("rdma:", probe() or "available")'

proto: setup
	$(PY) -m grpc_tools.protoc -I . --python_out=. --pyi_out=. --grpc_python_out=. proto/crescent/v1/*.proto

clean:
	rm -rf $(VENV) $(VLLM_VENV) .venv-lmcache .venv-sglang build *.egg-info

# Wheels the GPU machine lacks (Python 3.12 there; its package list: the device library's KINDS.md):
# this project's grpcio/protobuf pins, grpcio-health-checking (kvstore.server imports it), lmdb,
# pyzmq (KV events; test modules import it) and the test tools; in .whl/structured, xgrammar and what
# it needs beyond the machine's torch/transformers (structured outputs, an optional extra: installed
# apart, so that they cannot fail the rest). `run` carries .whl/ (kept out of
# git); bench/gpu_check.sh installs them. Checked here by a Python 3.12-less stand-in: a venv with only
# that machine's packages collects `pytest -m gpu tests` and runs the prefix-reuse bench.
gpu-wheels: setup
	grep -qx '.whl/' .git/info/exclude 2>/dev/null || echo '.whl/' >> .git/info/exclude
	$(PY) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
	  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 -d .whl \
	  lmdb grpcio==1.85.1 grpcio-health-checking==1.85.1 pyzmq "protobuf==$$($(PY) -c 'import google.protobuf as p; print(p.__version__)')" \
	  "hypothesis==$$($(PY) -c 'import hypothesis as h; print(h.__version__)')" sortedcontainers attrs pytest-timeout
	$(PY) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
	  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 -d .whl/structured \
	  $$($(PY) -c 'import importlib.metadata as m; print(*(f"{n}=={m.version(n)}" for n in ("xgrammar", "apache-tvm-ffi", "pydantic", "pydantic-core", "annotated-types", "typing-inspection", "typing-extensions")))')
