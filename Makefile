# The two commands a fresh machine needs:  `make demo`  and  `make test`.
PYTHON ?= python3
DEMO_DIR := checkpoints/redline/tiny-python
DEMO_PROMPT ?= def fibonacci(n):
export PYTHONPATH := $(CURDIR)

.PHONY: setup demo test convert-demo

# torch first (the CPU wheel where no torch is installed), so the project's install never pulls a CUDA build.
# SKIP_SETUP=1 skips installing (the tests use it to run `make demo` in a scratch clone).
setup:
ifndef SKIP_SETUP
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PYTHON) -m pip install -q torch==2.13.0
	$(PYTHON) -m pip install -q -e ".[test]"
endif

convert-demo: setup
	$(PYTHON) scripts/convert_hf_checkpoint.py --checkpoint_dir $(DEMO_DIR) --dtype float32

demo: convert-demo
	$(PYTHON) generate.py --checkpoint_path $(DEMO_DIR) --prompt "$(DEMO_PROMPT)" --max_new_tokens 120 --temperature 0

test: setup
	$(PYTHON) -m pytest -q
