"""Shared fixtures: tiny random HF checkpoints and tokenizers trained on the fly."""
from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA/ROCm GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


# --- model and checkpoint fixtures (owner: model/checkpoint) ---


# --- tokenizer fixtures (owner: tokenizer) ---
