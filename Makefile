# specdistill: `make demo` and `make test` are all a fresh machine needs.
# The venv is (re)built only when pyproject.toml changes: a stamp file named after its hash marks it done.

SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
BOOT_PYTHON := $(shell command -v python3.11 || command -v python3)
STAMP := $(VENV)/.installed-$(shell sha256sum pyproject.toml | cut -c1-16)
QUESTIONS ?= ../shared/data/mt_bench/question.jsonl

.PHONY: venv test test-all test-gpu demo bench

venv: $(STAMP)

# torch first, pinned: the local CPU wheel satisfies the project's torch range, so the
# project install below adds nothing to it (a bare `torch` could pull a multi-GB CUDA build).
$(STAMP): pyproject.toml
	test -x $(PY) || $(BOOT_PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install torch==2.13.0
	$(PY) -m pip install -e '.[test,serve]'
	rm -f $(VENV)/.installed-*
	touch $@

# the default run: tiny models only, well under 30 minutes on 2 cores
test: venv
	$(PY) -m pytest -q -m "not slow and not gpu"

# also the slow tests (the embedded default target, minutes of CPU)
test-all: venv
	$(PY) -m pytest -q -m "not gpu"

test-gpu: venv
	$(PY) -m pytest -q -m gpu

demo: venv
	$(PY) -m decode.evaluate --drafter truncated:4 --questions $(QUESTIONS) --limit 4 --max-new-tokens 64 --out runs/demo

bench: venv
	$(PY) scripts/bench_decode.py
